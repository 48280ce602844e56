"""slurm: the run as one batch job; `srun` starts the ranks (DDP) or Open MPI's mpirun does (Horovod).
Inside an allocation it runs as job steps there instead (`scalelab.launch.srun`).

The batch script is a pure function of the spec (`batch_script`), tested as text. The job writes the same
events as every other launcher into the run directory, which must be on a file system the compute nodes
share with the submitting host (home or scratch on a cluster; anywhere on the local single-node Slurm).
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..cluster.slurm import job_fields, job_phase, slurm_command, slurm_env
from ..errors import LaunchError
from ..run.handle import Run
from ..run.procs import scrub_env
from . import requeue, srun
from .base import prepare_run_dir, start_process, threads_for, worker_command
from .commands import mpirun_args

# srun: "srun: error: node1: task 1: Exited with exit code 1" / "srun: error: node1: task 1: Killed"
_FAILED_TASK = re.compile(r"task (\d+): (Exited with exit code \d+|Killed|Terminated|Segmentation fault)")
BACKEND_POLL_S = 1.0  # squeue/scontrol at most once a second per run: the scheduler is shared


def batch_script(spec, run_dir: Path, python: str | None = None) -> str:
    """The sbatch script for `spec`: #SBATCH resources, rendezvous variables, and the rank launch line."""
    s, w = spec.slurm, spec.world
    lines = ["#!/bin/bash", f"#SBATCH --job-name=scalelab-{spec.name}", f"#SBATCH --nodes={w.nodes}",
             f"#SBATCH --ntasks-per-node={w.workers_per_node}", f"#SBATCH --cpus-per-task={s.cpus_per_task}",
             f"#SBATCH --time={s.time}", f"#SBATCH --output={run_dir}/logs/slurm-%j.out"]
    for flag, value in (("partition", s.partition), ("account", s.account), ("reservation", s.reservation),
                        ("mem", s.mem)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{s.gpus_per_node}")
    lines += requeue.sbatch_options(spec)
    threads = spec.world.threads_per_worker or s.cpus_per_task
    lines += [
        "set -euo pipefail",
        "# rank 0's node hosts the rendezvous; the port is derived from the job id so concurrent jobs differ",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "# the run's rendezvous secret, made here on the node (not in this file): rank 0's store answers only the",
        "# processes that prove it (scalelab.run.rendezvous); srun hands the job's environment to every rank",
        "export SCALELAB_RDZV_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')",
        f"export OMP_NUM_THREADS={threads}",
        f"echo \"scalelab: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, {spec.world_size} ranks\"",
    ]
    worker = " ".join(shlex.quote(part) for part in worker_command(run_dir, python))
    if spec.strategy == "horovod":
        # Open MPI reads the allocation and starts its daemons through Slurm; Horovod uses the MPI controller.
        mpirun = mpirun_args(spec.world_size, ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"), exe="mpirun")
        lines.append(f"{' '.join(mpirun)} {worker}")
    else:
        # --kill-on-bad-exit: one failed rank ends the step at once instead of leaving the others in allreduce
        lines.append(f"srun --kill-on-bad-exit=1 --cpu-bind=none {worker}")
    if spec.checkpoint.on_signal:  # run it in the background under a trap that passes a preemption signal on
        forward = "kill" if spec.strategy == "horovod" else "scancel"
        lines[-1:] = requeue.preemptible(lines[-1], spec, run_dir, forward)
    return "\n".join(lines) + "\n"


class SlurmRun(srun.WatchesNodes, Run):
    """A batch job, observed through squeue/scontrol and its event files."""

    launcher = "slurm"
    _node_checked = False

    def __init__(self, spec, run_dir, job_id: str, env: dict, reader=None):
        super().__init__(spec, run_dir, reader)
        self.job_id, self.env = job_id, env
        self.guard: subprocess.Popen | None = None  # scalelab.cluster.guard, dismissed when the run ends
        self._last_check = 0.0
        self._cached = ("pending", None, None)

    def job_info(self) -> dict:
        """`scontrol show job` fields (JobState, Reason, ExitCode, NodeList, ...); {} once Slurm forgot the job."""
        return job_fields(self.job_id, self.env)

    def _backend_state(self):
        if time.monotonic() - self._last_check < BACKEND_POLL_S:
            return self._cached
        self._last_check = time.monotonic()
        info = self.job_info()
        state = info.get("JobState", "")
        phase = job_phase(state)
        if phase in ("pending", "held"):
            if self.spec.slurm.requeue:  # back in the queue after an emergency checkpoint: start again at once
                requeue.release_requeued(self.job_id, info, self.env)
            self._cached = ("pending", None, None)
        elif phase in ("running", "completing"):  # COMPLETING: its ranks' last events may still be on their way
            self._cached = ("running", None, None)
        elif state == "COMPLETED" or (not info and not self._missing_end()):
            self._cached = ("succeeded", None, None)
        else:
            rank = self._rank_from_output()
            who = f"rank {rank} failed; " if rank is not None else ""
            what = f"job {self.job_id} ended {state or 'and was forgotten by Slurm'}"
            if info.get("Reason") not in (None, "None"):
                what += f" ({info['Reason']})"
            self._cached = ("failed", f"{who}{what}; last lines of its output:\n{self.output(tail=8)}", rank)
        return self._cached

    def _finish(self, state: str) -> None:
        super()._finish(state)
        if self.guard is not None and self.guard.poll() is None:
            self.guard.kill()  # the run ended here: nothing left for the guard to cancel
            self.guard.wait()

    def output(self, tail: int | None = None) -> str:
        """The job's own output file (the batch script's and srun's messages)."""
        path = self.run_dir / "logs" / f"slurm-{self.job_id}.out"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-tail:]) if tail else text

    def logs(self, rank=None, tail=None):
        """A rank's output, or the job's output file with rank=None."""
        return self.output(tail) if rank is None else super().logs(rank, tail)

    def _rank_from_output(self):
        m = _FAILED_TASK.search(self.output())
        return int(m.group(1)) if m else None

    def _cancel(self) -> None:
        slurm_command(["scancel", self.job_id], self.env)
        if self.lost_nodes:  # srun in the batch script waits on the lost node's part of its step: kill it now
            slurm_command(["scancel", "--full", "--signal=KILL", self.job_id], self.env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            phase = job_phase(self.job_info().get("JobState", ""))
            # with a node lost, the job stays COMPLETING until slurmctld declares that node down (SlurmdTimeout);
            # the processes on the nodes still there are gone by then, and nothing is left to wait for
            if phase == "ended" or (phase == "completing" and self.lost_nodes):
                break
            time.sleep(0.5)


def launch(spec, env: dict | None = None, python: str | None = None):
    """Write the batch script into the run directory and sbatch it; returns at once (the job may queue).

    Inside an allocation (SLURM_JOB_ID set in `env`, default this process's: salloc, an sbatch script, a hub
    job) the run becomes job steps of that allocation instead (`scalelab.launch.srun`): no new job. Pass an
    `env` without SLURM_JOB_ID (`scrub_env()`) to submit a new job from inside one anyway.
    """
    if srun.allocation(env) is not None:
        return srun.launch(spec, env=env, python=python)
    spec, run_dir, reader = prepare_run_dir(spec)
    env = slurm_env(scrub_env(env))  # no SLURM_* of an enclosing run leaks into the new job
    script = run_dir / "job.sh"
    script.write_text(batch_script(spec, run_dir, python or sys.executable))
    r = slurm_command(["sbatch", "--parsable", "--chdir", str(run_dir), str(script)], env)
    if r.returncode:
        raise LaunchError(f"sbatch refused the job: {(r.stderr or r.stdout).strip()} (script: {script})")
    job_id = r.stdout.strip().split(";")[0]
    (run_dir / "job_id").write_text(job_id + "\n")
    run = SlurmRun(spec, run_dir, job_id, env, reader)
    # cancels the job if this process dies without stopping the run (a SIGKILL, a dead kernel)
    run.guard = start_process([sys.executable, "-m", "scalelab.cluster.guard", job_id], env,
                              run_dir / "logs" / "guard.log")
    return run


__all__ = ["batch_script", "launch", "SlurmRun", "threads_for"]
