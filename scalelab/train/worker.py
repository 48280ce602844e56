"""The one worker entry point every launcher starts, once per rank.

    python -m scalelab.train.worker --spec runs/x/spec.json          # 1 process (rank 0 of 1)
    torchrun --nproc-per-node 2 -m scalelab.train.worker --spec ...  # DDP, 2 ranks
    horovodrun -np 2 --gloo python -m scalelab.train.worker --spec ... # Horovod over Gloo
    mpirun -np 2 python -m scalelab.train.worker --spec ...           # Horovod over MPI (or DDP, env from Open MPI)
    srun python -m scalelab.train.worker --spec ...                   # inside an sbatch job

Rank and world come from the environment (scalelab.dist). A rank that fails writes an `error` event with
its traceback and exits non-zero, so the launcher (and the Run handle) can name it.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from ..run.procs import exit_with_parent, is_peer_failure, redirect_output


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the spec; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m scalelab.train.worker", description="Run one rank of a RunSpec.")
    parser.add_argument("--spec", default=os.environ.get("SCALELAB_SPEC", "spec.json"), help="RunSpec JSON/YAML file")
    parser.add_argument("--log-dir", help="write this rank's stdout and stderr to LOG_DIR/rank-<r>.log")
    args = parser.parse_args(argv)
    exit_with_parent()  # a rank never trains on after its launcher, `scalelab run` or kernel is gone

    from ..dist import rank_info
    from ..run.events import EventWriter
    from ..run.spec import load

    spec = load(args.spec)
    info = rank_info()
    from .hvd_elastic import claim_worker, is_elastic
    elastic = is_elastic(spec)
    if elastic:  # Horovod may start a worker later at a rank in use: it gets an event file of its own
        info = claim_worker(spec, info)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        redirect_output(os.path.join(args.log_dir, f"rank-{info.rank}.log"))
    events = EventWriter(spec.output_dir, info.rank)
    from ..run.user_code import use_run_code
    use_run_code(spec.output_dir)  # code of the student's own that the spec names (train/user_code.py)
    try:
        if elastic:
            from .hvd_elastic import train
        else:
            from .loop import train
        train(spec, info, events)
        code = 0
    except BaseException as e:  # noqa: BLE001 - report every failure (even KeyboardInterrupt) before exiting
        tb = traceback.format_exc()
        events.emit("error", error=type(e).__name__, message=str(e), traceback=tb, peer_failure=is_peer_failure(e))
        print(f"[rank {info.rank}] {tb}", file=sys.stderr, flush=True)
        code = 1
    finally:
        events.close()
    # All is written (events closed, checkpoints flushed, the process group left): skip the interpreter's wind-down,
    # ~5 s after Horovod elastic and 0.3-0.5 s after any torch run here (several seconds under load), which every
    # launcher would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
