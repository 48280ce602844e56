"""Preemptible batch jobs: the lines a Slurm batch script needs so that a signal becomes an emergency checkpoint
and, with `slurm.requeue`, the job requeues itself and resumes from it.

Two ways a job is told to stop early:
- `sbatch --signal=B:USR1@60` (`slurm.signal = "USR1@60"`): Slurm signals only the batch shell, 60 s before the
  time limit. The shell's trap passes SIGUSR1 on to every task of the running step (`scancel --signal`).
- `scontrol requeue <job>` / `scancel <job>` / preemption by a higher-priority job: Slurm sends SIGTERM to every
  process of the job and SIGKILL KillWait seconds later; the ranks catch the SIGTERM themselves.
Either way the ranks (`checkpoint.on_signal`) stop after the same step, save, and exit 0. The script then sees
rank 0's last event is `preempted` and, with `slurm.requeue`, runs `scontrol requeue` on its own job: the job goes
back to the queue with the same id and, when it starts again, resumes from the emergency checkpoint.
"""
from __future__ import annotations

import shlex
import time
from datetime import datetime
from pathlib import Path


def sbatch_options(spec) -> list[str]:
    """#SBATCH lines for requeue and the warning signal."""
    lines = []
    if spec.slurm.requeue:
        lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]  # each attempt adds to the same output
    if spec.slurm.signal:
        lines.append(f"#SBATCH --signal=B:{spec.slurm.signal}")
    return lines


def preemptible(launch_line: str, spec, run_dir: Path, forward: str = "scancel") -> list[str]:
    """`launch_line` run in the background under a trap that passes a signal on to the ranks, then a requeue if
    the ranks stopped for it. `forward` is scancel (signal every task of the job's steps: srun) or kill (signal
    the launcher, which passes SIGUSR1 on to its ranks: Open MPI's mpirun)."""
    rank0 = shlex.quote(str(Path(run_dir) / "events" / "rank-0.jsonl"))
    passes = ('scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null || kill -USR1 "$child"' if forward == "scancel"
              else 'kill -USR1 "$child"')
    lines = [
        "# preemption: a signal to this shell goes on to the ranks as SIGUSR1; they save and exit 0",
        f"preempt() {{ echo \"scalelab: $1 received: ranks take an emergency checkpoint\"; {passes}; }}",
        "trap 'preempt USR1' USR1",
        "trap 'preempt TERM' TERM",
        f"{launch_line} &",
        "child=$!",
        "set +e",
        'wait "$child"; rc=$?',
        'while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done  # a trapped signal interrupts wait',
        "set -e",
        f"if [ \"$rc\" = 0 ] && tail -n 1 {rank0} | grep -q '\"type\": \"preempted\"'; then",
        '  echo "scalelab: job $SLURM_JOB_ID preempted after an emergency checkpoint"',
    ]
    if spec.slurm.requeue:
        lines.append('  scontrol requeue "$SLURM_JOB_ID" && echo "scalelab: requeued job $SLURM_JOB_ID" || true')
    lines += ["fi", 'exit "$rc"']
    return lines




REQUEUE_SETTLE_S = 3.0
"""How long after a requeue its job may be started again. slurmd revokes the old attempt's credential when the job
is requeued and refuses a launch whose credential was made in the same second or earlier ("Job credential
revoked": the job then FAILS instead of starting); Slurm's own hold is far longer."""


def release_requeued(job_id: str, info: dict, env: dict, now: float | None = None) -> bool:
    """Let a requeued job start again soon. Slurm holds a requeued job back (Reason=BeginTime, about two minutes
    here) so that the old attempt's epilog can finish; a watched run whose ranks already left cleanly need not
    wait that long, only until REQUEUE_SETTLE_S after the requeue (the requeued job's SubmitTime). Returns True
    when it asked Slurm to release the job."""
    from ..cluster.slurm import slurm_command
    if info.get("JobState") != "PENDING" or info.get("Reason") != "BeginTime" or info.get("Restarts", "0") == "0":
        return False
    try:  # scontrol prints local time to the second
        requeued = datetime.strptime(info.get("SubmitTime", ""), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return False  # no time to go by: leave the job to Slurm's own hold
    if (time.time() if now is None else now) < requeued + REQUEUE_SETTLE_S:
        return False
    return slurm_command(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env).returncode == 0


__all__ = ["sbatch_options", "preemptible", "release_requeued"]
