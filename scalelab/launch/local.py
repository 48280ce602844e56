"""local: N ranks as processes on this machine, started directly (the same environment contract torchrun
gives its workers: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), one log per rank and exact exit codes."""
from __future__ import annotations

from ..run.procs import free_port, scrub_env
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command


class LocalRun(ProcessRun):
    """Ranks started as child processes of this one."""

    launcher = "local"


def rank_env(base: dict, rank: int, world: int, port: int, threads: int) -> dict:
    """The environment of rank `rank`: torchrun's variable names, so the worker sees no difference."""
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    return env


def launch(spec, env: dict | None = None) -> LocalRun:
    """Start spec.world.workers_per_node ranks here; returns at once."""
    spec, run_dir, reader = prepare_run_dir(spec)
    world, port, threads = spec.world_size, free_port(), threads_for(spec)
    base = scrub_env(env)
    cmd = worker_command(run_dir)
    procs = [start_process(cmd, rank_env(base, r, world, port, threads), run_dir / "logs" / f"launcher-rank-{r}.log")
             for r in range(world)]
    return LocalRun(spec, run_dir, procs, rank_of_proc=True, reader=reader)
