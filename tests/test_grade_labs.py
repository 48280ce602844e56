"""Every lab under labs/: releases cleanly; its reference grades 100 % and its student copy below 100 %, under load.

Parametrized over `labs/*/lab.ipynb` at collection time, so a new lab is picked up without touching this file.
The grading runs are `slow` (each executes the lab twice, in the sandbox, with the lab's grading parameters).
They run two labs at a time, each lab's batch the other's load (as two instructors grading at once), and the
fixture batch grades beside a lab whenever no second lab is in flight, so every lab is graded under load and no
CPU is spent on load alone (the suite's measured CPU floor is what bounds `make test` on 2 cores).
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from scalelab.grade.grader import GradeOptions, grade
from scalelab.course.lab import load_lab, student_files
from scalelab.course.release import release_lab

from labtests import TwoInFlight

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(p.parent for p in (ROOT / "labs").glob("*/lab.ipynb"))
LEGACY = ROOT / "tests" / "fixtures" / "legacy"  # submissions made before the modules moved (see its README)
LABS_BY_NAME = {p.name: p for p in LABS}
labs = pytest.mark.parametrize("lab", LABS, ids=[p.name for p in LABS])
FIXTURE = ROOT / "tests" / "fixtures" / "grading"


class OtherBatch:
    """Another grading batch running beside the one under test, over and over until stopped: the load a grader
    sees when two instructors grade at once (it keeps a kernel and a notebook busy on this machine). With `needed`,
    a round starts only while needed() says so (the lab gradings below run it only while one lab is in flight);
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
                batch = grade(FIXTURE / "labs" / "90_fixture", sorted(subs.glob("*.ipynb")),
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


class LabGradings:
    """The selected labs' grading batches, two in flight at a time: asking for a lab's result starts it (if it is
    not running yet) and the next selected lab beside it, so each lab's batch is the other's load; while only one
    is in flight, the fixture batch (OtherBatch) grades beside it. Each lab's start and end are kept, to show it
    was graded under load the whole time."""

    def __init__(self, labs: list[Path], tmp: Path):
        self.tmp, self.lock, self.starts, self.ends = tmp, threading.Lock(), {}, {}
        self.in_flight = TwoInFlight([lab.name for lab in labs], self._grade, "grade-lab")
        self.other = OtherBatch(tmp / "other", needed=lambda: self.active < 2)

    @property
    def active(self) -> int:
        return len(self.starts) - len(self.ends)

    def _grade(self, name: str):
        with self.lock:
            self.starts[name] = time.monotonic()
        try:
            return _grade_lab(LABS_BY_NAME[name], self.tmp / name)
        finally:
            with self.lock:
                self.ends[name] = time.monotonic()

    def result(self, lab: Path):
        return self.in_flight.result(lab.name)

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


def _why(result) -> str:
    failing = [f"{c.name} ({'hidden' if c.hidden else 'public'}): {c.outcome}: {c.message}"
               for c in result.checks if c.outcome != "pass"]
    return f"{result.student}: {result.status}: {result.message}\n" + "\n".join(failing)


@labs
def test_lab_releases_cleanly_and_has_its_grading_files(lab, tmp_path):
    settings = load_lab(lab)  # lab.yaml valid
    assert (lab / "checks.py").exists(), f"{lab.name} has no checks.py (public checks for SelfCheck)"
    report = release_lab(lab, tmp_path / lab.name)
    assert report.exercises >= 1, f"{lab.name}: no '# BEGIN SOLUTION' block, so the student copy is the solution"
    assert not (tmp_path / lab.name / "hidden_checks.py").exists()
    assert settings.grading.total_timeout_s >= settings.grading.cell_timeout_s
    import json
    code = ["".join(c["source"]) for c in json.loads((lab / "lab.ipynb").read_text())["cells"]
            if c["cell_type"] == "code"]
    assert any("SelfCheck(" in src and ".check()" in src for src in code), \
        f"{lab.name} needs a SelfCheck cell near its end (students check their work; papermill shows the result)"
    from scalelab.course.lab import parameter_defaults
    known = set(parameter_defaults(lab / "lab.ipynb"))
    for name in ("ci", "laptop", *settings.profiles):
        unknown = set(settings.profile(name)) - known
        assert not unknown, f"{lab.name}: profile {name!r} sets {sorted(unknown)}, which the parameters cell lacks"


def _grade_lab(lab: Path, tmp: Path):
    """The reference (with its solved modules), the released student copy and, where the lab has one, a legacy
    submission, as submitted folders, graded in one batch at -j 2. Returns (batch, out dir)."""
    subs = tmp / "submissions"
    (subs / "reference").mkdir(parents=True)
    for rel in student_files(lab):
        (subs / "reference" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lab / rel, subs / "reference" / rel)
    release_lab(lab, subs / "student_copy")
    names = ["reference", "student_copy"]
    legacy = LEGACY / lab.name
    if legacy.is_dir():  # handed in from a copy released before the modules moved: it must grade the same
        shutil.copytree(legacy, subs / "made_before_the_move")
        names.append("made_before_the_move")
    # continue_on_error=False: the notebook goes on only where the student copy's tags let Run All go on
    options = GradeOptions(jobs=2, continue_on_error=False)
    return grade(lab, [subs / n for n in names], tmp / "out", options), tmp / "out"


GRADED = "test_reference_grades_full_marks_and_student_copy_does_not"


@pytest.fixture(scope="module")
def gradings(request, tmp_path_factory):
    selected = [item.callspec.params["lab"] for item in request.session.items
                if getattr(item, "originalname", "") == GRADED]
    with LabGradings(selected, tmp_path_factory.mktemp("gradings")) as g:
        yield g


@pytest.mark.slow
@labs
def test_reference_grades_full_marks_and_student_copy_does_not(lab, gradings):
    # Under load, as a busy grading day has it: -j 2, while another batch grades beside it (the next lab's, or
    # the fixture's). Labs that measure speed-ups must still give an honest reference full marks (their checks
    # compare within one run).
    batch, out = gradings.result(lab)
    assert gradings.other.errors == [], gradings.other.errors
    assert gradings.load_share(lab) >= 0.8, \
        f"{lab.name} was graded beside another batch for only {gradings.load_share(lab):.0%} of its time"
    by = {r.student: r for r in batch.results}
    assert by["reference"].max_score > 0, f"{lab.name} has no checks with points"
    assert by["reference"].percent == 100, _why(by["reference"])
    assert by["student_copy"].percent < 100, _why(by["student_copy"])
    # Run All on a fresh student copy goes past every unsolved exercise to the lab's last cell, the SelfCheck
    import json
    cells = json.loads((out / by["student_copy"].notebook).read_text())["cells"]
    [check] = [c for c in cells if "self-check" in c.get("metadata", {}).get("tags", [])]
    assert check.get("execution_count") and not any(o.get("output_type") == "error" for o in check["outputs"]), \
        f"{lab.name}: Run All of the student copy did not reach and run the SelfCheck cell"
    if (LEGACY / lab.name).is_dir():
        assert by["made_before_the_move"].percent == 100, _why(by["made_before_the_move"])


def test_a_submission_from_before_the_move_imports_the_old_module_names():
    # What the grading test above proves only if the fixture really uses the names that moved.
    source = (LEGACY / "05_data_pipeline" / "lab.ipynb").read_text()
    for old in ("scalelab.spec", "scalelab.data.measure", "scalelab.data.straggler", "scalelab.data.order"):
        assert f"from {old} import" in source or f"from {old.rsplit('.', 1)[0]} import {old.rsplit('.', 1)[1]}" \
            in source, old
