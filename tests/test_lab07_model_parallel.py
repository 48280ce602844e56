"""Lab 07 (model parallelism) runs under papermill at its grading parameters and grades 100 %; its student copy
stops at the first exercise and grades far below; a wrong or forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import assert_check_notices, assert_stops_at_first_exercise, assert_wrong_code_loses, lab_test_module

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("07_model_parallel")


def test_reference_numbers_tell_the_lab_story(reference):
    records, _ = reference
    runs = records["fsdp_runs"]
    assert runs["fsdp_full"]["memory"]["state_bytes"] * 2 == runs["ddp"]["memory"]["state_bytes"]
    assert runs["fsdp_full"]["loss_curve"] == pytest.approx(runs["ddp"]["loss_curve"], rel=1e-5)
    assert records["memory_answers"]["traffic_ratio"] == pytest.approx(3.0)
    pipe = records["pipeline"]
    assert pipe["1f1b/8"]["measured_bubble"] < pipe["1f1b/1"]["measured_bubble"] == pytest.approx(0.5)
    assert pipe["gpipe/8"]["peak_in_flight"] == [8, 8] and pipe["1f1b/8"]["peak_in_flight"] == [2, 1]
    runs_4b = records["pipeline_runs"]  # section 4b's prose quotes these bytes (deterministic: no clock in them)
    assert runs_4b["my_gpipe"]["activation_peak_bytes"] == runs_4b["torch_gpipe"]["activation_peak_bytes"] \
        == [131072, 132640]
    assert runs_4b["my_1f1b"]["activation_peak_bytes"] == runs_4b["torch_1f1b"]["activation_peak_bytes"] \
        == [32768, 16580]
    assert runs_4b["my_1f1b"]["ops"][1] == " ".join(f"F{i} B{i}" for i in range(8))
    for row in runs_4b.values():
        assert row["loss_curve"] == pytest.approx(runs_4b["torch_gpipe"]["loss_curve"], rel=1e-5)
        assert 0 < row["bubble"] <= row["formula"] + 0.35
    assert records["reshard"]["one_equal"] and records["reshard"]["two_equal"]
    assert records["planner"]["fp32_zero3_bytes"] == runs["fsdp_full"]["memory"]["state_bytes"]
    mesh = records["mesh_run"]  # dp 2 x tp 2 on 4 ranks: DDP's losses, about half its state on every rank
    assert mesh["loss_curve"] == pytest.approx(runs["ddp"]["loss_curve"], rel=1e-5)
    assert max(mesh["state_bytes"]) < 0.52 * runs["ddp"]["memory"]["state_bytes"]


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="lab07_params", not_yet="my_state_table", share=0.1)


def test_wrong_schedules_lose_their_points(lab_gradings):
    """tests/wrong/07.py: a GPipe whose last stage runs its backwards newest first (the engine refuses the plan:
    the stages would exchange gradients in different orders) and a "1F1B" that fills the pipe with every
    micro-batch (GPipe's bytes)."""
    assert_wrong_code_loses(lab_gradings, LAB, {"my_gpipe_runs_in_the_engine": "backwards out of order",
                                                "my_1f1b_holds_fewer_activation_bytes": "GPipe under 1F1B's name"})


def _swap_runs(r, a, b):
    runs = r["pipeline_runs"]
    runs[a]["run_dir"], runs[b]["run_dir"] = runs[b]["run_dir"], runs[a]["run_dir"]


def _scale(r, factor):
    r["fsdp_runs"]["fsdp_full"]["memory"]["state_bytes"] *= factor


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r["my_state_table"]["bytes"].__setitem__(1, r["my_state_table"]["bytes"][0]),
     "state_arithmetic_written"),
    (lambda r: r["fsdp_runs"]["fsdp_full"]["loss_curve"].__setitem__(0, 9.0), "fsdp_trains_like_ddp"),
    (lambda r: _scale(r, 2), "fsdp_halves_the_state"),
    (lambda r: r["memory_answers"].update(traffic_ratio=1.5), "measured_against_the_arithmetic"),
    (lambda r: r["memory_answers"].update(predicted_fsdp_bytes=r["memory_answers"]["predicted_fsdp_bytes"] * 2),
     "measured_against_the_arithmetic"),
    (lambda r: r["tensor_parallel"][1].update(input_grad_diff=0.3), "tensor_parallel_by_hand_is_exact"),
    (lambda r: r["pipeline"]["gpipe/8"].update(formula=1 / 8), "bubble_formula_written"),
    (lambda r: r["pipeline"]["1f1b/8"].update(measured_bubble=0.5), "bubble_shrinks_and_1f1b_holds_less"),
    (lambda r: r["reshard"].update(one_equal=False), "checkpoint_reshards_exactly"),
    (lambda r: r["sizing"].update(gpus_for_70b=9), "seventy_b_sized"),
    (lambda r: r["fsdp_runs"]["ddp"]["loss_curve"].__setitem__(-1, 0.1), "fsdp_runs_are_the_engine_runs"),
    (lambda r: r["fsdp_runs"]["fsdp_full"].update(run_dir=r["fsdp_runs"]["ddp"]["run_dir"]),
     "fsdp_runs_are_the_engine_runs"),
    (lambda r: r["memory_answers"].update(fsdp_over_ddp=0.9), "sharding_halves_state_and_triples_collective_bytes"),
    (lambda r: r["fsdp_runs"]["fsdp_grad_op"]["comm"]["all_gather"].update(bytes=1), "grad_op_gathers_once"),
    (lambda r: r["pipeline"]["gpipe/8"].update(peak_in_flight=[2, 1]), "pipeline_records_agree"),
    (lambda r: r["sizing"].update(gpus_for_70b=15, nodes_for_70b=2), "seventy_b_is_two_nodes"),
    (lambda r: r["planner"]["layout"]["links"].update(tp="inter"), "a_feasible_3d_layout"),
    (lambda r: r["planner"]["layout"].update(feasible=False, problems=["too big"]), "a_feasible_3d_layout"),
    (lambda r: r["planner"].update(fp32_zero3_bytes=1.0), "planner_predicts_the_measured_state"),
    (lambda r: r["mesh_run"]["loss_curve"].__setitem__(0, 9.0), "a_3d_mesh_trains_like_ddp"),
    (lambda r: r["mesh_run"].update(predicted_state_bytes=r["mesh_run"]["predicted_state_bytes"] * 2),
     "a_3d_mesh_trains_like_ddp"),
    (lambda r: r["mesh_run"].update(run_dir=r["fsdp_runs"]["ddp"]["run_dir"]), "mesh_run_is_the_engine_run"),
    (lambda r: r["pipeline_runs"]["my_1f1b"].update(error="refused"), "my_schedules_ran"),
    (lambda r: r["pipeline_runs"]["torch_1f1b"].update(activation_peak_bytes=[10 ** 9, 1]),
     "torch_schedules_beside_yours"),
    (lambda r: _swap_runs(r, "my_gpipe", "torch_gpipe"), "my_gpipe_runs_in_the_engine"),
    (lambda r: _swap_runs(r, "my_1f1b", "torch_1f1b"), "my_1f1b_runs_in_the_engine"),
    (lambda r: _swap_runs(r, "my_1f1b", "my_gpipe"), "my_1f1b_holds_fewer_activation_bytes"),
    (lambda r: r["pipeline_runs"]["my_1f1b"].update(run_dir=r["pipeline_runs"]["torch_gpipe"]["run_dir"]),
     "my_1f1b_bubble_near_the_formula"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
