"""Grading as Slurm jobs (`scalelab grade --slurm`): each submission's sandboxed run is a job on a grading partition.

What runs where, and what is trusted:

    the grader (this process)                        the grading job (on a node of the partition, as root)
    -----------------------------------------------  --------------------------------------------------------
    the job folder (working copy + submission), as
    for local grading; <job>.slurm-request.json
    (0600, in the batch folder only root writes):
    the sandbox *policy*, parameters, limits, nonce   main(): plans the sandbox on the node (`plan_sandbox`: a
    sbatch --partition grading --time/--mem/-c ...    uid free *there*, its cgroup, its GPUs), runs `job.run_job`
    waits (scontrol); scancel at its own limit        (the runner confined exactly as locally: throwaway uid,
                                                      namespaces, fresh root, limits, no network), ends what is
                                                      left (`reap.cleanup`), writes <job>.slurm-result.json
    reads the result back as untrusted data (the same
    raw outcome `run_job` returns locally), ends what
    may be left here (`cleanup`), then evidence, checks,
    scores and re-verification (a second job) as locally

So a student's code never decides its grade: checks and scores stay in the grader, and what comes back from the
job is the runner's raw outcome, read exactly as local grading reads it (`grader._collect`). The request and the
result sit in the batch folder (root's, 0711) beside the job folder, out of the run's reach (its fresh root does not
even show them); the result is read only as a regular 0600 file of the grader's own uid with one link. The
job's environment is the grader's `job.runner_env()` only (no SLURM_* variable, no token reaches the run), and
the scheduler's files stay hidden from the run as locally (`paths.scheduler_paths`): a submission can neither
submit, list nor cancel jobs.

Limits per job: `--time` = the whole-notebook limit + the runner's grace (`job.RUNNER_GRACE_S`) + a margin; the
grader itself `scancel`s a job running past that, and a job that waits in the queue longer than
`SlurmGrading.queue_timeout_s`. `--mem` = the sandbox's memory limit + a margin; `--cpus-per-task`. A job that
dies (cancelled, node failure, out of memory at the node's cgroup) changes only its own submission's result.

What this does not do: the job folder is not a tmpfs capped by `--job-mb` (that mount would live on the grader's
host, not on the node); it lies on the workdir's file system, which the grading nodes must share at the same path
(the local cluster: the same machine). The nodes must run the same Python environment at the same paths.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..cluster.slurm import job_fields, job_phase, slurm_command, slurm_env
from ..course.lab import GradingError
from ..errors import LaunchError
from .job import JOB_RECORD, RUNNER_GRACE_S, SLURM_JOB, _own_json, _write_private, cap_file, runner_env
from .reap import cleanup
from .sandbox import SandboxError, SandboxPlan, SandboxPolicy, plan_sandbox

REQUEST = ".slurm-request.json"
RESULT = ".slurm-result.json"
SCRIPT = ".slurm.sh"
OUTPUT = ".slurm.out"
RUNNER_LOG = ".slurm-runner.log"
GONE_AFTER = 10
"""Polls in a row without an answer about a job (and no result) before it counts as gone."""
JOB_NAME = "scalelab-grade"
NO_SANDBOX = "sandbox switched off (--no-sandbox): the submission ran unconfined as the grader's user"
# The job starts as root in the batch folder (--chdir), never in the student's working copy: see job.RUNNER_MAIN.
MAIN = "import sys; del sys.path[0]; from scalelab.grade.slurm_grading import main; sys.exit(main(sys.argv[1:]))"


@dataclass
class SlurmGrading:
    """How `scalelab grade --slurm` asks Slurm for each submission's job."""

    partition: str = "grading"
    """The grading partition (the local cluster has one, open to root only; at a centre, the grading nodes')."""
    cpus: int = 2
    """CPUs per submission (--cpus-per-task): a lab's runs use 2 ranks."""
    memory_margin_mb: int = 1024
    """--mem is the sandbox's memory limit plus this (the runner, papermill, the kernel's own start)."""
    time_margin_s: float = 120.0
    """--time is the whole-notebook limit + the runner's grace + this; the grader scancels a job past it."""
    queue_timeout_s: float = 3600.0
    """A job still pending after this is cancelled: that submission's grader_error (not the student's fault)."""
    poll_s: float = 1.0
    """How often the grader asks Slurm about its jobs."""

    def __post_init__(self) -> None:
        if not self.partition or not all(c.isalnum() or c in "-_." for c in self.partition):
            raise GradingError(f"--partition {self.partition!r}: a Slurm partition name (letters, digits, - _ .), "
                               "e.g. --partition grading")
        if self.cpus < 1:
            raise GradingError(f"--slurm-cpus must be >= 1, got {self.cpus}")


def preflight(slurm: SlurmGrading) -> None:
    """Fail before any submission when Slurm cannot be reached or the grading partition does not exist."""
    try:
        env = slurm_env()
        r = slurm_command(["scontrol", "show", "partition", "-o", slurm.partition], env, timeout=15)
    except LaunchError as e:
        raise GradingError(f"--slurm: {e}") from None
    if r.returncode or f"PartitionName={slurm.partition} " not in r.stdout + " ":
        raise GradingError(f"--slurm: Slurm has no partition {slurm.partition!r} "
                           f"({(r.stderr or r.stdout).strip()[:200]}): pass --partition NAME of your grading nodes "
                           "(`sinfo -s` lists them), or restart the local cluster (`scalelab cluster up`) to get its "
                           "'grading' partition")


def time_limit_s(total: float, slurm: SlurmGrading) -> float:
    """How long a grading job may run: the notebook's limit, the runner's grace and the margin."""
    return total + RUNNER_GRACE_S + slurm.time_margin_s


def sbatch_args(job: Path, policy: SandboxPolicy | None, total: float, slurm: SlurmGrading) -> list[str]:
    """The sbatch command for one run of `job` (pure: tested as text)."""
    base, name = job.parent, job.name
    args = ["sbatch", "--parsable", f"--partition={slurm.partition}", f"--job-name={JOB_NAME}", "--nodes=1",
            "--ntasks=1", f"--cpus-per-task={slurm.cpus}",
            f"--time={math.ceil(time_limit_s(total, slurm) / 60)}", f"--output={base / (name + OUTPUT)}",
            f"--chdir={base}", "--export=NONE", "--no-requeue"]
    if policy is not None and policy.memory_mb:
        args.append(f"--mem={int(policy.memory_mb) + slurm.memory_margin_mb}M")
    return args + [str(base / (name + SCRIPT))]


def run_job(job: Path, policy: SandboxPolicy | None, parameters: dict, cell_timeout: float, total: float,
            log_path: Path, *, slurm: SlurmGrading, continue_on_error: bool = True, nonce: str | None = None,
            reverify: list[dict] | None = None) -> tuple[dict, SandboxPlan | None, dict]:
    """`job.run_job`, as a Slurm job: (the raw outcome, untrusted; the sandbox plan the node made, or None; where it
    ran: {"partition", "job", "node"}). policy None: no sandbox (--no-sandbox)."""
    base, name = job.parent, job.name
    request = {"job": str(job), "policy": asdict(policy) if policy is not None else None, "parameters": parameters,
               "cell_timeout": cell_timeout, "total": total, "continue_on_error": continue_on_error,
               "nonce": nonce, "reverify": reverify, "env": runner_env(), "log": str(base / (name + RUNNER_LOG))}
    for suffix in (RESULT, OUTPUT, RUNNER_LOG, JOB_RECORD):
        (base / (name + suffix)).unlink(missing_ok=True)  # a re-run's job starts from nothing the last one left
    _write_private(base, name + REQUEST, request)
    script = base / (name + SCRIPT)
    fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(MAIN)} "
                f"{shlex.quote(str(base / (name + REQUEST)))}\n")
    env = slurm_env()
    try:
        r = slurm_command(sbatch_args(job, policy, total, slurm), env)
        if r.returncode:
            raise GradingError(f"sbatch refused the grading job on partition {slurm.partition!r}: "
                               f"{(r.stderr or r.stdout).strip()[:300]}")
        job_id = r.stdout.strip().split(";")[0]
        _write_private(base, name + SLURM_JOB, {"job": job_id})  # a grader started after this one died cancels it
        try:
            outcome, state = _wait(job_id, total, slurm, env, base / (name + RESULT))
        except BaseException:  # the grader failed while waiting (Slurm stopped answering, ^C): no job left behind
            slurm_command(["scancel", job_id], env)
            raise
        result = _own_json(base, name + RESULT)
        if result is None and outcome is None:
            slurm_command(["scancel", job_id], env)  # ended without a result, or Slurm lost sight of it: none runs on
        record = _own_json(base, name + JOB_RECORD)  # the plan, written by the node before its runner started
        plan = _plan_of(result) or _plan_of(record)
        if plan is not None:
            cleanup(plan)  # on the local cluster the node is this host: whatever might be left of the run ends here
        if outcome is None:
            outcome = (result or {}).get("outcome") if isinstance((result or {}).get("outcome"), dict) else \
                lost_job_outcome(state, job_id, log_path)
        where = {"partition": slurm.partition, "job": job_id, "node": state.get("NodeList") or None}
        return outcome, plan, where
    finally:
        _keep_logs(base, name, log_path)
        for suffix in (REQUEST, RESULT, SCRIPT, OUTPUT, RUNNER_LOG, JOB_RECORD, SLURM_JOB):
            (base / (name + suffix)).unlink(missing_ok=True)


def _wait(job_id: str, total: float, slurm: SlurmGrading, env: dict, result: Path) -> tuple[dict | None, dict]:
    """Wait for the job to end; scancel it past the queue or run limit. (An outcome the grader decides, or None;
    the job's last scontrol fields.)"""
    submitted, started, fields, unknown = time.monotonic(), None, {}, 0
    while True:
        try:
            fields = job_fields(job_id, env)
        except LaunchError:  # slurmctld busy for a while: asked again at the next poll, counted as no answer
            fields = {}
        # no answer about the job: Slurm forgot it (ended) or did not answer this once (its result tells them apart)
        unknown = unknown + 1 if not fields and not result.exists() else 0
        phase = job_phase(fields.get("JobState", "")) if fields or unknown > GONE_AFTER else "pending"
        now = time.monotonic()
        if phase == "ended":
            return None, fields
        if phase == "running" and started is None:
            started = now
        if started is None and now - submitted > slurm.queue_timeout_s:
            _cancel(job_id, env)
            return {"status": "grader_error", "message": f"the grading job {job_id} waited in the queue of partition "
                                                         f"{slurm.partition!r} for more than "
                                                         f"{slurm.queue_timeout_s:g} s and was cancelled"}, fields
        if started is not None and now - started > time_limit_s(total, slurm):
            _cancel(job_id, env)
            return {"status": "timeout", "message": f"the run passed the grader's hard limit of "
                                                    f"{time_limit_s(total, slurm):g} s and its Slurm job was "
                                                    "cancelled"}, fields
        time.sleep(slurm.poll_s)


def _cancel(job_id: str, env: dict, wait_s: float = 60.0) -> None:
    """scancel the job and wait until Slurm says it ended (its processes are signalled: TERM, then KILL)."""
    slurm_command(["scancel", job_id], env)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and job_phase(job_fields(job_id, env).get("JobState", "")) != "ended":
        time.sleep(0.5)


def lost_job_outcome(fields: dict, job_id: str, log_path: Path) -> dict:
    """The outcome of a job that ended without a result: what Slurm says happened to it."""
    state = (fields.get("JobState") or "gone").split()[0]
    if state == "OUT_OF_MEMORY":
        return {"status": "killed", "message": f"the grading job {job_id} used more memory than it was given "
                                               "and was killed"}
    if state in ("TIMEOUT", "DEADLINE"):
        return {"status": "timeout", "message": f"the grading job {job_id} passed its Slurm time limit"}
    return {"status": "grader_error", "message": f"the grading job {job_id} ended {state} (exit "
                                                f"{fields.get('ExitCode', '?')}, node {fields.get('NodeList', '?')})"
                                                f" without a result; see {log_path.name}"}


def _plan_of(data: dict | None) -> SandboxPlan | None:
    try:
        return SandboxPlan.from_dict(data["plan"]) if isinstance(data, dict) and data.get("plan") else None
    except (KeyError, TypeError, ValueError):
        return None


def _keep_logs(base: Path, name: str, log_path: Path) -> None:
    """The job's own output and the runner's log, into the instructor's log for this submission."""
    with open(log_path, "ab") as log:
        for suffix, title in ((OUTPUT, "the Slurm job"), (RUNNER_LOG, "the runner")):
            try:
                data = (base / (name + suffix)).read_bytes()
            except OSError:
                continue
            log.write(f"--- {title} ---\n".encode() + data[-256 * 1024:])
    cap_file(log_path)


# -- inside the job ----------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """The grading job: plan the sandbox here, run the job confined, leave the outcome for the grader."""
    if len(argv) != 1:
        print("usage: slurm_grading REQUEST.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    request = _own_json(path.parent, path.name)
    if request is None:
        print(f"{path}: no request the grader wrote (0600, root's) on node {socket.gethostname()}: the grading "
              "nodes must see the grader's --workdir at the same path", file=sys.stderr)
        return 2
    os.environ.clear()  # the run sees what it sees locally (job.runner_env), no SLURM_* variable
    os.environ.update({k: v for k, v in request["env"].items() if isinstance(v, str)})
    from .job import run_job
    job, base = Path(request["job"]), path.parent
    plan = SandboxPlan(memory_bytes=None, notes=[NO_SANDBOX])
    signal.signal(signal.SIGTERM, lambda *_: _end(job, plan, 143))  # scancel, the time limit: nothing left behind
    try:
        if request["policy"] is not None:
            plan = plan_sandbox(SandboxPolicy(**{k: tuple(v) if isinstance(v, list) else v
                                                 for k, v in request["policy"].items()}))
        outcome = run_job(job, plan, request["parameters"], request["cell_timeout"], request["total"],
                          Path(request["log"]), continue_on_error=request["continue_on_error"],
                          nonce=request["nonce"], reverify=request["reverify"])
    except SandboxError as e:
        outcome = {"status": "grader_error", "message": f"the sandbox could not be set up on node "
                                                        f"{socket.gethostname()}: {e}"}
    finally:
        cleanup(plan)
    _write_private(base, job.name + RESULT, {"outcome": outcome, "plan": plan.to_dict(), "node": socket.gethostname()})
    return 0


def _end(job: Path, plan: SandboxPlan, code: int) -> None:
    """SIGTERM: end the runner (its PID namespace and everything in it) and the run's uid, then exit."""
    record = _own_json(job.parent, job.name + JOB_RECORD) or {}
    runner = record.get("runner") if isinstance(record.get("runner"), dict) else {}
    try:
        cleanup(plan, runner.get("pid") if isinstance(runner.get("pid"), int) else None)
    finally:
        os._exit(code)


__all__ = ["SlurmGrading", "preflight", "run_job", "sbatch_args", "time_limit_s", "lost_job_outcome", "main"]
