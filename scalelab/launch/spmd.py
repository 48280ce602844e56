"""Run one importable function on N local ranks and collect what each rank returns (SPMD experiments).

Training runs go through a RunSpec and `launch()`; the labs also need small distributed experiments that are
not a training run: time an allreduce, compare gradients averaged by hand with DDP's, check that replicas stay
identical, try a Horovod port. `run_spmd` starts N ranks of `module:function`, each in its own process, and
returns the list of their (JSON-able) return values, rank 0 first:

    from scalelab.launch.spmd import run_spmd
    results = run_spmd("scalelab.experiments.collectives:allreduce_sweep", world=2,
                       kwargs={"sizes": [1024, 1 << 20]}, timeout=60)

- launcher "local": ranks get torchrun's variables and a gloo process group is ready when the function runs
  (`init="gloo"`; `init="none"` leaves that to the function).
- launcher "horovodrun" (Gloo controller) or "mpirun" (MPI controller): the function calls `hvd.init()` itself.

The function must live in an importable module (a spawned rank cannot see a notebook's globals); the caller's
working directory is on the ranks' PYTHONPATH, so a module a notebook wrote with `%%writefile` imports too.
A rank that raises writes its traceback; the first failure ends every rank and raises `RunFailed` naming it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..errors import LaunchError, RunFailed, RunTimeout
from ..run import describe_exit, free_port, kill_processes, scrub_env
from .base import find_tool, start_process
from .local import rank_env

LAUNCHERS = ("local", "horovodrun", "mpirun")
POLL_S = 0.05


def run_spmd(target: str, world: int = 2, kwargs: dict | None = None, *, launcher: str = "local",
             init: str = "gloo", threads: int = 0, timeout: float = 120, run_dir: str | Path | None = None,
             env: dict | None = None) -> list:
    """Run `target` ("module:function") on `world` ranks; returns each rank's return value, rank order.

    `threads`: torch intra-op threads per rank (0: this machine's CPUs shared among the ranks). `env` is added
    to every rank's environment after the enclosing run's distributed variables are scrubbed (so e.g.
    HOROVOD_TIMELINE reaches the ranks). Output of rank r goes to `<run_dir>/rank-<r>.log`.
    """
    _check_args(target, world, launcher, init)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="scalelab-spmd-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("result-*.json"):
        old.unlink()
    (run_dir / "job.json").write_text(json.dumps({"target": target, "kwargs": kwargs or {}, "init": init}))
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    base = scrub_env()
    base.update(env or {})
    base["OMP_NUM_THREADS"] = str(threads)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), base.get("PYTHONPATH", "")) if p)
    procs = _start(launcher, world, run_dir, base, threads, sorted(env or {}))
    return _collect(procs, world, run_dir, timeout, per_rank=launcher == "local")


def _check_args(target, world, launcher, init):
    if not isinstance(target, str) or target.count(":") != 1:
        raise LaunchError(f"target {target!r} must be 'module:function', e.g. "
                          "'scalelab.experiments.collectives:allreduce_sweep'")
    if launcher not in LAUNCHERS:
        raise LaunchError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if init not in ("gloo", "none"):
        raise LaunchError(f"init {init!r} must be 'gloo' (a process group is ready) or 'none'")
    if not isinstance(world, int) or world < 1:
        raise LaunchError(f"world {world!r} must be a positive number of ranks")


def _rank_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "scalelab.launch.spmd", "--job", str(run_dir)]


def _start(launcher, world, run_dir, base, threads, extra_vars):
    cmd = _rank_command(run_dir)
    if launcher == "local":
        port = free_port()
        return [start_process(cmd, rank_env(base, r, world, port, threads), run_dir / f"launcher-rank-{r}.log")
                for r in range(world)]
    if launcher == "horovodrun":
        exe = find_tool("horovodrun", "build Horovod with `bash tools/ensure_horovod.sh` (or `make test`)")
        full = [exe, "-np", str(world), "-H", f"localhost:{world}", "--gloo", "--network-interfaces", "lo", *cmd]
    else:
        exe = find_tool("mpirun", "install Open MPI: apt-get install openmpi-bin libopenmpi-dev")
        full = [exe, "-np", str(world), "--oversubscribe", "--bind-to", "none", "--mca", "btl_tcp_if_include", "lo"]
        if os.geteuid() == 0:
            full.append("--allow-run-as-root")
        for var in ("OMP_NUM_THREADS", "PATH", "PYTHONPATH", *extra_vars):  # mpirun forwards only these
            full += ["-x", var]
        full += cmd
    return [start_process(full, base, run_dir / "launcher.log")]


def _collect(procs, world, run_dir, timeout, per_rank):
    import psutil
    deadline = time.monotonic() + timeout
    ps = [psutil.Process(p.pid) for p in procs]
    try:
        while True:
            failure = _first_failure(procs, world, run_dir, per_rank)
            if failure:
                raise RunFailed(failure[1], rank=failure[0], run_dir=str(run_dir))
            if all(p.poll() == 0 for p in procs):
                return _results(world, run_dir)
            if time.monotonic() > deadline:
                raise RunTimeout(f"SPMD run in {run_dir} not done after {timeout:g} s; see the rank logs there")
            time.sleep(POLL_S)
    finally:
        kill_processes(ps)
        for p in procs:
            p.wait()


# gloo words for "a peer went away" that scalelab.worker.is_peer_failure does not list
_PEER_WORDS = ("remote worker", "Read error", "Connection reset")


def _first_failure(procs, world, run_dir, per_rank):
    """(rank, message) of the root cause, or None: a rank's own error first, then a rank that died without
    reporting, and only then errors that ranks saw because a peer had died."""
    errors = []
    for r in range(world):
        path = run_dir / f"error-{r}.json"
        if path.exists():
            try:
                errors.append(json.loads(path.read_text()))
            except json.JSONDecodeError:
                continue  # half-written: read it on the next poll
    for e in errors:
        e["peer_failure"] = e["peer_failure"] or any(w in e["message"] for w in _PEER_WORDS)
    own = [e for e in errors if not e["peer_failure"]]
    if own:
        return _describe_error(min(own, key=lambda e: e["t"]))
    reported = {e["rank"] for e in errors}
    for i, p in enumerate(procs):
        code = p.poll()
        if code not in (None, 0) and not (per_rank and i in reported):
            if not errors:
                time.sleep(0.2)  # its own error file may land just after the exit
                if any((run_dir / f"error-{r}.json").exists() for r in range(world)):
                    return _first_failure(procs, world, run_dir, per_rank)
            return _describe_exit(i, code, run_dir, per_rank)
    if errors:
        return _describe_error(min(errors, key=lambda e: e["t"]))
    return None


def _describe_error(e):
    tail = "\n".join(e["traceback"].rstrip().splitlines()[-6:])
    return e["rank"], f"rank {e['rank']} failed: {e['error']}: {e['message']}\n{tail}"


def _describe_exit(i, code, run_dir, per_rank):
    log = run_dir / (f"rank-{i}.log" if per_rank else "launcher.log")
    text = log.read_text(errors="replace") if log.exists() else ""
    tail = "\n".join(text.rstrip().splitlines()[-8:])
    who = f"rank {i}" if per_rank else "the launcher"
    return (i if per_rank else None), f"{who} ended with {describe_exit(code)} before returning; " \
                                      f"last lines of {log}:\n{tail}"


def _results(world, run_dir):
    out = []
    for r in range(world):
        path = run_dir / f"result-{r}.json"
        if not path.exists():
            raise RunFailed(f"rank {r} exited cleanly but wrote no result ({path})", rank=r, run_dir=str(run_dir))
        out.append(json.loads(path.read_text()))
    return out


# -- the rank side ---------------------------------------------------------------------------------------
def resolve(target: str):
    """The function `module:function` names (imported now)."""
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except AttributeError:
        raise LaunchError(f"module {module!r} has no function {name!r}") from None


def rank_main(job_dir: str) -> int:
    """One rank: join the group if asked, call the target, write its JSON result (or the error)."""
    from ..dist import rank_info
    from ..worker import is_peer_failure
    job_dir = Path(job_dir)
    job = json.loads((job_dir / "job.json").read_text())
    info = rank_info()
    _redirect(job_dir / f"rank-{info.rank}.log")
    try:
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if job["init"] == "gloo" and info.world_size > 1:
            import torch.distributed as dist
            from datetime import timedelta
            dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size, timeout=timedelta(seconds=60))
        value = resolve(job["target"])(**job["kwargs"])
        _write(job_dir / f"result-{info.rank}.json", value)
        _leave_group()
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent, with its traceback
        _write(job_dir / f"error-{info.rank}.json",
               {"rank": info.rank, "error": type(e).__name__, "message": str(e), "t": time.time(),
                "traceback": traceback.format_exc(), "peer_failure": is_peer_failure(e)})
        traceback.print_exc()
        return 1


def _leave_group():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.destroy_process_group()


def _write(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, default=_plain))
    tmp.rename(path)  # atomic: the parent never reads half a result


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"rank result holds a {type(value).__name__}, which is not JSON data")


def _redirect(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv=None) -> int:
    """`python -m scalelab.launch.spmd --job DIR`: what each rank runs."""
    parser = argparse.ArgumentParser(prog="python -m scalelab.launch.spmd", description=rank_main.__doc__)
    parser.add_argument("--job", required=True, help="the run directory holding job.json")
    return rank_main(parser.parse_args(argv).job)


if __name__ == "__main__":
    sys.exit(main())
