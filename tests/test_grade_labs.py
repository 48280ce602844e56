"""Every lab under labs/: releases cleanly; its reference grades 100 % and its student copy below 100 %, under load.

Parametrized over `labs/*/lab.ipynb` at collection time, so a new lab is picked up without touching this file.
The grading runs are `slow` (each executes the lab twice, in the sandbox, with the lab's grading parameters).
"""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from scalelab.grade.grader import GradeOptions, grade
from scalelab.course.lab import load_lab, student_files
from scalelab.course.release import release_lab

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(p.parent for p in (ROOT / "labs").glob("*/lab.ipynb"))
LEGACY = ROOT / "tests" / "fixtures" / "legacy"  # submissions made before the modules moved (see its README)
labs = pytest.mark.parametrize("lab", LABS, ids=[p.name for p in LABS])
FIXTURE = ROOT / "tests" / "fixtures" / "grading"


class OtherBatch:
    """Another grading batch running beside the one under test, over and over until stopped: the load a grader
    sees when two instructors grade at once (it keeps a kernel and a notebook busy on this machine)."""

    def __init__(self, out: Path):
        self.out, self.stop, self.rounds, self.errors = out, threading.Event(), 0, []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        subs = self.out / "subs"
        subs.mkdir(parents=True)
        for name in ("busy_a", "busy_b"):
            shutil.copyfile(FIXTURE / "submissions" / "correct.ipynb", subs / f"{name}.ipynb")
        while not self.stop.is_set():
            try:
                batch = grade(FIXTURE / "labs" / "90_fixture", sorted(subs.glob("*.ipynb")),
                              self.out / f"round{self.rounds}", GradeOptions(jobs=1))
                self.errors += [r.message for r in batch.results if r.status != "ok"]
            except Exception:  # noqa: BLE001 - reported by the test (with where it came from), never hangs it
                import traceback
                self.errors.append(traceback.format_exc())
                return
            self.rounds += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=300)


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


@pytest.mark.slow
@labs
def test_reference_grades_full_marks_and_student_copy_does_not(lab, tmp_path):
    # Both as submitted folders: the reference with its solved modules, the student copy as released.
    subs = tmp_path / "submissions"
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
    # Under load, as a busy grading day has it: -j 2, while another batch grades beside it. Labs that measure
    # speed-ups must still give an honest reference full marks (their checks compare within one run).
    with OtherBatch(tmp_path / "other") as other:
        # continue_on_error=False: the notebook goes on only where the student copy's tags let Run All go on
        batch = grade(lab, [subs / n for n in names], tmp_path / "out", GradeOptions(jobs=2, continue_on_error=False))
    assert other.errors == [] and other.rounds + other.thread.is_alive() >= 1, other.errors
    by = {r.student: r for r in batch.results}
    assert by["reference"].max_score > 0, f"{lab.name} has no checks with points"
    assert by["reference"].percent == 100, _why(by["reference"])
    assert by["student_copy"].percent < 100, _why(by["student_copy"])
    # Run All on a fresh student copy goes past every unsolved exercise to the lab's last cell, the SelfCheck
    import json
    cells = json.loads((tmp_path / "out" / by["student_copy"].notebook).read_text())["cells"]
    [check] = [c for c in cells if "self-check" in c.get("metadata", {}).get("tags", [])]
    assert check.get("execution_count") and not any(o.get("output_type") == "error" for o in check["outputs"]), \
        f"{lab.name}: Run All of the student copy did not reach and run the SelfCheck cell"
    if legacy.is_dir():
        assert by["made_before_the_move"].percent == 100, _why(by["made_before_the_move"])


def test_a_submission_from_before_the_move_imports_the_old_module_names():
    # What the grading test above proves only if the fixture really uses the names that moved.
    source = (LEGACY / "05_data_pipeline" / "lab.ipynb").read_text()
    for old in ("scalelab.spec", "scalelab.data.measure", "scalelab.data.straggler", "scalelab.data.order"):
        assert f"from {old} import" in source or f"from {old.rsplit('.', 1)[0]} import {old.rsplit('.', 1)[1]}" \
            in source, old
