"""Forged submissions of the real labs score no more than the unmodified student copy (issue 16, item 1).

Two forgeries per lab, made from the reference notebook by replacing its code cells (the parameters cell stays):

- `forged_records`: hand-typed numbers, mutually consistent (every derived value computed from the typed ones by
  the lab's own formulas), recorded without running anything. They fit the lab's recomputation checks
  (`test_the_forgeries_fit_the_recomputation_checks` proves it), so only the evidence stops them.
- `forged_events`: the same, plus event files written by hand for every run dir the notebook records: a start
  event with the right world size, rising steps, samples/s = samples / step time, a final loss that is the mean of
  the ranks' last losses, numbers that agree with the records; and, where the lab re-reads a run's profiler trace
  or Horovod timeline (labs 01-03), a hand-made one whose re-derived figures are the records'. Written in one go,
  as a notebook does, so the wall clock does not move as the step times say it must: the plausibility check on the
  events rejects them (traces carry no such check: only the events' timing gives the forger away).

Each real lab (01-06) is graded once per run (`lab_gradings`: -j 2, the lab's small grading parameters, another
lab's batch beside it) with its reference, its released student copy and both forgeries. The student copy's Run All
stops being right at its first exercise; its score is the bar.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from scalelab.grade.checks import lab_checks, run_checks
from scalelab.grade.evidence import RUNS, run_evidence

from forgeries import FAKE_EVENTS, FORGERIES, NOT_WRITTEN, forged_records

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=sorted(FORGERIES))
def graded(request, lab_gradings):
    """The lab's batch of the run's one grading of each lab (tests/labtests.py), where its forgeries are graded beside
    its released student copy: (lab, results by submission)."""
    batch = lab_gradings.batch(ROOT / "labs" / request.param)
    return batch.lab, batch.by


def _points(result) -> str:
    return f"{result.score}/{result.max_score} ({result.status}: {result.message})"


@pytest.mark.slow
def test_forged_records_score_no_more_than_the_student_copy(graded):
    lab, by = graded
    student = by["student_copy"]
    assert student.status == "cell_error", _points(student)  # it stopped at its first exercise
    for name in ("forged_records", "forged_events"):
        forged = by[name]
        assert forged.status == "ok", f"{name}: {_points(forged)}"
        assert forged.score <= student.score, f"{lab.name} {name}: {_points(forged)} > student copy " \
                                              f"{_points(student)}"


@pytest.mark.slow
def test_forged_records_fail_for_want_of_a_real_run(graded):
    lab, by = graded
    for c in by["forged_records"].checks:
        assert c.outcome in ("fail", "missing") and c.points == 0, f"{c.name}: {c.outcome} {c.message}"
    messages = {c.message for c in by["forged_records"].checks}
    assert any("made no training run" in m for m in messages), messages


@pytest.mark.slow
def test_hand_written_event_files_are_rejected_as_implausible(graded):
    lab, by = graded
    forged = by["forged_events"]
    assert forged.score == 0, _points(forged)
    messages = " ".join(c.message for c in forged.checks)
    assert "with implausible events were rejected" in messages, messages


@pytest.mark.parametrize("lab", sorted(FORGERIES))
def test_the_forgeries_fit_the_recomputation_checks(lab):
    # What makes the forgeries worth testing: without the evidence they would pass the lab's cross-checks.
    lab_dir = ROOT / "labs" / lab
    checks = [copy.copy(c) for c in lab_checks(lab_dir)]
    for c in checks:
        c.needs_run = False
    results = run_checks(checks, forged_records(lab_dir))
    unwritten = NOT_WRITTEN.get(lab, set())  # checks of files the forgery cannot have: they read no records
    earned = sum(r.points for r in results)
    most = sum(r.max_points for r in results if r.name not in unwritten)
    unmet = [f"{r.name}: {r.message}" for r in results
             if r.outcome != "pass" and "grader.runs" not in r.message and r.name not in unwritten]
    assert not unmet, unmet  # every check that does not read the evidence passes
    # and they earn at least 40 % of the points records could earn, twice what an untouched student copy may earn
    # (test_grade_labs: at most 20 %): without the evidence, typing the numbers would pay. (It was a half until the
    # points moved to the code exercises' checks, which read only evidence: issue 38 item 5; labs 02, 03 at 45-48 %.)
    assert earned >= 0.4 * most, f"{earned}/{most}"


@pytest.mark.parametrize("lab", sorted(FORGERIES))
def test_the_hand_written_events_would_pass_but_for_the_plausibility_check(lab, tmp_path, monkeypatch):
    # The forged events agree with the forged records: only their timing gives them away.
    lab_dir = ROOT / "labs" / lab
    records: dict = {}
    monkeypatch.chdir(tmp_path)
    exec(compile(FAKE_EVENTS + "\nEVENTS = True\n" + FORGERIES[lab], "forgery", "exec"),
         {"record": lambda name, value: records.__setitem__(name, json.loads(json.dumps(value)))})
    found = run_evidence(tmp_path)
    assert found[RUNS] and all(any("passed since the event before" in why for why in run["implausible"])
                               for run in found[RUNS].values())
    for run in found[RUNS].values():
        run["implausible"] = []
    results = run_checks(lab_checks(lab_dir), {**records, **found})
    unwritten = NOT_WRITTEN.get(lab, set())
    assert all(r.outcome == "pass" for r in results if r.name not in unwritten), \
        [f"{r.name}: {r.message}" for r in results if r.outcome != "pass" and r.name not in unwritten]
    assert all(r.outcome != "pass" for r in results if r.name in unwritten)  # no files, no points
