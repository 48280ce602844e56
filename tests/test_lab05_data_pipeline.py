"""Lab 05 (data pipeline) runs under papermill at its grading parameters and grades 100 %; its student copy
stops at the first exercise and grades far below; a wrong or forged record fails the check that guards it."""
from __future__ import annotations

import pytest

from labtests import ROOT, assert_check_notices, assert_full_marks_within, assert_stops_at_first_exercise

LAB = ROOT / "labs" / "05_data_pipeline"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(lab_gradings):
    """The run's one grading of this lab (tests/labtests.py: in the sandbox, at lab.yaml's grading parameters,
    under load): the records and evidence its reference's checks ran on, and the seconds it ran."""
    return lab_gradings.reference(LAB)


def test_reference_solution_grades_full_marks_within_budget(reference):
    assert_full_marks_within(LAB, reference, 150)


def test_reference_numbers_tell_the_lab_story(reference):
    records, _ = reference
    rate = {(r["layout"], r["where"]): r["samples_per_s"] for r in records["formats"]}
    assert rate[("shards", "pfs")] > 10 * rate[("files", "pfs")]
    # Whole-shard reads beat per-sample reads; on local storage the two are close (memory speed), so on a loaded
    # 2-core machine allow 10 % of noise, while a streaming loader slower than that would still fail.
    assert rate[("shards-stream", "local")] > 0.9 * rate[("shards", "local")]
    assert records["reuse"]["future_hit_rate"] > 3 * records["lru_hit_rate"]
    even, slow = records["straggler"]["even"], records["straggler"]["straggler"]
    assert slow["step_s"] > 2 * even["step_s"]


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="formats", not_yet="predicted_pfs_files_s", share=0.3)


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(predicted_pfs_files_s=r["predicted_pfs_files_s"] * 3), "pfs_epoch_predicted"),
    (lambda r: r.update(predicted_pfs_files_s=r["predicted_pfs_files_s"] * 1.1),
     "prediction_follows_from_the_recorded_epoch"),
    (lambda r: r.update(needed_threads=r["needed_threads"] + 1), "needed_threads_follows_from_the_unprefetched_run"),
    (lambda r: r.update(chosen_threads=3), "reader_threads_sized"),
    (lambda r: r.update(chosen_threads=max(x["threads"] for x in r["prefetch_sweep"]) if
                        r["chosen_threads"] != max(x["threads"] for x in r["prefetch_sweep"]) else 0),
     "chosen_threads_is_the_smallest_good_count"),
    (lambda r: r.update(lru_hit_rate=r["reuse"]["future_hit_rate"]), "lru_hit_rate_computed"),
    (lambda r: r.update(lru_hit_rate=r["lru_hit_rate"] + 0.01), "lru_hit_rate_matches_the_simulation"),
    (lambda r: r.update(predicted_efficiency=1.0), "straggler_predicted"),
    (lambda r: r.update(predicted_efficiency=r["predicted_efficiency"] * 1.05),
     "efficiency_follows_from_the_parameters"),
    (lambda r: r["formats"][1].update(samples_per_s=r["formats"][1]["samples_per_s"] * 2),
     "format_rows_are_consistent"),
    (lambda r: r["engine_formats"][1].update(final_loss=0.0), "engine_trains_from_both_layouts"),
    (lambda r: r["engine_formats"][0].update(data_fraction=0.0), "engine_formats_are_the_engine_runs"),
    (lambda r: r.pop("cache_epochs"), "cache_serves_later_epochs"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
