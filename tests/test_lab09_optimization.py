"""Lab 09 (optimisation at scale) runs under papermill at its grading parameters and grades 100 %; its student
copy stops at the first exercise and grades far below; a wrong or forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import assert_check_notices, assert_stops_at_first_exercise, assert_wrong_code_loses, lab_test_module

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("09_optimization")


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
    conv = {x["label"]: x for x in r["conv_race"]}  # K-FAC with convolution factors: fewer steps on the CNN too
    assert conv["kfac"]["reached"]["steps"] < conv["sgd"]["reached"]["steps"]
    on = r["on_ranks"]  # time to accuracy on 1 and 2 ranks, for each of SGD, LARS, LAMB and K-FAC that got there
    assert on["ranks"] == [1, 2] and {x["optimizer"] for x in on["rows"]} >= {"sgd", "lamb", "kfac"}
    assert all(x["seconds"] > 0 for x in on["rows"])


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
    # exercise 5: the dense run handed in as yours (its ranks never ran my_kfac.py); a run of another factor
    (lambda r: r["engine_kfac_yours"].update(run_dir=r["engine_kfac"]["comm"]["run_dir"]),
     "your_factor_trains_as_the_dense_one"),
    (lambda r: r["engine_kfac_yours"].update(run_dir=r["engine_kfac"]["mem"]["run_dir"]),
     "your_factor_trains_as_the_dense_one"),
    # time to accuracy on ranks: a K-FAC step time halved; K-FAC's 2-rank row backed by the SGD run on 2 ranks; the
    # 2-rank rows dropped (as if measured on one rank only); the seconds of a row not its steps x its step time
    (lambda r: [x.update(step_s=x["step_s"] / 2, seconds=x["seconds"] / 2) for x in r["on_ranks"]["rows"]
                if x["optimizer"] == "kfac"], "time_on_ranks_is_the_engine_runs"),
    (lambda r: next(x for x in r["on_ranks"]["rows"] if x["label"] == "kfac" and x["ranks"] == 2).update(
        run_dir=next(x for x in r["on_ranks"]["rows"] if x["label"] == "sgd b32" and x["ranks"] == 2)["run_dir"]),
     "time_on_ranks_is_the_engine_runs"),
    (lambda r: r["on_ranks"].update(ranks=[1], rows=[x for x in r["on_ranks"]["rows"] if x["ranks"] == 1]),
     "time_on_ranks_is_the_engine_runs"),
    (lambda r: r["on_ranks"]["rows"][0].update(seconds=r["on_ranks"]["rows"][0]["seconds"] / 3),
     "time_on_ranks_measured"),
    (lambda r: r["conv_race"][1]["reached"].update(steps=1, samples=r["conv_race"][1]["batch"]),
     "races_are_consistent"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)


def test_wrong_code_loses_its_exercises_points(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "lars_by_hand_is_the_librarys": "a trust ratio without eta",
        "best_large_batch_is_the_races_fastest": "a run that never reached the target counted as 0 s",
        "kfac_trade_is_the_races": "the wall speedup as saving x cost",
        "comm_opt_bytes_is_what_a_rank_holds": "the eigenvalues forgotten",
        "your_factor_trains_as_the_dense_one": "a factor without the mean's 1/n",
    })
