"""Shared helpers of the lab tests: the one grading of every lab per test run, student copies, checks on records.

`LabGradings` (the session fixture `lab_gradings` in conftest.py) grades each lab once per run, in the grader's
sandbox at its grading parameters, under load: its reference, its released student copy, a submission made before
the modules moved (lab 05), the reference with its sizes re-assigned after injection (labs 07 and 09: SHRUNK) and
the two forgeries of tests/forgeries.py (labs 01-06), in one batch at -j 2, two labs'
batches at a time. Every test that needs a lab executed reads that batch: the grading tests (test_grade_labs), the
forgery tests (test_grade_forgery), each lab's story tests (test_labNN: the records and evidence the checks ran on)
and the site (the graded reference becomes build/executed/<lab>/, which `build_site` reuses). So a run executes
each lab's reference and student copy once, not three or four times.
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from scalelab.course.executed import adopt_executed
from scalelab.course.lab import student_files
from scalelab.course.release import release_lab, strip_solutions
from scalelab.grade.checks import lab_checks, run_checks
from scalelab.grade.grader import GradeOptions, SubmissionResult, grade as grade_batch
from scalelab.grade.report import read_records_file
from scalelab.grade.untrusted import tolerant_records

import capstone_variants
from forgeries import FORGERIES, forged_notebook

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
LABS = sorted(p.parent for p in (ROOT / "labs").glob("*/lab.ipynb"))
LABS_BY_NAME = {p.name: p for p in LABS}
LEGACY = ROOT / "tests" / "fixtures" / "legacy"  # submissions made before the modules moved (see its README)
FIXTURE = ROOT / "tests" / "fixtures" / "grading"


def student_source(source: str) -> str:
    """A cell's source as the release writes it: each solution block (markers included) becomes the exercise stub."""
    return strip_solutions(source)[0]


def working_copy(lab_dir: Path, dest: Path) -> Path:
    """The lab's student files copied into the folder `dest`, to execute or submit the lab from there: a lab run in
    labs/ itself writes its %%writefile modules there, which changes the lab's hash (the site's cache key)."""
    dest = Path(dest)
    for rel in student_files(lab_dir):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lab_dir / rel, dest / rel)
    return dest


WRONG = ROOT / "tests" / "wrong"
"""tests/wrong/<lab>.py: WRONG = [(a line of one solution block, the wrong code that replaces that block), ...], one
plausible mistake per code exercise (a hook that drops the residual, a timer without warm-up, ...). Every lab that
has one is graded once more per run as the submission `wrong_code`, all its mistakes at once (the exercises are
independent, and each check must notice its own)."""


def wrong_solutions(lab: Path) -> list[tuple[str, str]]:
    """The lab's (anchor, wrong code) pairs, [] where it has none."""
    path = WRONG / f"{Path(lab).name[:2]}.py"
    if not path.is_file():
        return []
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)  # noqa: S102 - the project's own test data
    return list(scope["WRONG"])


def replace_block(source: str, anchor: str, code: str) -> tuple[str, bool]:
    """`source` with the solution block that contains the line `anchor` replaced by `code` (markers dropped, the
    block's indentation kept); (source, False) when no block holds it."""
    lines, out, i, done = source.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.strip() == BEGIN and not done:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == END)
            if any(anchor.strip() == x.strip() for x in lines[i + 1:end]):
                indent = line[: len(line) - len(line.lstrip())]
                out += [indent + x if x else x for x in code.strip("\n").split("\n")]
                i, done = end + 1, True
                continue
        out.append(line)
        i += 1
    return "\n".join(out), done


def wrong_copy(lab: Path, dest: Path) -> Path:
    """The reference working copy with every solution block of `wrong_solutions(lab)` replaced by its mistake."""
    working_copy(lab, dest)
    for anchor, code in wrong_solutions(lab):
        found = False
        for path in [dest / "lab.ipynb", *sorted(dest.glob("*.py"))]:
            if path.suffix == ".ipynb":
                nb = json.loads(path.read_text())
                for cell in nb["cells"]:
                    text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                    new, hit = replace_block(text, anchor, code)
                    if hit:
                        cell["source"], found = new, True
                        break
                if found:
                    path.write_text(json.dumps(nb, indent=1))
            else:
                new, found = replace_block(path.read_text(), anchor, code)
                if found:
                    path.write_text(new)
            if found:
                break
        assert found, f"{lab.name}: no solution block holds the line {anchor!r} (tests/wrong/{lab.name[:2]}.py)"
    return dest


SHRUNK = {
    "07_model_parallel": "steps = 2  # smaller runs than the grader asked for\npipeline_steps = 2\n",
    "09_optimization": "globals().update(engine_steps=2, samples=8000, lars_steps=4)  # past a static look\n",
}
"""Per lab, the code of one cell placed right after the parameters cell of the reference, re-assigning sizes after
the grader injected its values (the grader's values are injected right after the parameters cell): the submission
`shrunk_params`, graded in the lab's shared batch. Its shrunk runs must lose their points (tests/test_grade_params.py).
Labs 07 and 09: their batches have a free slot at -j 2 (lab 07: three other runs) or are the cheapest."""


def shrunk_copy(lab: Path, dest: Path) -> Path:
    """The reference working copy with SHRUNK[lab]'s cell right after the parameters cell."""
    working_copy(lab, dest)
    nb = json.loads((dest / "lab.ipynb").read_text())
    at = next(i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", []))
    nb["cells"].insert(at + 1, {"cell_type": "code", "execution_count": None, "id": "shrunk-params", "metadata": {},
                                "outputs": [], "source": SHRUNK[lab.name]})
    (dest / "lab.ipynb").write_text(json.dumps(nb, indent=1))
    return dest


def edited_copy(lab: Path, dest: Path, block: tuple[str, str] | None = None, after: tuple[str, str] | None = None,
                replace: tuple[str, str] | None = None) -> Path:
    """The reference working copy with one edit: `block` = (a line of a solution block, the code that replaces the
    block), `after` = (a line of a code cell, a new cell's code placed after that cell), `replace` = (a line of a
    code cell, the code that replaces that cell)."""
    working_copy(lab, dest)
    nb = json.loads((dest / "lab.ipynb").read_text())
    cells = nb["cells"]
    for i, cell in enumerate(cells):
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code":
            continue
        if block:
            new, hit = replace_block(text, *block)
            if hit:
                cell["source"] = new
                break
        elif any((after or replace)[0].strip() == line.strip() for line in text.split("\n")):
            if after:
                cells.insert(i + 1, {"cell_type": "code", "execution_count": None, "id": "edited", "metadata": {},
                                     "outputs": [], "source": after[1]})
            else:
                cell["source"] = replace[1]
            break
    else:
        raise AssertionError(f"{lab.name}: no code cell holds the edit's line")
    (dest / "lab.ipynb").write_text(json.dumps(nb, indent=1))
    return dest


VARIANTS: dict[str, dict] = {"12_capstone": capstone_variants.variants(edited_copy)}
"""Per lab, further submissions graded in its shared batch: {name: function(lab, dest folder)} (lab 12's other
teams' choices and its forgeries: tests/capstone_variants.py)."""


def grading_parameters(lab_dir: Path) -> dict:
    """The small CPU parameters lab.yaml gives for CI and grading."""
    return yaml.safe_load((lab_dir / "lab.yaml").read_text())["grading"]["parameters"]


def grade(lab_dir: Path, records: dict) -> tuple[float, float, list]:
    """(points, max points, results) of the lab's public and hidden checks on `records`."""
    results = run_checks(lab_checks(lab_dir), records)
    return sum(r.points for r in results), sum(r.max_points for r in results), results


def failures(results) -> list[str]:
    """Readable lines for every check that did not fully pass."""
    return [f"{r.name}: {r.outcome} {r.points}/{r.max_points} {r.message}" for r in results if r.outcome != "pass"]


def assert_full_marks_within(lab_dir: Path, reference: tuple[dict, float], budget_s: float | None = None) -> None:
    """Every check passes on the reference's records, and the run stayed within its time budget: by default the
    grader's own limit, lab.yaml's grading.total_timeout_s (graded beside another lab under load, the time a
    student's run must keep even on a busy node; how fast a lab runs on a quiet machine is a benchmark's to say)."""
    if budget_s is None:
        import yaml
        budget_s = float(yaml.safe_load((lab_dir / "lab.yaml").read_text())["grading"]["total_timeout_s"])
    records, seconds = reference
    points, most, results = grade(lab_dir, records)
    assert points == most, "\n".join(failures(results))
    assert seconds < budget_s, f"{lab_dir.name} took {seconds:.0f} s under papermill; the budget is {budget_s:g} s"


def lab_test_module(name: str):
    """What every tests/test_labNN_<topic>.py shares, as the module binds it:

        LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = lab_test_module("06_x")

    LAB (the lab's folder), pytestmark (slow), the module fixture `reference` (this run's one grading of the lab:
    in the sandbox, at lab.yaml's grading parameters, under load; the records and evidence its reference's checks
    ran on, and the seconds it ran) and the test that it grades full marks within the lab's time budget."""
    import pytest
    lab = ROOT / "labs" / name
    assert lab.is_dir(), f"no lab folder {lab}"

    @pytest.fixture(scope="module")
    def reference(lab_gradings):
        return lab_gradings.reference(lab)

    def test_reference_solution_grades_full_marks_within_budget(reference):
        assert_full_marks_within(lab, reference)

    return lab, pytest.mark.slow, reference, test_reference_solution_grades_full_marks_within_budget


def assert_stops_at_first_exercise(gradings, lab: Path, recorded: str, not_yet: str, share: float) -> dict:
    """The released student copy, as graded, stops being right at its first exercise: no hidden checks were released
    with it, that cell raised NotImplementedError, `recorded` was recorded by then and `not_yet` not, and what was
    recorded by then earns less than `share` of the lab's points. Returns those records."""
    assert not (gradings.batch(lab).submissions / "student_copy" / "hidden_checks.py").exists()
    error, records = gradings.until_first_error(lab)
    assert error.get("ename") == "NotImplementedError", error
    assert recorded in records and not_yet not in records, sorted(records)
    points, most, _ = grade(lab, records)
    assert points < share * most, f"{points}/{most}"
    return records


def assert_wrong_code_loses(gradings, lab: Path, checks: dict[str, str]) -> None:
    """The `wrong_code` submission (tests/wrong/<lab>.py) ran to the end and lost points on each named check (the
    check that verifies that exercise's effect); the value says which mistake it had to notice. The reference's
    100 % on the same checks is test_grade_labs'."""
    result = gradings.batch(lab).by["wrong_code"]
    assert result.status in ("ok", "cell_error"), f"{lab.name} wrong_code: {result.status} {result.message}"
    by_name = {c.name: c for c in result.checks}
    for name, mistake in checks.items():
        c = by_name[name]
        assert c.points < c.max_points, f"{name} gave full marks to {mistake}: {c.outcome} {c.message}"


def assert_check_notices(lab_dir: Path, records: dict, forge, check_name: str) -> None:
    """`forge` (applied to a copy of `records`) makes check `check_name` fail, find a record missing, or give
    partial credit: the check guards the value it claims to."""
    records = copy.deepcopy(records)
    forge(records)
    outcome = {r.name: r.outcome for r in grade(lab_dir, records)[2]}[check_name]
    assert outcome in ("fail", "missing", "partial"), f"{check_name} did not notice: {outcome}"


class TwoInFlight:
    """`work(name)` for each of an ordered selection of names, two in flight: asking for one's result starts it
    (if not yet) and the next selected one beside it, so each is the other's load and both cores stay busy (one
    lab's grading at a time kept them 64 % busy). `close()` waits for what runs and cancels what has not begun."""

    def __init__(self, selected, work, prefix: str = "in-flight"):
        self.selected, self.work, self.lock, self.futures = list(selected), work, threading.Lock(), {}
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=prefix)

    def start(self, name):
        with self.lock:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self.work, name)

    def result(self, name):
        later = self.selected[self.selected.index(name) + 1:] if name in self.selected else []
        for n in (name, *later[:1]):
            self.start(n)
        return self.futures[name].result()

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)



class OtherBatch:
    """Another grading batch running beside the one under test, over and over until stopped: the load a grader
    sees when two instructors grade at once (it keeps a kernel and a notebook busy on this machine). With `needed`,
    a round starts only while needed() says so (the lab gradings run it only while one lab is in flight);
    `rounds_at` keeps each round's (start, end) monotonic times."""

    def __init__(self, out: Path, needed=lambda: True):
        self.out, self.needed, self.stop, self.rounds, self.errors = out, needed, threading.Event(), 0, []
        self.rounds_at: list[tuple[float, float]] = []
        self.round_started: float | None = None  # the running round's start
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        subs = self.out / "subs"
        subs.mkdir(parents=True)
        for name in ("busy_a", "busy_b"):
            shutil.copyfile(FIXTURE / "submissions" / "correct.ipynb", subs / f"{name}.ipynb")
        while not self.stop.is_set():
            if not self.needed():
                self.stop.wait(0.2)
                continue
            self.round_started = t0 = time.monotonic()
            try:
                batch = grade_batch(FIXTURE / "labs" / "90_fixture", sorted(subs.glob("*.ipynb")),
                                    self.out / f"round{self.rounds}", GradeOptions(jobs=1))
                self.errors += [r.message for r in batch.results if r.status != "ok"]
            except Exception:  # noqa: BLE001 - reported by the test (with where it came from), never hangs it
                import traceback
                self.errors.append(traceback.format_exc())
                return
            self.rounds_at.append((t0, time.monotonic()))
            self.round_started = None
            self.rounds += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=300)


@dataclass
class LabBatch:
    """One lab's batch: its results by submission name and the batch's output folder."""

    lab: Path
    by: dict[str, SubmissionResult]
    out: Path
    submissions: Path

    @property
    def results(self) -> list[SubmissionResult]:
        return list(self.by.values())

    def records(self, name: str) -> dict:
        """The values the checks of submission `name` ran on: its records and the grader's evidence."""
        return read_records_file(self.out, name)

    def notebook(self, name: str) -> dict:
        """Submission `name`'s executed notebook, as the grader stored it."""
        return json.loads((self.out / self.by[name].notebook).read_text(encoding="utf-8"))


class LabGradings:
    """Each selected lab graded once (see the module docstring), two labs' batches in flight: asking for a lab's
    batch starts it (if it is not running yet) and the next selected lab's beside it, so each is the other's load;
    while only one is in flight, the fixture batch (OtherBatch) grades beside it. Each lab's start and end are kept,
    to show it was graded under load the whole time."""

    def __init__(self, labs: list[str], tmp: Path):
        self.tmp, self.lock, self.starts, self.ends = tmp, threading.Lock(), {}, {}
        # job folders are kept (capped while they run, copied to disk after: --keep-workdirs) so that the story
        # tests can re-run checks that read a run's traces; only each reference's is kept past its batch
        self.workdir = Path(tempfile.mkdtemp(prefix="sl-"))  # short: runs bind Unix sockets in job folders
        self.workdir.chmod(0o755)  # the throwaway uids enter their job folders through it
        self.in_flight = TwoInFlight(labs, self._grade, "grade-lab")
        # load for a lab graded alone only: the fixture is the session's, so `active < 2` kept grading after the
        # last lab, beside every later test of this worker, until the session ended
        self.other = OtherBatch(tmp / "other", needed=lambda: self.active == 1)

    @property
    def active(self) -> int:
        return len(self.starts) - len(self.ends)

    def _grade(self, name: str) -> LabBatch:
        with self.lock:
            self.starts[name] = time.monotonic()
        try:
            batch = _grade_lab(LABS_BY_NAME[name], self.tmp / name, self.workdir / name[:2])
        finally:
            with self.lock:
                self.ends[name] = time.monotonic()
        ref = batch.by["reference"]
        if ref.status == "ok" and ref.notebook:  # the site shows this run instead of executing the lab again
            adopt_executed(batch.lab, batch.notebook("reference"), ref.execution.get("duration_s", ref.duration_s),
                           "the grader (in its sandbox, graded beside another batch) during the course's tests")
        return batch

    def batch(self, lab: Path | str) -> LabBatch:
        """The lab's graded batch (graded now, or waited for, the first time it is asked for)."""
        return self.in_flight.result(Path(lab).name)

    def reference_work(self, lab: Path) -> Path:
        """The reference's kept working copy (its run folders, as the grader found them)."""
        self.batch(lab)
        [work] = (self.workdir / Path(lab).name[:2]).glob("scalelab-grade-*/reference-*/work")
        return work

    def reference(self, lab: Path) -> tuple[dict, float]:
        """(the records and evidence the reference's checks ran on, the seconds its notebook ran)."""
        ref = self.batch(lab).by["reference"]
        assert ref.status == "ok", f"{Path(lab).name}'s reference did not run to the end: {ref.message}"
        return self.batch(lab).records("reference"), ref.execution.get("duration_s", ref.duration_s)

    def until_first_error(self, lab: Path) -> tuple[dict, dict]:
        """The released student copy where a plain Run All would stop it: (the first error output, the records of
        the cells up to and including the one that raised it), as if the run had stopped there."""
        nb = self.batch(lab).notebook("student_copy")
        for i, cell in enumerate(nb["cells"]):
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if errors:
                return errors[0], tolerant_records({**nb, "cells": nb["cells"][:i + 1]})[0]
        return {}, tolerant_records(nb)[0]

    def load_share(self, lab: Path) -> float:
        """The share of the lab's grading during which another lab's batch or a fixture round was running."""
        now = time.monotonic()
        t0, t1 = self.starts[lab.name], self.ends[lab.name]
        with self.lock:
            others = [(start, self.ends.get(name, now)) for name, start in self.starts.items() if name != lab.name]
        others += self.other.rounds_at + ([(self.other.round_started, now)] if self.other.round_started else [])
        covered, cursor = 0.0, t0
        for a, b in sorted((max(a, t0), min(b, t1)) for a, b in others if b > t0 and a < t1):
            if b > cursor:
                covered += b - max(a, cursor)
                cursor = b
        return covered / max(t1 - t0, 1e-9)

    def __enter__(self):
        self.other.__enter__()
        return self

    def __exit__(self, *exc):
        self.in_flight.close()
        self.other.__exit__(*exc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _grade_lab(lab: Path, tmp: Path, workdir: Path) -> LabBatch:
    """The reference (with its solved modules), the released student copy, a legacy submission where the lab has
    one and the lab's forgeries where it has them, as submitted folders, graded in one batch at -j 2."""
    subs = tmp / "submissions"
    working_copy(lab, subs / "reference")
    release_lab(lab, subs / "student_copy")
    names = ["reference", "student_copy"]
    legacy = LEGACY / lab.name
    if legacy.is_dir():  # handed in from a copy released before the modules moved: it must grade the same
        shutil.copytree(legacy, subs / "made_before_the_move")
        names.append("made_before_the_move")
    if wrong_solutions(lab):  # one plausible mistake per code exercise, all in one submission
        wrong_copy(lab, subs / "wrong_code")
        names.append("wrong_code")
    if lab.name in SHRUNK:  # the reference with its sizes re-assigned after injection
        shrunk_copy(lab, subs / "shrunk_params")
        names.append("shrunk_params")
    for name, make in VARIANTS.get(lab.name, {}).items():
        make(lab, subs / name)
        names.append(name)
    paths = [subs / n for n in names]
    if lab.name in FORGERIES:  # single notebooks, as a forger hands them in
        for kind, events in (("forged_records", False), ("forged_events", True)):
            (subs / f"{kind}.ipynb").write_text(json.dumps(forged_notebook(lab, events)))
            paths.append(subs / f"{kind}.ipynb")
    # continue_on_error=False: the notebook goes on only where the student copy's tags let Run All go on
    workdir.mkdir(mode=0o755)
    options = GradeOptions(jobs=2, continue_on_error=False, keep_workdirs=True, workdir=str(workdir))
    batch = grade_batch(lab, paths, tmp / "out", options)
    for job in workdir.glob("scalelab-grade-*/*"):
        if not job.name.startswith("reference-"):  # the evidence of the reference is all the tests re-read
            shutil.rmtree(job, ignore_errors=True)
    return LabBatch(lab, {r.student: r for r in batch.results}, tmp / "out", subs)


def labs_needed(items) -> list[str]:
    """The labs the selected test items need graded, in the order they first need them: an item using the
    `lab_gradings` fixture needs its `lab` or `graded` parameter's lab, else its module's LAB, else every lab."""
    needed: list[str] = []
    for item in items:
        if "lab_gradings" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        lab = params.get("lab") or params.get("graded") or getattr(getattr(item, "module", None), "LAB", None)
        for name in ([Path(lab).name] if lab else [p.name for p in LABS]):
            if name in LABS_BY_NAME and name not in needed:
                needed.append(name)
    return needed
