"""The grader's parameters win (issue 38, item 3): checks hold the runs against the values the grader injected, not
against what the notebook recorded, and a notebook that re-assigns sizes after injection loses the points of the
runs it shrank, with a message that says so.

The attack: the reference with one cell right after the parameters cell that re-assigns sizes (tests/labtests.py
SHRUNK: lab 07 by plain assignment, lab 09 through globals(), which no look at the source catches), graded in the
labs' shared batches as the submission `shrunk_params`. Before the change it kept those points: the checks compared
the runs with the notebook's own record of its parameters (lab 07: 35 of 37 in the issue's attack).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from scalelab.grade.checks import Check, evidence, param, run_check
from scalelab.grade.evidence import CHANGED, PARAMS, RUNS, apply_parameters

from labtests import LABS_BY_NAME, SHRUNK

CHANGED_MESSAGE = "parameters were changed after injection"

SHRUNK_RUNS = {
    "07_model_parallel": {  # steps and pipeline_steps shrunk: the DDP/FSDP runs, the mesh, the schedule runs
        "fsdp_runs_are_the_engine_runs", "mesh_run_is_the_engine_run", "my_gpipe_runs_in_the_engine",
        "my_1f1b_runs_in_the_engine", "my_1f1b_holds_fewer_activation_bytes", "my_1f1b_bubble_near_the_formula"},
    "09_optimization": {  # engine_steps, samples and lars_steps shrunk
        "engine_runs_are_the_engine_runs", "races_are_consistent", "lars_record_is_its_run",
        "lars_by_hand_is_the_librarys", "best_large_batch_is_the_races_fastest", "kfac_trade_is_the_races",
        "time_on_ranks_is_the_engine_runs"},
}


def test_a_record_of_the_labs_parameters_takes_the_graders_values_and_the_change_is_said():
    records = {"lab07_params": {"steps": 2, "workers": 2, "model_width": 64}, "other": 1}
    notes = apply_parameters(records, {"steps": 5, "workers": 2, "pipeline_steps": 3})
    assert records[PARAMS] == {"steps": 5, "workers": 2, "pipeline_steps": 3}
    assert records["lab07_params"] == {"steps": 5, "workers": 2, "model_width": 64}  # what it did not set stays
    assert records[CHANGED] == {"steps": 2}
    assert len(notes) == 1 and "steps=2 (the grader set 5)" in notes[0]
    assert "parameters were changed after the grader injected them" in notes[0]
    same = {"lab07_params": {"steps": 5, "micro_batches": [1, 8]}}
    assert apply_parameters(same, {"steps": 5, "micro_batches": [1, 8]}) == [] and CHANGED not in same


def _sized(**sizes) -> Check:
    return Check("sized", lambda r: evidence(r, "runs/a", **sizes), 1.0, "sized")


def test_a_run_of_other_sizes_than_the_graders_fails_the_checks_that_read_it():
    runs = {RUNS: {"runs/a": {"total_steps": 2, "world_size": 2, "implausible": []}}}
    graded = {**runs, PARAMS: {"steps": 5, "workers": 2}}
    result = run_check(_sized(total_steps="steps", world_size="workers"), graded)
    assert result.outcome == "fail" and result.points == 0
    assert "used total_steps=2, the grader set steps=5" in result.message and CHANGED_MESSAGE in result.message
    derived = run_check(_sized(total_steps=param(graded, "steps") + 5), graded)  # a size worked out from them
    assert derived.outcome == "fail" and "the grader's parameters make it 10" in derived.message
    assert run_check(_sized(total_steps="steps"), {**runs, PARAMS: {"steps": 2}}).outcome == "pass"
    # outside the grader (SelfCheck, a test on records) no parameter is known: nothing to hold the run against
    assert param(runs, "steps") is None and run_check(_sized(total_steps="steps"), runs).outcome == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("lab", sorted(SHRUNK))
def test_parameters_reassigned_after_injection_lose_the_shrunk_runs_points(lab, lab_gradings):
    batch = lab_gradings.batch(LABS_BY_NAME[lab])
    shrunk, reference = batch.by["shrunk_params"], batch.by["reference"]
    assert shrunk.status in ("ok", "cell_error"), f"{shrunk.status}: {shrunk.message}"
    by_name = {c.name: c for c in shrunk.checks}
    full = {c.name: c for c in reference.checks}
    for name in sorted(SHRUNK_RUNS[lab]):
        c = by_name[name]
        assert full[name].points == full[name].max_points, f"the reference lost {name}: {full[name].message}"
        assert c.points == 0, f"{name} kept {c.points} of {c.max_points} for shrunk runs: {c.message}"
        assert CHANGED_MESSAGE in c.message, f"{name}: {c.message}"
    assert shrunk.score < reference.score
    records = batch.records("shrunk_params")
    assert records[PARAMS] == lab_gradings_parameters(lab)  # what the checks held the runs against
    if lab == "07_model_parallel":  # its record of the parameters says what ran: the note says so
        assert records[CHANGED] == {"steps": 2, "pipeline_steps": 2}, records.get(CHANGED)
        assert any("steps=2 (the grader set 5)" in n for n in shrunk.notes), shrunk.notes


def lab_gradings_parameters(lab: str) -> dict:
    import yaml
    return yaml.safe_load((Path(LABS_BY_NAME[lab]) / "lab.yaml").read_text())["grading"]["parameters"]
