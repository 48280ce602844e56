"""Lab 06 (checkpointing) runs under papermill at its grading parameters and grades 100 %; its student copy
stops at the first exercise and grades far below; a wrong or forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import assert_check_notices, assert_stops_at_first_exercise, assert_wrong_code_loses, lab_test_module

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("06_checkpointing")


def test_reference_numbers_tell_the_lab_story(reference):
    records, _ = reference
    modes = records["modes"]
    # async saves block training for less in all than sync saves (the lab's stall ratio). Not each save's maximum:
    # at grading size (a save ~15 ms) one async save can block longer than a sync save (a GIL hand-over to the
    # writer thread). The writer's threads start with the checkpointer, not in the first save (ckpt.started_pool):
    # starting them there once made async block longer than sync in all (74 vs 64 ms in a loaded CI, 2026-11-27)
    assert modes["async"]["blocked_s"] < modes["sync"]["blocked_s"] and records["least_blocking"] != "sync"
    assert modes["sharded"]["flush_s"] > 0 and modes["async"]["flush_s"] > 0  # written in the background
    assert records["resume"]["start_step"] == 8 and records["max_param_diff"] == 0.0
    assert [a["status"] for a in records["slices"]["attempts"]][-1] == "succeeded"
    kill = records["kill_test"]  # the student's save killed mid-write, resumed by the student's restore
    assert kill["killed_in_save"] and kill["save_ok"] and kill["restore_ok"] and kill["resume_ok"], kill


def test_wrong_save_and_restore_lose_their_points(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "kill_leaves_no_partial_checkpoint": "a save that writes the checkpoint and the manifest in place",
        "own_save_survives_a_kill": "a save that writes the checkpoint and the manifest in place",
        "restore_loads_only_intact_checkpoints": "a restore that loads the newest file in the folder",
        "own_restore_resumes_exactly": "a restore that loads the newest file in the folder"})


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="anatomy", not_yet="my_checksum", share=0.1)


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(my_checksum="crc32:00000000"), "checksum_verified_by_hand"),
    (lambda r: r["anatomy"].update(corrupt_error=None), "partial_and_corrupted_checkpoints_are_refused"),
    (lambda r: r.update(stall_ratio=1.5), "stall_ratio_computed"),
    (lambda r: r["modes"]["sync"].update(blocked_s=10 * r["modes"]["sync"]["blocked_s"]), "modes_are_the_engine_runs"),
    (lambda r: r["resume"].update(start_step=0), "resume_is_the_engine_runs"),
    (lambda r: r["engine_history"][0].update(metric=0.0), "engine_history_is_the_run"),
    (lambda r: r["slices"].update(run_dir=r["keep_run_dir"]), "chain_is_the_engine_run"),
    (lambda r: r.update(stall_ratio=r["stall_ratio"] / 2), "stall_ratio_follows_from_the_modes"),
    (lambda r: r.update(least_blocking="sync"), "stall_ratio_follows_from_the_modes"),
    (lambda r: r.update(max_param_diff=1e-7), "resume_is_exact"),
    (lambda r: r.update(losses_equal=True) or r["resume"]["resumed_losses"].__setitem__(0, 9.0),
     "resume_records_agree"),
    (lambda r: r.update(my_kept=r["my_kept"][:-1]), "retention_rule_applied"),
    (lambda r: r.update(kept_by_engine=[r["engine_history"][0]["step"]] + r["kept_by_engine"]),
     "engine_retention_follows_the_rule"),
    (lambda r: r["slices"]["attempts"][-1].update(start_step=3), "attempts_resume_where_the_last_stopped"),
    (lambda r: r["slices"].update(identical=False), "chain_of_attempts_finishes_identically"),
    (lambda r: r["kill_test"].update(save_ok=False, save_problems=["x"]), "own_save_survives_a_kill"),
    (lambda r: r["kill_test"].update(restore_ok=False, restore_problems=["x"]), "own_restore_resumes_exactly"),
    (lambda r: r["kill_test"].update(run_dir=r["keep_run_dir"]), "kill_leaves_no_partial_checkpoint"),
    (lambda r: r["kill_test"].update(restore_ok=False), "restore_loads_only_intact_checkpoints"),
    (lambda r: r["kill_test"].update(resume_ok=False), "resumed_after_the_kill_equals_the_whole_run"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
