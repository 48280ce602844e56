"""Lab 10 (workflows for science) runs under papermill at its grading parameters and grades 100 %; its student
copy stops at the first exercise and grades far below; a wrong or forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import ROOT, assert_check_notices, assert_full_marks_within, assert_stops_at_first_exercise

LAB = ROOT / "labs" / "10_workflows"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(lab_gradings):
    """The run's one grading of this lab (tests/labtests.py: in the sandbox, at lab.yaml's grading parameters,
    under load): the records and evidence its reference's checks ran on, and the seconds it ran."""
    return lab_gradings.reference(LAB)


def test_reference_solution_grades_full_marks_within_budget(reference):
    assert_full_marks_within(LAB, reference)


def test_reference_numbers_tell_the_lab_story(reference):
    r, _ = reference
    assert r["hpo"]["pruned"] >= 1 and r["pruning_saving"] > 0
    assert any(m["accuracy"] > m["scratch_accuracy"] for m in r["nas"]["models"] if m["parent"] is not None)
    assert r["continual"]["0"]["old_accuracy"] < 0.15 < r["forgetting_first"]
    assert r["lineage"]["frozen_new_bytes"] < 0.2 * r["lineage"]["final"]["full_copy_bytes"] / \
        r["lineage"]["final"]["models"]
    assert r["queue"]["reactive"]["total_idle_h"] > r["queue"]["afterok"]["total_idle_h"]


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="hpo", not_yet="pruning_saving", share=0.2)


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(pruning_saving=0.0), "pruning_saving_computed"),
    (lambda r: r.update(seconds_saved=r["seconds_saved"] + 1), "seconds_saved_computed"),
    (lambda r: r.update(forgetting_first=0.0), "forgetting_measured"),
    (lambda r: r.update(perf_error=r["perf_error"] / 2), "perf_error_computed"),
    (lambda r: r["perf"]["rows"][0].update(samples_per_s=r["perf"]["rows"][0]["samples_per_s"] * 2),
     "perf_rows_are_the_engine_runs"),
    (lambda r: r["perf"]["model"].update(coef=[0.0] * len(r["perf"]["model"]["coef"])),
     "perf_model_is_fitted_on_its_rows"),
    (lambda r: r["hpo"]["trials"][0].update(steps=1, state="complete"), "hpo_trials_are_consistent"),
    (lambda r: r["continual_ranks"][1].update(acc=[[0.0]]), "ranks_share_one_buffer"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
