"""The one worker entry point every launcher starts, once per rank.

    python -m scalelab.worker --spec runs/x/spec.json          # 1 process (rank 0 of 1)
    torchrun --nproc-per-node 2 -m scalelab.worker --spec ...  # DDP, 2 ranks
    horovodrun -np 2 --gloo python -m scalelab.worker --spec ... # Horovod over Gloo
    mpirun -np 2 python -m scalelab.worker --spec ...           # Horovod over MPI (or DDP, env from Open MPI)
    srun python -m scalelab.worker --spec ...                   # inside an sbatch job

Rank and world come from the environment (scalelab.dist). A rank that fails writes an `error` event with
its traceback and exits non-zero, so the launcher (and the Run handle) can name it.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the spec; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m scalelab.worker", description="Run one rank of a RunSpec.")
    parser.add_argument("--spec", default=os.environ.get("SCALELAB_SPEC", "spec.json"), help="RunSpec JSON/YAML file")
    parser.add_argument("--log-dir", help="write this rank's stdout and stderr to LOG_DIR/rank-<r>.log")
    args = parser.parse_args(argv)

    from .dist import rank_info
    from .events import EventWriter
    from .spec import load

    spec = load(args.spec)
    info = rank_info()
    if args.log_dir:
        _redirect_output(args.log_dir, info.rank)
    events = EventWriter(spec.output_dir, info.rank)
    try:
        from .train.loop import train
        train(spec, info, events)
        return 0
    except BaseException as e:  # noqa: BLE001 - report every failure (even KeyboardInterrupt) before exiting
        tb = traceback.format_exc()
        events.emit("error", error=type(e).__name__, message=str(e), traceback=tb, peer_failure=is_peer_failure(e))
        print(f"[rank {info.rank}] {tb}", file=sys.stderr, flush=True)
        return 1
    finally:
        events.close()


# Errors a rank sees when *another* rank died: the Run handle reports those only if no root cause is found.
_PEER_PATTERNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Horovod has been shut down",
                  "Socket Timeout", "Connection refused", "NCCL communicator was aborted")


def is_peer_failure(exc: BaseException) -> bool:
    """True when the error is a communication failure caused by a peer, not this rank's own fault."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"HorovodInternalError", "DistNetworkError", "DistBackendError"}:
        return True
    return any(p in str(exc) for p in _PEER_PATTERNS)


def _redirect_output(log_dir: str, rank: int) -> None:
    """Point fds 1 and 2 at the rank's log (C++ output from gloo/NCCL/Horovod included)."""
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
