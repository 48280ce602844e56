"""Lab 09 (optimisation at scale) runs under papermill at its grading parameters and grades 100 %; its student
copy stops at the first exercise and grades far below; a wrong or forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import ROOT, assert_check_notices, assert_full_marks_within, assert_stops_at_first_exercise

LAB = ROOT / "labs" / "09_optimization"
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
    assert r["lars"]["max_param_diff"] < 1e-6
    race = {x["label"]: x for x in r["race"]}
    assert race["sgd b32"]["reached"] and not race["sgd b512"]["reached"]  # the large batch stalls with SGD ...
    assert race["lars b512"]["final_accuracy"] > race["sgd b512"]["final_accuracy"]  # ... LARS adapts per layer
    assert race["lamb b512"]["reached"] and r["best_large_batch"] is not None  # and a large batch gets there
    assert r["iteration_saving"] > 2  # K-FAC: far fewer steps
    mem = [x["eigen_bytes"] for x in r["kaisa"]["mem"]]
    assert max(mem) < r["kaisa"]["comm"][0]["eigen_bytes"]
    assert all(x["sent_bytes"] > 0 for x in r["kaisa"]["mem"])


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="lab09_params", not_yet="lars", share=0.2)


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r["lars"].update(max_param_diff=0.01), "lars_matches_the_library"),
    (lambda r: r.update(best_large_batch="sgd b512"), "fastest_large_batch_run_named"),
    (lambda r: r.update(wall_speedup=r["wall_speedup"] * 2), "kfac_trade_computed"),
    (lambda r: r.update(comm_opt_bytes=r["comm_opt_bytes"] // 2), "comm_opt_memory_predicted"),
    (lambda r: r["engine_kfac"]["mem"].update(samples_per_s=r["engine_kfac"]["mem"]["samples_per_s"] * 3),
     "engine_runs_are_the_engine_runs"),
    (lambda r: r["kfac_race"][2]["reached"].update(steps=1, samples=r["kfac_race"][2]["batch"]),
     "races_are_consistent"),
    (lambda r: r["kaisa"]["mem"][0].update(eigen_bytes=r["kaisa"]["comm"][0]["eigen_bytes"]),
     "kaisa_bytes_follow_from_the_layers"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
