"""Every lab under labs/: releases cleanly; its reference grades 100 % and its student copy below 100 %, under load.

Parametrized over `labs/*/lab.ipynb` at collection time, so a new lab is picked up without touching this file.
The gradings are the run's one grading of each lab (`lab_gradings`, tests/labtests.py): in the sandbox, with the
lab's grading parameters, two labs' batches at a time, each the other's load (as two instructors grading at once),
and the fixture batch grading beside a lab whenever no second lab is in flight, so every lab is graded under load
and no CPU is spent on load alone. The lab story tests, the forgery tests and the site read the same batches.
"""
from __future__ import annotations

import pytest

from scalelab.course.lab import load_lab
from scalelab.course.release import release_lab

from labtests import LABS, LEGACY

labs = pytest.mark.parametrize("lab", LABS, ids=[p.name for p in LABS])


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
def test_reference_grades_full_marks_and_student_copy_does_not(lab, lab_gradings):
    # Under load, as a busy grading day has it: -j 2, while another batch grades beside it (the next lab's, or
    # the fixture's). Labs that measure speed-ups must still give an honest reference full marks (their checks
    # compare within one run).
    batch = lab_gradings.batch(lab)
    assert lab_gradings.other.errors == [], lab_gradings.other.errors
    assert lab_gradings.load_share(lab) >= 0.8, \
        f"{lab.name} was graded beside another batch for only {lab_gradings.load_share(lab):.0%} of its time"
    by, out = batch.by, batch.out
    assert by["reference"].max_score > 0, f"{lab.name} has no checks with points"
    assert by["reference"].percent == 100, _why(by["reference"])
    assert by["student_copy"].percent < 100, _why(by["student_copy"])
    # Run All on a fresh student copy goes past every unsolved exercise to the lab's last cell, the SelfCheck
    import json
    cells = json.loads((out / by["student_copy"].notebook).read_text())["cells"]
    [check] = [c for c in cells if "self-check" in c.get("metadata", {}).get("tags", [])]
    assert check.get("execution_count") and not any(o.get("output_type") == "error" for o in check["outputs"]), \
        f"{lab.name}: Run All of the student copy did not reach and run the SelfCheck cell"
    if (LEGACY / lab.name).is_dir() and lab.name not in REBUILT_SINCE:
        assert by["made_before_the_move"].percent == 100, _why(by["made_before_the_move"])
    elif (LEGACY / lab.name).is_dir():  # a new assignment since: it cannot earn the new exercises' points, but the
        legacy = by["made_before_the_move"]  # names it imports still resolve under today's grader
        cells = json.loads((out / legacy.notebook).read_text())["cells"]
        errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not [e for e in errors if e["ename"] in ("ModuleNotFoundError", "ImportError")], errors[:1]
        assert legacy.status in ("ok", "cell_error"), _why(legacy)


STUDENT_COPY_SHARE = 20.0
"""The most an untouched student copy may score, in percent (issue 38 item 5): the points are for the student's own
work, the code exercises and the checks of the student's own runs, not for cells that ran as released."""
NOT_YET_REWEIGHTED: dict[str, str] = {}  # lab: why its copy may still score more (none left: lab 08 reweighted)


@pytest.mark.slow
@labs
def test_untouched_student_copy_scores_at_most_a_fifth(lab, lab_gradings):
    if lab.name in NOT_YET_REWEIGHTED:
        pytest.xfail(NOT_YET_REWEIGHTED[lab.name])
    student = lab_gradings.batch(lab).by["student_copy"]
    earned = sorted(((c.points, c.name) for c in student.checks if c.points), reverse=True)
    assert student.percent <= STUDENT_COPY_SHARE, \
        f"{lab.name}: the untouched student copy scored {student.percent} % (at most {STUDENT_COPY_SHARE:g} %): " \
        f"{student.score}/{student.max_score} from {earned}"


REBUILT_SINCE = {"05_data_pipeline"}
"""Labs rebuilt after their legacy submission was made (lab 05: issue 31's storage server, a new assignment)."""


def test_a_submission_from_before_the_move_imports_the_old_module_names():
    # What the grading test above proves only if the fixture really uses the names that moved.
    source = (LEGACY / "05_data_pipeline" / "lab.ipynb").read_text()
    for old in ("scalelab.spec", "scalelab.data.measure", "scalelab.data.straggler", "scalelab.data.order"):
        assert f"from {old} import" in source or f"from {old.rsplit('.', 1)[0]} import {old.rsplit('.', 1)[1]}" \
            in source, old
