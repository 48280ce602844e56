"""mpirun: Open MPI starts the ranks; Horovod then uses its MPI controller, DDP reads OMPI_COMM_WORLD_*."""
from __future__ import annotations

import re

from ..run.procs import free_port, scrub_env
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command
from .commands import RANK_VARS, mpirun_args

# Open MPI: "mpirun noticed that process rank 1 with PID 123 on node x exited on signal 9 (Killed)."
#           "Primary job  terminated normally, but 1 process returned a non-zero exit code ... rank 1"
_FAILED_RANK = re.compile(r"process rank (\d+) with PID|rank (\d+) with PID")


class MpirunRun(ProcessRun):
    """An mpirun process and the ranks it started."""

    launcher = "mpirun"

    def _rank_from_log(self):
        m = _FAILED_RANK.search(self.logs())
        return int(next(g for g in m.groups() if g)) if m else None


def mpirun_command(spec, run_dir, port: int, hostfile: str | None = None) -> list[str]:
    """`mpirun -np N ... python -m scalelab.train.worker ...`, root-safe and without core binding (ranks share cores)."""
    cmd = mpirun_args(spec.world_size, RANK_VARS, interface="lo" if spec.world.nodes == 1 else "^lo,docker0",
                      shared_cores=True, hostfile=hostfile)
    return cmd + worker_command(run_dir)


def launch(spec, env: dict | None = None, hostfile: str | None = None) -> MpirunRun:
    """Start mpirun with spec.world_size ranks; returns at once."""
    spec, run_dir, reader = prepare_run_dir(spec)
    env = scrub_env(env)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS=str(threads_for(spec)))
    env.setdefault("PYTHONPATH", "")
    proc = start_process(mpirun_command(spec, run_dir, 0, hostfile), env, run_dir / "logs" / "launcher.log")
    return MpirunRun(spec, run_dir, [proc], reader=reader)
