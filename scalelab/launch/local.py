"""local: N ranks as processes on this machine, started directly (the same environment contract torchrun
gives its workers: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), one log per rank and exact exit codes.

The rendezvous is the run's own (scalelab.run.rendezvous): this launcher binds its port and hands the listening
socket to rank 0 (SCALELAB_RDZV_FD), so no other process can take the port between the pick and rank 0's start, and
every rank gets the run's secret (SCALELAB_RDZV_SECRET) without which the store answers nothing."""
from __future__ import annotations

from ..run.procs import scrub_env
from ..run.rendezvous import FD_VAR, SECRET_VAR, hold_port, new_secret
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command


class LocalRun(ProcessRun):
    """Ranks started as child processes of this one."""

    launcher = "local"


def rank_env(base: dict, rank: int, world: int, port: int, threads: int, secret: str | None = None,
             listen_fd: int | None = None) -> dict:
    """The environment of rank `rank`: torchrun's variable names, so the worker sees no difference; with `secret`
    the run's rendezvous secret, and for rank 0 the descriptor of the listening socket it inherits."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    env.pop(FD_VAR, None)
    env.pop(SECRET_VAR, None)
    if secret:
        env[SECRET_VAR] = secret
        if rank == 0 and listen_fd is not None:
            env[FD_VAR] = str(listen_fd)
    return env


def start_ranks(cmd: list[str], base: dict, world: int, threads: int, log_of) -> list:
    """Start `world` ranks of `cmd` on a rendezvous of their own: a port this process binds and rank 0 inherits,
    and a fresh secret. `log_of(rank)`: the path of that rank's launcher log."""
    secret = new_secret()
    with hold_port() as listener:  # this process's copy closes once rank 0 holds its own
        port, fd = listener.getsockname()[1], listener.fileno()
        return [start_process(cmd, rank_env(base, r, world, port, threads, secret, fd), log_of(r),
                              pass_fds=(fd,) if r == 0 else ())
                for r in range(world)]


def launch(spec, env: dict | None = None) -> LocalRun:
    """Start spec.world.workers_per_node ranks here; returns at once."""
    spec, run_dir, reader = prepare_run_dir(spec)
    procs = start_ranks(worker_command(run_dir), scrub_env(env), spec.world_size, threads_for(spec),
                        lambda r: run_dir / "logs" / f"launcher-rank-{r}.log")
    return LocalRun(spec, run_dir, procs, rank_of_proc=True, reader=reader)
