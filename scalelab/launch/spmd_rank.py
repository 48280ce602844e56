"""The rank side of an SPMD pool (`scalelab.launch.spmd`): what each rank process runs.

    python -m scalelab.launch.spmd_rank --pool DIR

A rank joins the process group once, then runs job-<i>.json for i = 0, 1, ... (each names an importable
`module:function` and its keyword arguments), writing result-<i>-<rank>.json or error-<i>-<rank>.json, until the
pool writes `stop` or its owner (the notebook's kernel) is gone.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from ..errors import LaunchError
from ..run.procs import exit_with_parent, is_peer_failure, redirect_output

POLL_S = 0.02


def resolve(target: str):
    """The function `module:function` names; a module whose file changed since it was imported is reloaded."""
    module_name, _, name = target.partition(":")
    module = sys.modules.get(module_name)
    if module is not None and _changed(module):
        module = importlib.reload(module)
    elif module is None:
        importlib.invalidate_caches()  # a file written after this process started
        module = importlib.import_module(module_name)
        module.__scalelab_mtime__ = _mtime(module)
    try:
        return getattr(module, name)
    except AttributeError:
        raise LaunchError(f"module {module_name!r} has no function {name!r}") from None


def _mtime(module) -> float | None:
    path = getattr(module, "__file__", None)
    return os.stat(path).st_mtime_ns if path and os.path.exists(path) else None


def _changed(module) -> bool:
    seen = getattr(module, "__scalelab_mtime__", None)
    now = _mtime(module)
    if seen is None or now == seen:
        module.__scalelab_mtime__ = now
        return False
    return True


def rank_main(pool_dir: str) -> int:
    """One rank: join the group, then run job-<i>.json for i = 0, 1, ... until the pool says stop."""
    from ..dist import rank_info
    exit_with_parent()  # also mid-job: the owner's check between jobs would not reach a rank stuck in one
    pool_dir = Path(pool_dir)
    conf = json.loads((pool_dir / "pool.json").read_text())
    info = rank_info()
    redirect_output(pool_dir / f"rank-{info.rank}.log")
    i = 0
    try:
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if conf["init"] != "none" and info.world_size > 1:
            _join_group(conf["init"], info)
    except BaseException as e:  # noqa: BLE001 - a rank that cannot join fails the first job
        _report(pool_dir, 0, info.rank, e)
        return 1
    while True:
        job = _next_job(pool_dir, i, conf["owner_pid"])
        if job is None:
            break
        try:
            value = resolve(job["target"])(**job["kwargs"])
            write_atomic(pool_dir / f"result-{i}-{info.rank}.json", value)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent, with its traceback
            _report(pool_dir, i, info.rank, e)
            return 1
        i += 1
    _leave_group()
    return 0


def _next_job(pool_dir: Path, i: int, owner_pid: int):
    """The i-th job, or None when the pool is closed or its owner (the notebook's kernel) is gone."""
    import psutil
    path, last_check = pool_dir / f"job-{i}.json", time.monotonic()
    while not path.exists():
        if (pool_dir / "stop").exists():
            return None
        if time.monotonic() - last_check > 2:
            last_check = time.monotonic()
            if not psutil.pid_exists(owner_pid):
                return None
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def _report(pool_dir: Path, job: int, rank: int, e: BaseException) -> None:
    write_atomic(pool_dir / f"error-{job}-{rank}.json",
           {"rank": rank, "error": type(e).__name__, "message": str(e), "t": time.time(),
            "traceback": traceback.format_exc(), "peer_failure": is_peer_failure(e)})
    traceback.print_exc()


def _join_group(init: str, info) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if init == "auto" else init
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    from ..run.rendezvous import join_store
    timeout = timedelta(seconds=60)
    store = join_store(info.rank, info.world_size, timeout)  # the pool's own rendezvous; None: env:// as before
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout,
                            **({"store": store} if store is not None else {}))


def _leave_group():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.destroy_process_group()


def write_atomic(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, default=_plain))
    tmp.rename(path)  # atomic: the reader never sees half a file


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"rank result holds a {type(value).__name__}, which is not JSON data")


def main(argv=None) -> int:
    """`python -m scalelab.launch.spmd_rank --pool DIR`: what each rank runs."""
    parser = argparse.ArgumentParser(prog="python -m scalelab.launch.spmd_rank", description=rank_main.__doc__)
    parser.add_argument("--pool", required=True, help="the pool's folder holding pool.json and job files")
    return rank_main(parser.parse_args(argv).pool)


if __name__ == "__main__":
    sys.exit(main())
