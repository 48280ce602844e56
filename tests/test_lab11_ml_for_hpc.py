"""Lab 11 (ML for HPC) runs under papermill at its grading parameters and grades 100 %; its student copy stops at
the first exercise and grades far below; the wrong code of tests/wrong/11.py (a diagnosis that blames the rank that
waited, a provisioning policy that submits only when a link ends: reactive submission in disguise) loses those
exercises' points; a wrong or forged record fails
the check that guards it."""
from __future__ import annotations

import pytest

from scalelab.experiments import queue_policy

from labtests import assert_check_notices, assert_stops_at_first_exercise, assert_wrong_code_loses, lab_test_module

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("11_ml_for_hpc")


def test_reference_numbers_tell_the_lab_story(reference):
    r, _ = reference
    p = r["perf"]  # a grid of 12 engine runs fitted, 4 between its points held out
    held = [x for x in p["rows"] if x["run_dir"] in p["held_out"]]
    assert len(p["rows"]) == 16 and len(held) == 4 and p["model"]["runs"] == 12
    assert {x["ranks"] for x in p["rows"]} == {1, 2} and len({x["params"] for x in p["rows"]}) == 5
    rc = r["root_cause"]  # every held-out slow run diagnosed right, on the grading's own cases
    assert rc["right"] == rc["total"] == 4 and {(t["rank"], t["phase"]) for t in rc["truths"]} == \
        {(0, "data"), (1, "data"), (0, "compute"), (1, "compute")}
    assert r["queue"]["reactive"]["total_idle_h"] > r["queue"]["afterok"]["total_idle_h"]
    m = r["mirage"]  # the learned wait reads the queue: closer than an average, and a policy that beats reactive
    assert m["model_error_h"] < m["average_error_h"] and m["not_implemented"] == []
    assert m["totals"]["yours"]["idle_h"] < m["totals"]["reactive"]["idle_h"]
    assert m["totals"]["yours"]["overlap_node_h"] <= m["totals"]["average"]["overlap_node_h"]
    assert m["seeds"] != queue_policy.held_out_seeds(len(m["seeds"]), None)  # the grading's own traces


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="perf", not_yet="perf_error", share=0.2)


def test_wrong_code_loses_the_points_of_its_exercises(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "provisioning_policy_replays": "a policy that submits the next link only when the running one ends",
        "diagnosis_names_each_slow_rank_and_phase": "a diagnosis that blames the longest raw phase: the waiting rank",
    })


def _policy_on_the_same_traces(decide):
    """A forge: the `yours` runs made by another policy on the graded held-out traces (really simulated)."""
    def forge(r):
        m = r["mirage"]
        ev = queue_policy.evaluate({"yours": decide}, m["seeds"])
        m["runs"] = [x for x in m["runs"] if x["policy"] != "yours"] + [x for x in ev["runs"] if x["policy"] == "yours"]
        m["totals"]["yours"] = ev["totals"]["yours"]
    return forge


def _claim_no_idle(r):
    for x in r["mirage"]["runs"]:
        if x["policy"] == "yours":
            x["total_idle_h"] = 0.0


def _hold_out_a_grid_run(r):
    """A forge: the held-out list names a run of the grid the model was fitted on (an error it has seen)."""
    p = r["perf"]
    p["held_out"][0] = next(x["run_dir"] for x in p["rows"] if x["run_dir"] not in p["held_out"])


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(perf_error=r["perf_error"] / 2), "perf_error_computed"),
    (lambda r: r["perf"]["rows"][0].update(samples_per_s=r["perf"]["rows"][0]["samples_per_s"] * 2),
     "perf_rows_are_the_engine_runs"),
    (lambda r: r["perf"]["model"].update(coef=[0.0] * len(r["perf"]["model"]["coef"])),
     "perf_model_is_fitted_on_its_rows"),
    (_hold_out_a_grid_run, "perf_model_is_fitted_on_its_rows"),
    (lambda r: r["perf"].update(rows=r["perf"]["rows"][:8]), "perf_error_is_the_held_out_runs"),
    # exercise 3's wrong policies, really simulated on the grading's traces: submitting at once holds nodes idle,
    # submitting only when the link ends is reactive submission; a record that claims less idle than its replay;
    # the reference's run on the traces anyone gets outside a grading (or another grading's)
    # exercise 2: answers that are not the diagnosis's own; a run that was not slowed as its spec says
    (lambda r: r["root_cause"].update(answers=list(reversed(r["root_cause"]["answers"]))),
     "diagnosis_names_each_slow_rank_and_phase"),
    (lambda r: r["root_cause"].update(run_dirs=r["root_cause"]["run_dirs"][:1] * len(r["root_cause"]["run_dirs"])),
     "slow_runs_are_this_gradings_cases"),
    (_policy_on_the_same_traces(lambda view: True), "provisioning_policy_replays"),
    (_policy_on_the_same_traces(lambda view: view.left_h <= 0), "provisioning_policy_replays"),
    (_claim_no_idle, "provisioning_policy_replays"),
    (lambda r: r["mirage"].update(seeds=queue_policy.held_out_seeds(len(r["mirage"]["seeds"]), None)),
     "provisioning_policy_replays"),
    (lambda r: r["mirage"]["model"].update(coef=[0.0] * len(r["mirage"]["model"]["coef"])),
     "wait_model_is_fitted_on_the_training_traces"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
