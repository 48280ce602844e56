"""A classmate's graded work, handed in as one's own, scores no more than the untouched student copy in every lab
(issue 38 item 1: re-verification by execution).

The forgery (tests/forgeries.py, `copied_notebook`) is the strongest we know how to write against the grader: the
reference's graded records and the run folders the grader found in its working copy (event files, spec.json, code),
replayed in a notebook that waits as long as the longest run took, re-stamps each run's events to end now — so
every event lies inside this grading and each step's time fits the clock, which is what the plausibility check
holds hand-written events to — and writes this grading's nonce (read from the kernel's environment) into every
start event. Only a re-run with this grading's nonce tells these files from the notebook's own. `copied_stamped`,
the same without rewriting the nonce, is rejected by the nonce alone (one lab). And the attack is real: with
re-verification switched off (`--no-reverify`), the copy scores above the student copy (one lab).

The reference batches are the run's one grading of each lab (`lab_gradings`); these forgeries are graded after,
two labs at a time, at -j 2 within a lab.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scalelab.grade.grader import GradeOptions, grade
from scalelab.grade.report import read_records_file

from forgeries import copied_notebook
from labtests import LABS, LABS_BY_NAME, TwoInFlight

STAMPED_LAB = "09_optimization"  # also graded with the nonce left as the classmate's, and with re-runs switched off
LAB = STAMPED_LAB  # the lab the tests that take no `lab` parameter need graded (labtests.labs_needed)


@pytest.fixture(scope="module")
def copies(request, lab_gradings, tmp_path_factory):
    """copies(lab) -> {submission: result} of the lab's copied forgeries, with its student copy's result; graded on
    first asking, two labs' batches in flight (the next selected lab's starts beside it)."""
    tmp = tmp_path_factory.mktemp("copied")
    wanted = {getattr(getattr(i, "callspec", None), "params", {}).get("lab", STAMPED_LAB)
              for i in request.session.items if i.module is request.module and "copies" in i.fixturenames}
    selected = [name for name in LABS_BY_NAME if name in wanted]

    def grade_copies(name: str) -> dict:
        lab = LABS_BY_NAME[name]
        batch = lab_gradings.batch(lab)
        records, work = batch.records("reference"), lab_gradings.reference_work(lab)
        subs = tmp / name
        subs.mkdir()
        kinds = {"copied": True} | ({"copied_stamped": False} if name == STAMPED_LAB else {})
        for kind, nonce in kinds.items():
            (subs / f"{kind}.ipynb").write_text(json.dumps(copied_notebook(lab, records, work, nonce)))
        out = {r.student: r for r in grade(lab, sorted(subs.glob("*.ipynb")), tmp / f"{name}-out",
                                            GradeOptions(jobs=2)).results}
        if name == STAMPED_LAB:
            trusting = grade(lab, [subs / "copied.ipynb"], tmp / f"{name}-trusting",
                             GradeOptions(reverify=False)).results[0]
            out["copied_unverified"] = trusting
        out["student_copy"] = batch.by["student_copy"]
        out["records"] = {n: read_records_file(tmp / f"{name}-out", n) for n in kinds}
        return out

    in_flight = TwoInFlight(selected, grade_copies, "grade-copies")
    yield in_flight.result
    in_flight.close()


def _points(result) -> str:
    return f"{result.score}/{result.max_score} ({result.status}: {result.message})"


@pytest.mark.slow
@pytest.mark.parametrize("lab", [lab.name for lab in LABS])
def test_a_classmates_runs_with_this_gradings_nonce_score_no_more_than_the_student_copy(copies, lab):
    by = copies(lab)
    copied, student = by["copied"], by["student_copy"]
    assert copied.status == "ok", _points(copied)
    assert copied.score <= student.score, f"{lab}: copied {_points(copied)} > student copy {_points(student)}\n" + \
        "\n".join(copied.notes) + "\n" + "\n".join(f"{c.name}: {c.points}" for c in copied.checks if c.points)
    # it is the re-run that caught them: the copy's events carry this grading's nonce and a real run's pacing
    assert any("got other losses" in n for n in copied.notes), copied.notes


@pytest.mark.slow
def test_a_classmates_runs_merely_restamped_carry_another_nonce(copies):
    by = copies(STAMPED_LAB)
    stamped = by["copied_stamped"]
    assert stamped.status == "ok" and stamped.score <= by["student_copy"].score, _points(stamped)
    runs = by["records"]["copied_stamped"]["grader.runs"]
    assert runs and all(any("another grading's nonce" in why for why in run["implausible"]) for run in runs.values()), \
        {k: run["implausible"] for k, run in runs.items()}
    assert not any("re-ran" in n for n in stamped.notes)  # the nonce alone rejected them: nothing was re-run


@pytest.mark.slow
def test_without_reverification_the_copied_runs_would_score_above_the_student_copy(copies):
    # what makes the test above worth having: the copy fools every other check of the grader
    by = copies(STAMPED_LAB)
    trusting = by["copied_unverified"]
    assert any("switched off" in n for n in trusting.notes)
    assert trusting.score > 2 * by["student_copy"].score, (_points(trusting), _points(by["student_copy"]))
