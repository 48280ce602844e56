"""`python -m scalelab.cluster.guard JOB_ID`: cancel a Slurm job when whoever submitted it dies.

A batch job runs on without the process that submitted it, so `scalelab run` (or a notebook kernel) killed with
SIGKILL would leave its job holding nodes until its time limit. The slurm launcher starts this guard beside the
job as a child that gets SIGTERM when its parent dies (`run.procs.dies_with_this_process`); on SIGTERM or SIGHUP
it runs `scancel JOB_ID`. It exits by itself once the job has ended.
"""
from __future__ import annotations

import signal
import sys
import time

from .slurm import job_active, job_fields, slurm_command, slurm_env

POLL_S = 10.0  # scontrol at most every 10 s per guarded job: the scheduler is shared


def guard(job_id: str, poll_s: float = POLL_S) -> int:
    """Wait while the job is active; cancel it if this process is told to end first."""
    env = slurm_env()

    def cancel(signum, frame):
        slurm_command(["scancel", job_id], env)
        sys.exit(0)

    signal.signal(signal.SIGTERM, cancel)
    signal.signal(signal.SIGHUP, cancel)
    while job_active(job_fields(job_id, env).get("JobState", "")):
        time.sleep(poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(guard(sys.argv[1]))
