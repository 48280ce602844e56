"""Lab 12 (the capstone) graded as a class would be: the reference and three other submissions of its batch
(tests/capstone_variants.py) are ranked by the grader's own measurements (time to the target on its held-out set,
from the runs' checkpoints and events) in the right order; a submission whose checkpoints were swapped or whose run
was written by hand is not ranked; the grader's scoring of a real run's final weights agrees with the accuracy the
run recorded; the injected kill is recovered and its lost time shows. Plus the lab's usual story: full marks within
budget, the student copy stops at its first exercise, the wrong schedule loses its points."""
from __future__ import annotations

import pytest

from scalelab.grade.heldout import HELDOUT
from scalelab.grade.leaderboard import measure, standings

from labtests import (ROOT, assert_check_notices, assert_full_marks_within, assert_stops_at_first_exercise,
                      assert_wrong_code_loses)

LAB = ROOT / "labs" / "12_capstone"


@pytest.fixture(scope="module")
def reference(lab_gradings):
    """The run's one grading of this lab (tests/labtests.py): the records and evidence the reference's checks ran
    on, and the seconds it ran."""
    return lab_gradings.reference(LAB)


@pytest.fixture(scope="module")
def board(lab_gradings):
    """The class board of the lab's graded batch, by student (submission) name."""
    return {row["student"]: row for row in standings(lab_gradings.batch(LAB).out)}


def _scored(records):
    [(key, scored)] = [(k, v) for k, v in records[HELDOUT].items() if k.endswith("capstone")]
    return key, scored


@pytest.mark.slow
def test_reference_solution_grades_full_marks_within_budget(reference):
    assert_full_marks_within(LAB, reference)


@pytest.mark.slow
def test_three_teams_are_ranked_by_the_graders_time_to_target(board):
    ref, slow, missed = board["reference"], board["slow_choices"], board["missed_target"]
    for row in (ref, slow, missed):
        assert row["ranked"], f"{row['student']}: {row['why']}"
    assert ref["time_to_target_s"] is not None and slow["time_to_target_s"] is not None
    assert ref["place"] < slow["place"], (ref, slow)  # under 100 steps to the target against ~580
    assert ref["time_to_target_s"] < slow["time_to_target_s"]
    assert missed["place"] is None and missed["time_to_target_s"] is None and missed["accuracy"] < 0.75
    order = list(board)  # standings' order: reached (by time), then ranked but not reached, then unranked
    assert order.index("reference") < order.index("slow_choices") < order.index("missed_target")
    assert ref["choices"]["lr"] == 0.003 and slow["choices"]["lr"] == 0.0001


@pytest.mark.slow
def test_swapped_checkpoints_and_a_hand_written_run_are_not_ranked(board, lab_gradings):
    by = lab_gradings.batch(LAB).by
    swapped, forged = board["swapped_weights"], board["forged_events"]
    assert not swapped["ranked"] and "reported_accuracy_is_what_the_weights_give" in swapped["why"], swapped
    # the swap made every early checkpoint score like the end: ranked, it would have been first
    key, scored = _scored(lab_gradings.batch(LAB).records("swapped_weights"))
    assert measure(scored, 0.75)["time_to_target_s"] < board["reference"]["time_to_target_s"]
    assert not forged["ranked"] and forged["time_to_target_s"] is None, forged
    assert by["forged_events"].score == 0, [(c.name, c.points) for c in by["forged_events"].checks if c.points]
    assert list(board).index("swapped_weights") > list(board).index("missed_target")


@pytest.mark.slow
def test_the_held_out_seed_is_nowhere_a_submission_can_read(lab_gradings):
    hunt = lab_gradings.batch(LAB).records("seed_hunt")["seed_hunt"]
    assert hunt["looked"] > 20 and hunt["hits"] == [], hunt  # its job folder, home, tmp, environment, checkouts
    assert lab_gradings.batch(LAB).by["seed_hunt"].status == "ok"  # the hunt ran, and the notebook to its end


@pytest.mark.slow
def test_the_graders_scoring_of_the_final_weights_agrees_with_the_run(reference):
    r, _ = reference
    _, scored = _scored(r)
    said, measured = scored["timeline"]["evals"], scored["accuracy"]
    tolerance = 0.15  # hidden_checks.ACCURACY_TOLERANCE: one fixed set of 512 validation fields vs 2048 held out
    assert abs(said["final"] - measured["final"]) <= tolerance
    assert measured["final"] >= 0.75 and abs(r["capstone"]["eval_accuracy"] - said["final"]) < 1e-9
    steps = [s for s in measured if s.isdigit()]
    assert len(steps) >= 15 and all(abs(said[s] - measured[s]) <= tolerance for s in steps if s in said)
    assert measured[min(steps, key=int)] < measured["final"] - 0.2  # early checkpoints really are worse


@pytest.mark.slow
def test_the_injected_kill_is_recovered_and_its_lost_time_shows(reference, board):
    r, _ = reference
    _, scored = _scored(r)
    tl = scored["timeline"]
    assert [(f["rank"], f["kind"], f["step"]) for f in tl["faults"]] == [(1, "kill", 45)]
    first, again = tl["launches"][:2]
    assert first["last_step"] < 50 and again["start_step"] == 40  # back from the step-40 checkpoint
    m = measure(scored, 0.75)
    assert m["restarts"] == 1 and m["lost_s"] > 0
    # the lost time is the restart and the steps 41-45 done twice: at least what those steps took the first time
    assert m["lost_s"] > first["step_t"]["45"] - first["step_t"]["40"]
    assert board["reference"]["lost_s"] == pytest.approx(m["lost_s"])


@pytest.mark.slow
def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="lab12_params", not_yet="choices", share=0.2)


@pytest.mark.slow
def test_wrong_code_loses_its_exercises_points(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "schedule_is_yours_in_every_step": "a warm-up from rate 0 at step 0",
    })


def _eval_raised(r):
    _, scored = _scored(r)
    scored["timeline"]["evals"]["final"] = scored["accuracy"]["final"] + 0.3


def _no_restart(r):
    _, scored = _scored(r)
    scored["timeline"]["launches"] = scored["timeline"]["launches"][:1]


@pytest.mark.slow
@pytest.mark.parametrize("forge,check_name", [
    (lambda r: r.pop(HELDOUT), "grader_scored_your_checkpoints"),  # not scored: nothing to rank
    (_eval_raised, "reported_accuracy_is_what_the_weights_give"),
    (_no_restart, "recovered_from_the_failure"),
    (lambda r: r["grader.parameters"].update(budget_rank_s=1.0), "within_the_budget"),
    (lambda r: r["grader.parameters"].update(target=0.99), "target_reached_on_the_heldout_set"),
    (lambda r: r["choices"].update(warmup_steps=5), "schedule_is_yours_in_every_step"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)


def test_measure_reads_time_to_target_budget_and_lost_time():
    scored = {"accuracy": {"10": 0.5, "20": 0.82, "30": 0.85, "final": 0.86},
              "timeline": {"launches": [
                  {"t_start": 100.0, "t_last": 101.5, "world_size": 2, "last_step": 25,
                   "step_t": {"24": 101.4, "25": 101.5}},
                  {"t_start": 104.0, "t_last": 106.0, "world_size": 2, "start_step": 20, "last_step": 40,
                   "step_t": {"25": 104.7, "40": 106.0}}],
                  "checkpoints": {"10": 100.6, "20": 101.0, "30": 105.2}, "t_end": 106.0}}
    m = measure(scored, 0.8)
    assert m["time_to_target_s"] == pytest.approx(1.0)  # step 20's checkpoint, 1 s after the first start
    assert measure(scored, 0.86)["time_to_target_s"] == pytest.approx(6.0)  # only the final weights reach it
    assert measure(scored, 0.9)["time_to_target_s"] is None
    assert m["accuracy"] == 0.86 and m["restarts"] == 1
    assert m["rank_seconds"] == pytest.approx(2 * (104.0 - 100.0) + 2 * (106.0 - 104.0))  # the restart's gap too
    assert m["lost_s"] == pytest.approx(104.7 - 101.5)  # the last step before the kill, done again


def test_a_standing_that_crashes_leaves_the_submission_unranked_with_the_reason():
    from scalelab.grade.leaderboard import place
    assert place(lambda r: {"ranked": True, "seen": r["x"]}, {"x": 1}) == {"ranked": True, "seen": 1}
    crashed = place(lambda r: r["missing"], {})
    assert crashed["ranked"] is False and "MissingRecord" in crashed["why"]
    assert "not a dict" in place(lambda r: [1], {})["why"]


def test_standings_order_reached_then_ranked_then_unranked(tmp_path):
    import json
    results = tmp_path / "results"
    results.mkdir()
    rows = {"ann": {"ranked": True, "time_to_target_s": 9.0, "accuracy": 0.85, "rank_seconds": 30},
            "bob": {"ranked": True, "time_to_target_s": 4.0, "accuracy": 0.84, "rank_seconds": 50},
            "cy": {"ranked": True, "time_to_target_s": None, "accuracy": 0.7, "rank_seconds": 10},
            "dee": {"ranked": False, "why": "forged", "time_to_target_s": 1.0, "accuracy": 0.99},
            "eve": {"ranked": True, "time_to_target_s": None, "accuracy": 0.75, "rank_seconds": 10}}
    for name, s in rows.items():
        (results / f"{name}.json").write_text(json.dumps({"student": name, "standing": s}))
    (results / "fay.json").write_text(json.dumps({"student": "fay"}))  # a lab without a board: not on it
    board = standings(tmp_path)
    assert [r["student"] for r in board] == ["bob", "ann", "eve", "cy", "dee"]
    assert [r["place"] for r in board] == [1, 2, None, None, None]


def test_a_choice_off_the_menu_is_an_error_that_names_it():
    from scalelab.errors import SpecError
    from scalelab.experiments.capstone import challenge_spec, checked_choices
    for bad, where in (({"optimizer": "sgdd"}, "optimizer"), ({"global_batch": 65, "workers": 2}, "global_batch"),
                       ({"epochs": 3}, "epochs"), ({"lr": -1}, "lr"), ({"workers": 0}, "workers")):
        with pytest.raises(SpecError, match=where):
            checked_choices(bad)
    spec = challenge_spec({"workers": 2, "global_batch": 64, "steps": 50, "checkpoint_every": 10},
                          output_dir="x", kill_at_step=45)
    assert (spec.fault.kind, spec.fault.rank, spec.fault.step) == ("kill", 1, 45)
    assert spec.checkpoint.keep_last >= 5 and spec.eval_every == 10 and spec.world.max_restarts == 3
    assert challenge_spec({"steps": 40}, output_dir="x", kill_at_step=45).fault.kind == "none"  # past the end


def test_a_class_run_survives_the_instructors_kill_and_shows_what_it_cost(tmp_path):
    # the live challenge: no kill in the spec (kill_at_step 0), the instructor's button (run/inject.issue) instead
    import json
    import os
    import time
    from scalelab.experiments.capstone import challenge_spec, own_view
    from scalelab.launch import launch
    from scalelab.run.inject import ENV_VAR, issue
    spool = tmp_path / "spool" / "inject.json"
    spec = challenge_spec({"workers": 2, "global_batch": 64, "steps": 400, "checkpoint_every": 10},
                          output_dir=str(tmp_path / "labs" / "12_capstone" / "runs" / "capstone"))
    run = launch(spec, env={**os.environ, ENV_VAR: str(spool)})
    try:
        rank0 = run.run_dir / "events" / "rank-0.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (rank0.exists() and '"step": 20,' in rank0.read_text()):
            assert run.status in ("pending", "running"), run.status
            time.sleep(0.02)
        record = issue(spool, "kill", by="teacher", lab="12_capstone")
        result = run.wait(timeout=300)
    finally:
        run.stop()
    assert result["status"] == "succeeded", result.get("error")
    view = own_view(run.run_dir)
    assert [(f["rank"], f["kind"], f["source"]) for f in view["faults"]] == [(1, "kill", "instructor")]
    assert view["launches"] == 2 and len(view["lost_s"]) == 1 and view["lost_s"][0] > 0
    fault = next(json.loads(line) for line in (run.run_dir / "events" / "rank-1.jsonl").read_text().splitlines()
                 if '"fault"' in line)
    assert fault["id"] == record["id"] and fault["step"] < 400
