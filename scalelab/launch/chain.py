"""Training longer than a wall-clock limit: a chain of jobs, each resuming from the last complete checkpoint.

On a cluster every job has a time limit (often 24 h or 48 h, on a busy queue much less). A long training run
is submitted as a chain: job k+1 depends on job k (`sbatch --dependency=afterany:<k>`: it starts whether k
finished or was killed at its limit) and resumes from the newest complete checkpoint in the same run
directory. All jobs share one spec.json, so they train the same run.

    chain = submit_chain(spec, jobs=3)          # spec.launcher == "slurm"; spec.checkpoint.every_steps > 0
    chain.wait(timeout=3600)                    # ["TIMEOUT", "TIMEOUT", "COMPLETED"]

Without Slurm (a laptop), `run_in_time_slices` does the same with the local launcher: each attempt is
stopped after `limit_s` seconds — SIGTERM, then SIGKILL, as Slurm does at a time limit — and relaunched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster.slurm import job_active, job_fields, slurm_command, slurm_env
from ..errors import LaunchError, RunFailed, RunTimeout



@dataclass
class SlurmChain:
    """Jobs submitted one after another into the same run directory."""

    run_dir: Path
    job_ids: list[str]
    env: dict = field(repr=False, default_factory=dict)

    def states(self) -> list[str]:
        """Each job's JobState (PENDING, RUNNING, COMPLETED, TIMEOUT, ...); '' once Slurm has forgotten it."""
        return [job_fields(job, self.env).get("JobState", "") for job in self.job_ids]

    def wait(self, timeout: float, poll_s: float = 2.0) -> list[str]:
        """Block until no job of the chain is pending or running; returns their final states."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.states()
            if not any(job_active(s) for s in states):
                return states
            if time.monotonic() > deadline:
                raise RunTimeout(f"job chain {self.job_ids} in {self.run_dir} still {states} after {timeout:g} s; "
                                 "call chain.cancel() to end it, or wait longer")
            time.sleep(poll_s)

    def cancel(self) -> None:
        """scancel every job of the chain."""
        slurm_command(["scancel", *self.job_ids], self.env)


def submit_chain(spec, jobs: int = 2, time_limits: list[str] | None = None, env: dict | None = None,
                 python: str | None = None) -> SlurmChain:
    """sbatch `jobs` jobs of `spec`, each after the previous one ends (afterany); returns at once.

    `time_limits` overrides the wall-clock limit per job (e.g. ["1", "10"]); by default each job has spec.slurm.time.
    """
    import sys

    from .base import prepare_run_dir
    from .slurm import batch_script
    from ..run.procs import scrub_env
    if spec.launcher != "slurm":
        raise LaunchError(f"a job chain needs launcher 'slurm', got {spec.launcher!r}")
    if not (spec.checkpoint.every_steps and spec.checkpoint.resume):
        raise LaunchError("a job chain needs checkpoint.every_steps > 0 and checkpoint.resume = true, or every job "
                          "starts from step 0 again")
    spec.validate()
    prepared = prepare_run_dir(spec)
    spec, run_dir = prepared[0], prepared[1]
    env = slurm_env(scrub_env(env))
    script = run_dir / "job.sh"
    script.write_text(batch_script(spec, run_dir, python or sys.executable))
    ids: list[str] = []
    for k in range(jobs):
        cmd = ["sbatch", "--parsable", "--chdir", str(run_dir)]
        if ids:
            cmd.append(f"--dependency=afterany:{ids[-1]}")
        if time_limits and k < len(time_limits):
            cmd.append(f"--time={time_limits[k]}")
        r = slurm_command(cmd + [str(script)], env)
        if r.returncode:
            if ids:
                slurm_command(["scancel", *ids], env)
            raise LaunchError(f"sbatch refused job {k + 1} of the chain: {(r.stderr or r.stdout).strip()}")
        ids.append(r.stdout.strip().split(";")[0])
    (run_dir / "job_ids").write_text("\n".join(ids) + "\n")
    return SlurmChain(run_dir, ids, env)


def run_in_time_slices(spec, limit_s: float, max_attempts: int = 5) -> list[dict]:
    """Train `spec` with the local launcher in attempts of at most `limit_s` seconds each, every attempt
    resuming from the newest complete checkpoint, until one finishes. Returns one dict per attempt:
    status (succeeded | stopped | failed: a rank failed before its first step, as an attempt lost at start-up),
    start_step, resumed_from, last_step, elapsed_s, limit_s (and error, for a failed one).

    The slice adapts to the machine in the same run: an attempt that gets no further than the last one (on a busy
    machine start-up alone can take the whole slice) doubles the slice for the next, and only `max_attempts`
    such attempts in a row give up. Attempts that make progress go on until the run is done."""
    from . import launch
    if not (spec.checkpoint.every_steps and spec.checkpoint.resume):
        raise LaunchError("time slices need checkpoint.every_steps > 0 and checkpoint.resume = true")
    attempts, stalled, limit, reached = [], 0, float(limit_s), -1
    while True:
        t0 = time.monotonic()
        run = launch(spec)
        spec = run.spec  # output_dir resolved by the first launch: later attempts reuse it
        error = None
        try:
            run.wait(timeout=limit)
            status = "succeeded"
        except RunTimeout:
            run.stop()  # what a scheduler does at the time limit
            status = "stopped"
        except RunFailed as e:
            # A rank that fails before its first step (on a busy machine: a port still held by the stopped attempt,
            # a start-up past a timeout) is a lost attempt, as on a cluster; one that fails while training is a bug.
            if any(ev["type"] == "step" for ev in run.events()):
                raise
            run.stop()
            status, error = "failed", str(e)
        events = run.events()
        start = next((e for e in events if e["type"] == "start" and e["rank"] == 0), {})
        steps = [e["step"] for e in events if e["type"] == "step" and e["rank"] == 0]
        last = max(steps, default=None)
        attempts.append({"status": status, "start_step": start.get("start_step"),
                         "resumed_from": start.get("resumed_from"), "last_step": last,
                         "elapsed_s": time.monotonic() - t0, "run_dir": str(run.run_dir), "limit_s": limit,
                         **({"error": error} if error else {})})
        if status == "succeeded":
            return attempts
        if last is not None and last > reached:
            reached, stalled = last, 0
        else:
            stalled, limit = stalled + 1, limit * 2
            if stalled >= max_attempts:
                why = f"; the last one failed: {error}" if error else ""
                raise RunTimeout(f"{spec.name} made no progress in {max_attempts} attempts in a row (the last "
                                 f"allowed {limit / 2:g} s); raise limit_s or checkpoint more often{why}")


__all__ = ["SlurmChain", "submit_chain", "run_in_time_slices"]
