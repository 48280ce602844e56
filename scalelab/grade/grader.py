"""Grade submissions of a lab: run each notebook confined, then run the lab's checks on its records.

    batch = grade("labs/01_ddp", ["subs/alice.ipynb", "subs/bob/lab.ipynb"], out_dir="build/grades/01_ddp",
                  options=GradeOptions(jobs=2))
    for r in batch.results:
        print(r.student, r.status, r.score, r.max_score)

Per submission, in its own thread of the grader and its own processes:

1. a fresh job folder: a working copy of the lab *as a student has it* (`lab.student_files`: no hidden checks,
   no solutions) with the submission as lab.ipynb, plus a private HOME and TMPDIR;
2. `python -m scalelab.grade.runner` confines itself (`sandbox`: throwaway uid, no network, hidden paths,
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
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .checks import Check, CheckResult, lab_checks, run_checks
from .evidence import RUNS, run_evidence, strip_grader_records
from .lab import NOTEBOOK, GradingError, Lab, find_labs, load_lab, student_files
from .sandbox import SandboxPlan, SandboxPolicy, blocking_ancestor, cleanup, needed_paths, plan_sandbox
from .untrusted import (MAX_OUTPUT_CHARS, UntrustedFileError, cap_notebook, cap_text, load_json_beneath,
                        tolerant_records)

STATUSES = ("ok", "cell_error", "cell_timeout", "timeout", "dead_kernel", "malformed", "grader_error")
RUNNER_GRACE_S = 60.0  # kernel start-up and papermill's own clean-up on top of the notebook's total limit
MAX_SUBMISSION_BYTES = 32 * 2**20
# The environment a submission sees: nothing else of the grader's (tokens, passwords) reaches student code.
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "VIRTUAL_ENV", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")


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
    max_notebook_mb: int = 64
    """Largest executed notebook the grader reads back (its records are lost beyond that)."""


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


def collect_submissions(paths: list[str | Path]) -> list[Submission]:
    """Submissions from paths: `alice.ipynb` is student 'alice', `alice/lab.ipynb` or `alice/` too."""
    subs, seen = [], {}
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            path = path / NOTEBOOK
        student = path.parent.name if path.name == NOTEBOOK else path.stem
        student = re.sub(r"[^A-Za-z0-9_.@+-]", "_", student).lstrip(".") or "student"
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
    subs = (list(submissions) if submissions and all(isinstance(s, Submission) for s in submissions)
            else collect_submissions(submissions))
    out = Path(out_dir or Path("build") / "grades" / lab.name).resolve()
    from . import report
    report.prepare_out_dir(out, private=os.geteuid() == 0)
    checks = lab_checks(lab.path)  # loaded once, here: check code never runs where a student's code runs
    base = _job_base(options)
    ctx = _Context(lab, checks, options, out, base, _hidden_paths(lab, subs, out, base, options))
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
        if not options.keep_workdirs:
            shutil.rmtree(base, ignore_errors=True)
    order = {s.student: i for i, s in enumerate(subs)}
    results.sort(key=lambda r: order[r.student])
    gradebook = report.write_gradebook(out)
    return BatchResult(lab.name, out, results, gradebook, time.monotonic() - start)


@dataclass
class _Context:
    lab: Lab
    checks: list[Check]
    options: GradeOptions
    out: Path
    base: Path
    hide: list[str]
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
    report.write_submission(ctx.out, result)
    return result


def _grade_one(ctx: _Context, sub: Submission) -> SubmissionResult:
    settings = ctx.lab.grading
    opts = ctx.options
    job = Path(tempfile.mkdtemp(prefix=f"{sub.student[:40]}-", dir=ctx.base))
    result = SubmissionResult(sub.student, ctx.lab.name, sub.path.name, "ok", "")
    problem = _copy_submission(sub, job / "work")
    _working_copy(ctx.lab, job)
    shipped = set(run_evidence(job / "work")[RUNS])  # runs that came with the lab are no evidence of this one
    policy = SandboxPolicy(memory_mb=opts.memory_mb or settings.memory_mb,
                           network=settings.network if opts.network is None else opts.network,
                           hide=tuple(ctx.hide))
    if opts.sandbox:
        plan = plan_sandbox(policy)
    else:
        plan = SandboxPlan(memory_bytes=None, notes=["sandbox switched off (--no-sandbox): the submission ran "
                                                     "unconfined as the grader's user"])
    result.sandbox = plan.describe()
    try:
        if problem:
            outcome = {"status": "malformed", "message": problem}
        else:
            outcome = _run(ctx, job, plan, settings, sub.student)
    finally:
        cleanup(plan)
    _collect(ctx, job, sub, outcome, result, shipped)
    if not opts.keep_workdirs:
        shutil.rmtree(job, ignore_errors=True)
    return result


def _copy_submission(sub: Submission, work: Path) -> str | None:
    """Put the submission in the working copy as lab.ipynb; returns why it cannot be used, or None."""
    work.mkdir(parents=True)
    if sub.path.is_symlink():
        return f"{sub.path.name} is a symbolic link, not a notebook file"
    if not sub.path.is_file():
        return f"{sub.path} does not exist (or is not a file)"
    if sub.path.stat().st_size > MAX_SUBMISSION_BYTES:
        return (f"{sub.path.name} is {sub.path.stat().st_size / 2**20:.1f} MiB, over the "
                f"{MAX_SUBMISSION_BYTES // 2**20} MiB a submission may have: clear the outputs and submit again")
    shutil.copyfile(sub.path, work / NOTEBOOK)
    return None


def _working_copy(lab: Lab, job: Path) -> None:
    """The lab as a student has it (no hidden checks, no solutions), around the submission; HOME and TMPDIR."""
    work = job / "work"
    for rel in student_files(lab.path):
        if rel == Path(NOTEBOOK):
            continue
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lab.path / rel, work / rel)
    for name in ("home", "tmp", "out"):
        (job / name).mkdir()


def _run(ctx: _Context, job: Path, plan: SandboxPlan, settings, student: str) -> dict:
    """Start the sandboxed runner on the job and wait for it (or its limit); returns the raw outcome (untrusted)."""
    import json
    opts = ctx.options
    parameters = {**settings.parameters, **(opts.parameters or {})}
    total = opts.total_timeout_s or settings.total_timeout_s
    spec = {"notebook": str(job / "work" / NOTEBOOK), "output": str(job / "out" / NOTEBOOK), "cwd": str(job / "work"),
            "parameters": parameters, "cell_timeout": opts.cell_timeout_s or settings.cell_timeout_s,
            "total_timeout": total, "sandbox": plan.to_dict(), "outcome": str(job / "outcome.json")}
    job_file = job / "job.json"
    job_file.write_text(json.dumps(spec))
    if plan.uid is not None:
        _chown_tree(job, plan.uid, plan.gid)
    job.chmod(0o700)
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    env.update(HOME=str(job / "home"), TMPDIR=str(job / "tmp"), USER="student", LOGNAME="student",
               PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg")
    log_path = ctx.out / "instructor" / "logs" / f"{student}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scalelab.grade.runner", str(job_file)], cwd=job / "work",
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            proc.wait(total + RUNNER_GRACE_S)
        except subprocess.TimeoutExpired:
            cleanup(plan, proc.pid)
            proc.wait()
            return {"status": "timeout", "message": f"the run passed the grader's hard limit of "
                                                    f"{total + RUNNER_GRACE_S:g} s and was killed"}
        cleanup(plan, proc.pid)
    _cap_file(log_path)
    try:
        outcome = load_json_beneath(job, "outcome.json", 2**20)
    except (UntrustedFileError, ValueError, RecursionError) as e:
        return {"status": "grader_error", "message": f"the run left no readable outcome ({e}; runner exit "
                                                     f"{proc.returncode}): was the grading process killed?"}
    return outcome if isinstance(outcome, dict) else {"status": "grader_error", "message": "outcome is not a dict"}


def _collect(ctx: _Context, job: Path, sub: Submission, outcome: dict, result: SubmissionResult,
             shipped: set[str]) -> None:
    """Read the run's notebook and evidence (untrusted), run the checks, fill `result`."""
    status = outcome.get("status")
    result.status = status if status in STATUSES else "grader_error"
    result.execution = _execution_fields(outcome)
    result.notes += [cap_text(n, 500) for n in outcome.get("notes", []) if isinstance(n, str)][:10]
    records: dict[str, Any] = {}
    nb = None
    try:
        nb = load_json_beneath(job, Path("out") / NOTEBOOK, ctx.options.max_notebook_mb * 2**20)
    except (UntrustedFileError, ValueError, RecursionError) as e:
        if result.status != "malformed":
            result.notes.append(f"the executed notebook could not be read back, so no records were: {e}")
    if nb is not None:
        records, problems = tolerant_records(nb)
        result.notes += problems[:10]
    records, forged = strip_grader_records(records)
    if forged:
        result.notes.append(f"records in the grader's namespace were ignored: {forged}")
    if result.status not in ("malformed",):
        found = run_evidence(job / "work")
        found[RUNS] = {k: v for k, v in found[RUNS].items() if k not in shipped}
        records.update(found)
    result.message = student_message(result.status, result.execution, outcome.get("message", ""), ctx, result)
    result.checks = run_checks(ctx.checks, records)
    for c in result.checks:
        c.message = cap_text(c.message, 2000)
        if c.outcome == "missing" and result.status != "ok":
            c.message += f" (the run stopped early: {result.status.replace('_', ' ')})"
    _score(result)
    if nb is not None:
        result.notebook = _store_notebook(ctx.out, sub.student, nb)


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
    rel = Path("notebooks") / f"{student}.ipynb"
    (out / rel).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return rel.as_posix()


def _cap_file(path: Path, limit: int = 256 * 1024) -> None:
    """Keep only the end of a long runner log."""
    if path.stat().st_size > limit:
        with open(path, "rb") as f:
            f.seek(-limit, os.SEEK_END)
            tail = f.read()
        path.write_bytes(b"[... start cut by the grader ...]\n" + tail)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, gid)
        for name in filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def _job_base(options: GradeOptions) -> Path:
    """A folder for this batch's job folders: enterable (0711) so each throwaway uid reaches its own job."""
    base = Path(tempfile.mkdtemp(prefix="scalelab-grade-", dir=options.workdir))
    base.chmod(0o711)
    if os.geteuid() == 0 and options.sandbox and blocking_ancestor(str(base)):
        shutil.rmtree(base)
        raise GradingError(f"job folders would be made in {base.parent}, inside {blocking_ancestor(str(base))} "
                           "which other users cannot enter; pass --workdir /tmp (or another such folder)")
    return base


def _hidden_paths(lab: Lab, subs: list[Submission], out: Path, base: Path, options: GradeOptions) -> list[str]:
    """What a submission must not see: the reference lab and its siblings, .git, other submissions, the grades."""
    cands = {lab.path, out, *[Path(p).resolve() for p in options.hide]}
    cands.update(find_labs(lab.path.parent))
    from .release import DEFAULT_LABS, repo_root
    cands.update(find_labs(DEFAULT_LABS))
    for root in {repo_root(), _git_root(lab.path)}:
        if root is not None and (root / ".git").exists():
            cands.add(root / ".git")
    keep = [base.resolve(), *map(Path, needed_paths())]
    hide = set()
    for sub in subs:
        parent = sub.path.resolve().parent
        target = parent.parent if sub.path.name == NOTEBOOK else parent
        cands.add(target)
        hide.add(sub.path.resolve())  # used when its folder cannot be covered whole
    for cand in cands:
        cand = Path(cand).resolve()
        if not any(k == cand or cand in k.parents for k in keep):
            hide.add(cand)
    return sorted(str(p) for p in hide if os.path.lexists(p))


def _git_root(path: Path) -> Path | None:
    for cand in [path, *path.parents]:
        if (cand / ".git").exists():
            return cand
    return None


__all__ = ["GradeOptions", "Submission", "SubmissionResult", "BatchResult", "STATUSES", "collect_submissions",
           "grade", "student_message"]
