"""Lab 10 (workflows for science) runs under papermill at its grading parameters and grades 100 %; its student
copy stops at the first exercise and grades far below; the wrong code of tests/wrong/10.py (an objective that leaves
a pruned trial's run training, a buffer that keeps only the newest samples) loses those exercises' points; a wrong or
forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import assert_check_notices, assert_stops_at_first_exercise, assert_wrong_code_loses, lab_test_module

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("10_workflows")


def test_reference_numbers_tell_the_lab_story(reference):
    r, _ = reference
    assert r["hpo"]["pruned"] >= 1 and r["pruning_saving"] > 0
    assert any(m["accuracy"] > m["scratch_accuracy"] for m in r["nas"]["models"] if m["parent"] is not None)
    assert r["continual"]["0"]["old_accuracy"] < 0.15 < r["forgetting_first"]
    assert r["lineage"]["frozen_new_bytes"] < 0.2 * r["lineage"]["final"]["full_copy_bytes"] / \
        r["lineage"]["final"]["models"]
    on = r["online"]["runs"]  # the simulation in the loop: the buffer keeps the first regime through the drift
    assert on["128"]["trainer"]["forgetting"] < on["0"]["trainer"]["forgetting"]
    assert on["0"]["trainer"]["speedup"] > 1 and on["0"]["trainer"]["errors_after"][0][0] < 0.3


def _buffer_kept_by(body):
    """A forge: the buffered streams trained again for real with a wrong keep() (`body`) in my_buffer.py."""
    def forge(r):
        import os
        import tempfile
        from scalelab.experiments import workflows as wf
        ref = r["continual"]["0"]
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "my_buffer.py"), "w") as f:
                f.write("def keep(seen, capacity, rng):\n" + body)
            here = os.getcwd()
            os.chdir(tmp)
            try:
                for b in [b for b in r["continual"] if int(b) > 0]:
                    r["continual"][b] = wf.continual_run(tasks=len(ref["acc"]), buffer=int(b), keep="my_buffer:keep",
                                                         steps_per_task=ref["steps_per_task"])
            finally:
                os.chdir(here)
    return forge


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="lab10_params", not_yet="hpo", share=0.2)



def test_wrong_code_loses_the_points_of_its_exercises(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "objective_reports_its_engine_runs": "an objective that leaves a pruned trial's run training to its end",
        "reservoir_keeps_every_task_in_proportion": "a buffer that overwrites a random slot with every new sample",
    })

@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(pruning_saving=0.0), "pruning_saving_computed"),
    # exercise 1: values the objective reported that its runs did not measure; a trial without an engine run; a
    # search whose pruned trials' runs all went on to their end (never stopped)
    (lambda r: r["hpo"]["trials"][0]["intermediate"].update({k: 0.99 for k in r["hpo"]["trials"][0]["intermediate"]}),
     "objective_reports_its_engine_runs"),
    (lambda r: r["hpo"]["trials"][-1].update(run_dir=None), "objective_reports_its_engine_runs"),
    (lambda r: r["lineage"].update(frozen_trained=[]), "frozen_child_trained_its_head_only"),
    (lambda r: [t.update(state="complete") for t in r["hpo"]["trials"] if t["state"] == "pruned"],
     "objective_reports_its_engine_runs"),
    (lambda r: r.update(seconds_saved=r["seconds_saved"] + 1), "seconds_saved_computed"),
    (lambda r: r.update(forgetting_first=0.0), "forgetting_measured"),
    (lambda r: r["continual_ranks"][0].update(code={}), "reservoir_keeps_every_task_in_proportion"),
    (lambda r: r["hpo"]["trials"][0].update(steps=1, state="complete"), "hpo_trials_are_consistent"),
    (lambda r: r["continual_ranks"][1].update(acc=[[0.0]]), "ranks_share_one_buffer"),
    # exercise 4's wrong buffers, really trained: one that keeps the newest samples forgets the old task, one that
    # stops at its first samples never holds the new one
    (_buffer_kept_by("    return seen - 1 if seen <= capacity else int(rng.integers(0, capacity))\n"),
     "reservoir_keeps_every_task_in_proportion"),
    (_buffer_kept_by("    return seen - 1 if seen <= capacity else None\n"), "reservoir_keeps_every_task_in_proportion"),
    # the online run's record against its own logs
    (lambda r: r["online"]["runs"]["0"]["trainer"].update(error=[0.01, 0.01]), "online_solver_and_trainer_ran_at_once"),
    (lambda r: r["online"]["runs"]["0"]["trainer"].update(speedup=1000.0), "online_solver_and_trainer_ran_at_once"),
    (lambda r: r["online"]["runs"]["0"].update(dir=r["online"]["runs"]["128"]["dir"]) or
     r["online"]["runs"].pop("128"), "online_buffer_holds_the_first_regime"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
