"""Grade submissions of a lab: run each notebook confined, then run the lab's checks on its records.

    batch = grade("labs/01_ddp", ["subs/alice.ipynb", "subs/bob/lab.ipynb"], out_dir="build/grades/01_ddp",
                  options=GradeOptions(jobs=2))
    for r in batch.results:
        print(r.student, r.status, r.score, r.max_score)

Per submission, in its own thread of the grader and its own processes:

1. a fresh job folder: a working copy of the lab *as a student has it* (`lab.student_files`: no hidden checks,
   no solutions) with the submission as lab.ipynb, plus a private HOME and TMPDIR;
2. the runner (`scalelab.grade.runner`, as root) confines itself (`sandbox`: throwaway uid, no network, hidden paths,
   memory limit) and executes the notebook with the lab's grading parameters and timeouts;
3. every process of the run is killed, then the grader reads the executed notebook as untrusted JSON
   (`untrusted`), adds its own evidence from the run's event files (`evidence`), and runs the public and hidden
   checks *here*, on plain JSON values;
4. the result goes to JSON, HTML feedback and the CSV gradebook (`report`).

A submission that crashes, hangs, kills its kernel, prints gigabytes or is not a notebook only ever changes its
own result: each has its own processes, uid, folder and limits, and any grader failure on one is caught and
reported as that submission's `grader_error`.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import heldout, leaderboard, reverify, slurm_grading
from .checks import Check, CheckResult, lab_checks, run_checks
from .report import file_key
from .evidence import NONCE, RUNS, apply_parameters, run_evidence, strip_grader_records
from .job import (JOB_NAME_CHARS, cap_job_folder, copy_submission, finish_batch, guard_parameters, hidden_paths,
                  job_base, reap_crashed_batches, release_job_folder, run_job, runs_need, working_copy)
from ..course.lab import NOTEBOOK, GradingError, Lab, load_lab
from .reap import cleanup
from .sandbox import SandboxPlan, SandboxPolicy, plan_sandbox
from .untrusted import (MAX_OUTPUT_CHARS, UntrustedFileError, cap_notebook, cap_text, load_json_beneath,
                        tolerant_records)

STATUSES = ("ok", "cell_error", "cell_timeout", "timeout", "dead_kernel", "killed", "crashed", "malformed",
            "grader_error")


@dataclass
class GradeOptions:
    """How a batch is graded; None fields take the lab's `grading:` settings from lab.yaml."""

    jobs: int = 1
    """Submissions executed at the same time."""
    parameters: dict[str, Any] | None = None
    """Merged over lab.yaml's grading parameters."""
    cell_timeout_s: float | None = None
    total_timeout_s: float | None = None
    memory_mb: int | None = None
    network: bool | None = None
    sandbox: bool = True
    """False: no throwaway user, namespaces or hiding (debugging only; every result says so)."""
    hide: tuple[str, ...] = ()
    """More paths submissions must not see (e.g. a copy of the hidden checks elsewhere)."""
    workdir: str | None = None
    """Where job folders are made (default: the temporary folder); must be enterable by other users."""
    keep_workdirs: bool = False
    job_mb: int | None = 2048
    """As root with the sandbox: each job folder is a tmpfs of this size, so a run cannot fill the host's disk
    (None: folders on the workdir's filesystem, not capped; with keep_workdirs a capped folder is copied there after
    its run, so a kept run ran under the same limits)."""
    max_notebook_mb: int = 64
    """Largest executed notebook the grader reads back (its records are lost beyond that)."""
    continue_on_error: bool = True
    """Run every cell even after one raised: an unsolved exercise does not cost the points of what follows it."""
    slurm: slurm_grading.SlurmGrading | None = None
    """Run each submission's sandboxed job (and its re-runs) as a Slurm job on a grading partition
    (grade/slurm_grading.py: the node plans the sandbox); checks and scores stay here. None: on this host."""
    reverify: bool = True
    """Re-run a sample of each submission's runs with the grading's nonce and hold the runs to it (lab.yaml's
    reverify_runs; grade/reverify.py). False: trust runs whose files look right (noted in every result)."""


@dataclass
class Submission:
    """One student's notebook."""

    student: str
    path: Path


@dataclass
class SubmissionResult:
    """The grade of one submission and how it came about."""

    student: str
    lab: str
    submission: str
    status: str
    message: str
    score: float = 0.0
    max_score: float = 0.0
    checks: list[CheckResult] = field(default_factory=list)
    execution: dict[str, Any] = field(default_factory=dict)
    """Where and how the run stopped: cell_index, cell_id, cell_tags, ename, evalue, traceback, limit_s."""
    notes: list[str] = field(default_factory=list)
    sandbox: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    notebook: str | None = None
    """The stored executed notebook (outputs capped), relative to the batch's output folder."""
    standing: dict[str, Any] | None = None
    """A lab with a class board (its hidden checks' GRADER_HOOKS["standing"]): where this submission stands, from
    the records the checks ran on (grade/leaderboard.py)."""

    @property
    def percent(self) -> float:
        """Score as a percentage of the maximum (0 when the lab has no points)."""
        return round(100.0 * self.score / self.max_score, 2) if self.max_score else 0.0


@dataclass
class BatchResult:
    """Every result of one `grade` call, and where the reports went."""

    lab: str
    out_dir: Path
    results: list[SubmissionResult]
    gradebook: Path
    duration_s: float
    reaped: list[Path] = field(default_factory=list)
    """Batch folders of graders that died mid-batch, cleaned up at this one's start (`job.reap_crashed_batches`)."""


MAX_NAME = 100


def student_name(raw: str) -> str:
    """A student's name as reports show it, from a file or folder name: any script kept (NFC), white space as '_',
    control characters and separators replaced; at most MAX_NAME characters (a longer one keeps a hash of the
    rest, so two long names stay two students). File names come from `report.file_key`."""
    import hashlib
    import unicodedata
    name = unicodedata.normalize("NFC", raw)
    name = "".join(ch if ch.isprintable() and ch not in "/\\" else "_" for ch in name)
    name = re.sub(r"\s+", "_", name).strip("_").lstrip(".") or "student"
    if len(name) > MAX_NAME:
        name = f"{name[:MAX_NAME - 11]}~{hashlib.sha256(name.encode()).hexdigest()[:10]}"
    return name


def collect_submissions(paths: list[str | Path]) -> list[Submission]:
    """Submissions from paths: `alice.ipynb` is student 'alice', `alice/lab.ipynb` or `alice/` too."""
    subs, seen = [], {}
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            path = path / NOTEBOOK
        student = student_name(path.parent.name if path.name == NOTEBOOK else path.stem)
        if student in seen:
            raise GradingError(f"two submissions for student {student!r}: {seen[student]} and {path}; "
                               "name them <student>.ipynb or <student>/lab.ipynb")
        seen[student] = path
        subs.append(Submission(student, path))
    if not subs:
        raise GradingError("no submissions given")
    return subs


def grade(lab_dir: str | Path, submissions: list, out_dir: str | Path | None = None,
          options: GradeOptions | None = None,
          progress: Callable[[SubmissionResult], None] | None = None) -> BatchResult:
    """Grade `submissions` (paths or Submission) of the lab in `lab_dir`; see the module docstring."""
    start = time.monotonic()
    options = options or GradeOptions()
    lab = load_lab(lab_dir)
    if options.slurm:
        slurm_grading.preflight(options.slurm)  # no partition, no Slurm: said once, before any submission
    subs = (list(submissions) if submissions and all(isinstance(s, Submission) for s in submissions)
            else collect_submissions(submissions))
    out = Path(out_dir or Path("build") / "grades" / lab.name).resolve()
    from . import report
    report.prepare_out_dir(out, private=os.geteuid() == 0)
    hooks: dict[str, Any] = {}
    checks = lab_checks(lab.path, hooks=hooks)  # loaded once, here: check code never runs where a student's code runs
    reaped = reap_crashed_batches(options.workdir)  # a dead grader's mounted job folders and runs end here
    base = job_base(options.workdir, options.sandbox, keep=options.keep_workdirs)
    try:
        needed = runs_need(base) if options.sandbox else []
    except Exception:
        shutil.rmtree(base, ignore_errors=True)
        raise
    hide, cover = hidden_paths(lab, [s.path for s in subs], out, base, options.hide, needed) if needed else ([], [])
    ctx = _Context(lab, checks, options, out, base, hide, cover, needed, hooks)
    results: list[SubmissionResult] = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, options.jobs), thread_name_prefix="grade") as pool:
            futures = {pool.submit(_grade_safely, ctx, s): s for s in subs}
            for fut in as_completed(futures):
                result = fut.result()
                results.append(result)
                if progress:
                    progress(result)
    finally:
        finish_batch(base, keep=options.keep_workdirs)
    order = {s.student: i for i, s in enumerate(subs)}
    results.sort(key=lambda r: order[r.student])
    gradebook = report.write_gradebook(out)
    return BatchResult(lab.name, out, results, gradebook, time.monotonic() - start, reaped)


@dataclass
class _Context:
    lab: Lab
    checks: list[Check]
    options: GradeOptions
    out: Path
    base: Path
    hide: list[str]
    cover: list[str] = field(default_factory=list)
    needed: list[str] = field(default_factory=list)
    hooks: dict[str, Any] = field(default_factory=dict)
    """The hidden checks' GRADER_HOOKS: a held-out set to score checkpoints on, a standing for the class board."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def _grade_safely(ctx: _Context, sub: Submission) -> SubmissionResult:
    """Grade one submission; a failure of the grader itself becomes this submission's grader_error only."""
    start = time.monotonic()
    try:
        result = _grade_one(ctx, sub)
    except Exception as e:  # noqa: BLE001 - one submission must never take the batch down
        result = SubmissionResult(sub.student, ctx.lab.name, sub.path.name, "grader_error",
                                  f"the grader failed on this submission (not the student's fault): "
                                  f"{type(e).__name__}: {e}")
        result.checks = run_checks(ctx.checks, {})
        _score(result)
    result.duration_s = round(time.monotonic() - start, 3)
    from . import report
    try:
        report.write_submission(ctx.out, result)
    except OSError as e:  # a full disk, say: the batch goes on, and the instructor's log says whose report is lost
        with ctx.lock, open(ctx.out / "instructor" / "report_errors.txt", "a", encoding="utf-8") as f:
            f.write(f"{result.student}: the report could not be written: {e}\n")
    return result


def _grade_one(ctx: _Context, sub: Submission) -> SubmissionResult:
    settings = ctx.lab.grading
    opts = ctx.options
    key = file_key(sub.student)
    started = time.time()  # no event of this run can be older: its working copy does not exist yet
    nonce = secrets.token_hex(8)  # this grading's: mixed into every run's initial weights (run/nonce.py)
    job = Path(tempfile.mkdtemp(prefix=f"{key[:JOB_NAME_CHARS]}-", dir=ctx.base))  # short: see job.MAX_BASE_CHARS
    capped = opts.sandbox and not opts.slurm and cap_job_folder(job, opts.job_mb)  # a tmpfs here: not on a node
    try:
        result = SubmissionResult(sub.student, ctx.lab.name, sub.path.name, "ok", "")
        problem, parameters, shipped = _job_folder(ctx, sub, job, result)
        policy = SandboxPolicy(memory_mb=opts.memory_mb or settings.memory_mb,
                               network=settings.network if opts.network is None else opts.network,
                               hide=tuple(ctx.hide), cover=tuple(ctx.cover), needed=tuple(ctx.needed),
                               workdir=str(job))
        plan = _first_plan(opts, policy)
        result.sandbox = {**plan.describe(), "job_folder": (f"{opts.job_mb} MiB tmpfs" + (", copied to the "
                          "workdir's filesystem after the run" if opts.keep_workdirs else "")) if capped else
                          "on the workdir's filesystem, not capped"}

        def execute(plan: SandboxPlan, *args, **kw) -> dict:
            if not opts.slurm:
                return run_job(job, plan, *args, **kw)
            outcome, used, where = slurm_grading.run_job(job, policy if opts.sandbox else None, *args, slurm=opts.slurm,
                                                         **kw)
            if used is not None and "slurm" not in result.sandbox:  # the notebook's job, not a re-run's
                result.sandbox.update(used.describe(), slurm=where)
            return outcome

        try:
            if problem:
                outcome = {"status": "malformed", "message": problem}
            else:
                outcome = execute(plan, parameters,
                                  opts.cell_timeout_s or settings.cell_timeout_s,
                                  opts.total_timeout_s or settings.total_timeout_s,
                                  ctx.out / "instructor" / "logs" / f"{key}.log",
                                  continue_on_error=opts.continue_on_error, nonce=nonce)
        finally:
            cleanup(plan)

        def rerun(items: list[dict]) -> dict:
            # a fresh sandbox under the same policy: the notebook's processes are all gone by now
            again = plan_sandbox(policy) if opts.sandbox and not opts.slurm else plan
            limit = settings.reverify_timeout_s
            try:
                return execute(again, {}, limit, limit, ctx.out / "instructor" / "logs" / f"{key}.reverify.log",
                               nonce=nonce, reverify=items)
            finally:
                cleanup(again)

        _collect(ctx, job, sub, outcome, result, shipped, started, parameters, nonce, rerun)
    finally:
        if capped:
            release_job_folder(job, keep=opts.keep_workdirs)
        if not opts.keep_workdirs:
            shutil.rmtree(job, ignore_errors=True)
    return result


def _job_folder(ctx: _Context, sub: Submission, job: Path, result: SubmissionResult) -> tuple[str, dict, set[str]]:
    """The submission and the lab's other files copied into the job folder: (what is wrong with the submission, or
    ""; the grading's parameters; the runs that came with the lab, which are no evidence of this one)."""
    problem = copy_submission(sub.path, job / "work")
    parameters = {**ctx.lab.grading.parameters, **(ctx.options.parameters or {})}
    if not problem:
        result.notes += guard_parameters(job / "work" / NOTEBOOK, ctx.lab.path / NOTEBOOK, parameters)
    own = sub.path.parent if sub.path.name == NOTEBOOK else None  # <student>/lab.ipynb: the folder is theirs
    taken = working_copy(ctx.lab, job, own)
    shipped = set(run_evidence(job / "work")[RUNS])
    if taken:
        result.notes.append(f"your own versions of {taken} were used")
    return problem, parameters, shipped


def _first_plan(opts, policy: SandboxPolicy) -> SandboxPlan:
    """The notebook's sandbox: planned here, or on the grading node inside its Slurm job (slurm_grading.main,
    described after it), or none (--no-sandbox)."""
    if opts.slurm:
        return SandboxPlan(memory_bytes=None)
    if opts.sandbox:
        return plan_sandbox(policy)
    return SandboxPlan(memory_bytes=None, notes=["sandbox switched off (--no-sandbox): the submission ran "
                                                 "unconfined as the grader's user"])


def _collect(ctx: _Context, job: Path, sub: Submission, outcome: dict, result: SubmissionResult,
             shipped: set[str], started: float | None = None, parameters: dict | None = None,
             nonce: str | None = None, rerun: Callable[[list[dict]], dict] | None = None) -> None:
    """Read the run's notebook and evidence (untrusted), run the checks, fill `result`. The checks read the
    grader's `parameters` (`evidence.apply_parameters`), never the notebook's own record of them. With `nonce`,
    runs whose start events lack it are rejected; with `rerun`, a sample of the runs behind points is re-run and
    held to them (`_reverify`)."""
    status = outcome.get("status")
    result.status = status if status in STATUSES else "grader_error"
    result.execution = _execution_fields(outcome)
    result.notes += [cap_text(n, 500) for n in outcome.get("notes", []) if isinstance(n, str)][:10]
    nb, records = _read_back(ctx, job, result)
    if result.status not in ("malformed",):
        records.update(_evidence(job, result, shipped, started, nonce))
    if parameters is None:
        parameters = {**ctx.lab.grading.parameters, **(ctx.options.parameters or {})}
    result.notes += apply_parameters(records, parameters)
    if nonce:
        records[NONCE] = nonce
    result.message = student_message(result.status, result.execution, outcome.get("message", ""), ctx, result)
    reads: dict[str, list[str]] = {}
    result.checks = run_checks(ctx.checks, records, reads)
    _hold_runs(ctx, sub, job, records, result, reads, nonce, rerun)
    if callable(ctx.hooks.get("standing")):
        result.standing = leaderboard.place(ctx.hooks["standing"], records)
    from . import report
    try:
        report.write_records(ctx.out, sub.student, records)
    except (OSError, TypeError, ValueError) as e:  # a full disk, or values JSON cannot hold: the grade stands
        result.notes.append("the values the checks ran on could not be kept for the instructor: "
                            + cap_text(str(e), 200))
    _explain_missing(result)
    _score(result)
    if nb is not None:
        result.notebook = _store_notebook(ctx.out, sub.student, nb)


def _read_back(ctx: _Context, job: Path, result: SubmissionResult) -> tuple[dict | None, dict[str, Any]]:
    """The executed notebook (None when it cannot be read back) and the records it holds, the grader's namespace
    stripped; what went wrong goes to `result.notes`."""
    records: dict[str, Any] = {}
    nb = None
    try:
        nb = load_json_beneath(job, Path("out") / NOTEBOOK, ctx.options.max_notebook_mb * 2**20)
    except (UntrustedFileError, ValueError, RecursionError) as e:
        if result.status != "malformed":
            result.notes.append(f"the executed notebook could not be read back, so no records were: {e}")
    if nb is not None:
        try:
            records, problems = tolerant_records(nb)
        except Exception as e:  # noqa: BLE001 - what the notebook wrote is the student's, not the grader's fault
            records, problems = {}, [f"the notebook's recorded values could not be read ({type(e).__name__}): "
                                     "none counted"]
        result.notes += problems[:10]
    records, forged = strip_grader_records(records)
    if forged:
        result.notes.append(f"records in the grader's namespace were ignored: {cap_text(str(forged), 300)}")
    return nb, records


def _evidence(job: Path, result: SubmissionResult, shipped: set[str], started: float | None,
              nonce: str | None) -> dict:
    """The runs' evidence in the working copy (runs that came with the lab left out); none when the event files
    cannot be read, said in `result.notes`."""
    try:
        found = run_evidence(job / "work", started=started, nonce=nonce)
        found[RUNS] = {k: v for k, v in found[RUNS].items() if k not in shipped}
        return found
    except Exception as e:  # noqa: BLE001 - event files are written by the student's processes
        result.notes.append(f"the run's event files could not be read ({type(e).__name__}: "
                            f"{cap_text(str(e), 200)}): checks that compare with them find no run")
        return {}


def _hold_runs(ctx: _Context, sub: Submission, job: Path, records: dict, result: SubmissionResult,
               reads: dict, nonce: str | None, rerun: Callable[[list[dict]], dict] | None) -> None:
    """Re-run a sample of the runs behind points and hold them to their files (`reverify.hold`), then the held-out
    scoring (`heldout.hold`); the checks run again where either changed the records."""
    if not ctx.options.reverify:
        result.notes.append("re-verification was switched off for this grading (--no-reverify): runs whose files look "
                            "right were trusted")
    elif rerun is not None and nonce and ctx.lab.grading.reverify_runs and result.status != "malformed" and \
            reverify.hold(ctx.lab.grading, {c.name for c in ctx.checks if c.needs_run}, job, records, result, reads,
                          rerun, lambda line: _log_reverify(ctx, sub, line)):
        result.checks = run_checks(ctx.checks, records)
    if ctx.hooks.get("heldout") and rerun is not None and result.status != "malformed" and \
            heldout.hold(ctx.hooks["heldout"], job, records, result, rerun, lambda line: _log_reverify(ctx, sub, line)):
        result.checks = run_checks(ctx.checks, records)


def _explain_missing(result: SubmissionResult) -> None:
    """Each check's message capped; a missing one says why when the run did not end well."""
    for c in result.checks:
        c.message = cap_text(c.message, 2000)
        if c.outcome == "missing" and result.status == "cell_error":
            c.message += f" (a cell raised an error: {result.message[:200]})"
        elif c.outcome == "missing" and result.status != "ok":
            c.message += f" (the run stopped early: {result.status.replace('_', ' ')})"


def _log_reverify(ctx: _Context, sub: Submission, line: str) -> None:
    with ctx.lock, open(ctx.out / "instructor" / "reverify.txt", "a", encoding="utf-8") as f:
        f.write(f"{sub.student}: {line}\n")


def _execution_fields(outcome: dict) -> dict:
    out = {}
    for key, kind, limit in (("cell_index", int, None), ("cell_id", str, 200), ("ename", str, 200),
                             ("evalue", str, 2000), ("traceback", str, MAX_OUTPUT_CHARS // 2),
                             ("source", str, MAX_OUTPUT_CHARS // 2), ("limit_s", (int, float), None),
                             ("duration_s", (int, float), None)):
        value = outcome.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            out[key] = cap_text(value, limit) if limit else value
    tags = outcome.get("cell_tags")
    if isinstance(tags, list):
        out["cell_tags"] = [cap_text(t, 100) for t in tags[:20] if isinstance(t, str)]
    return out


def student_message(status: str, ex: dict, raw: Any, ctx: _Context, result: SubmissionResult) -> str:
    """One sentence for the student: what happened to their run, which cell, which error or limit."""
    where = f"cell {ex['cell_index']}" if "cell_index" in ex else "a cell"
    if ex.get("cell_tags"):
        where += f" (tagged {', '.join(ex['cell_tags'])})"
    settings = ctx.lab.grading
    if status == "ok":
        return "the notebook ran to the end"
    if status == "cell_error":
        return f"{where} raised {ex.get('ename', 'an error')}: {ex.get('evalue', '')}".rstrip(": ")
    if status == "cell_timeout":
        return (f"{where} ran longer than the per-cell limit of "
                f"{ex.get('limit_s', ctx.options.cell_timeout_s or settings.cell_timeout_s):g} s and was stopped")
    if status == "timeout":
        return (f"the notebook ran longer than its limit of {ctx.options.total_timeout_s or settings.total_timeout_s:g}"
                f" s in total (stopped in {where})")
    if status == "dead_kernel":
        return (f"the kernel died in {where}: os._exit, a crash, or more memory than the "
                f"{result.sandbox.get('memory', 'allowed')} allowed")
    if status == "killed":
        return ("the run's grading process was killed before the notebook finished (in or after "
                f"{where}): a process of the notebook killed it, or the run used more memory than the "
                f"{result.sandbox.get('memory', 'allowed')} allowed")
    if status == "crashed":
        return ("the process running the notebook (the kernel's parent) failed before the notebook finished (in or "
                f"after {where}), after the notebook's own code had started: that code killed, stopped or disturbed "
                "it (its files or temporary folder)")
    if status == "malformed":
        text = re.sub(r"(/[^\s:]*/)+", "", cap_text(raw, 500))  # the grader's paths mean nothing to students
        return "the submission is not a notebook the grader can run: " + text.removeprefix(f"{NOTEBOOK}: ")
    return cap_text(raw, 1000) or "the grader failed on this submission"


def _score(result: SubmissionResult) -> None:
    result.score = round(sum(c.points for c in result.checks), 4)
    result.max_score = round(sum(c.max_points for c in result.checks), 4)


def _store_notebook(out: Path, student: str, nb: dict) -> str:
    import json
    nb, cuts = cap_notebook(nb)
    rel = Path("notebooks") / f"{file_key(student)}.ipynb"
    (out / rel).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8", errors="replace")
    return rel.as_posix()


__all__ = ["GradeOptions", "Submission", "SubmissionResult", "BatchResult", "STATUSES", "collect_submissions", "student_name",
           "grade", "student_message"]
