"""Lab 03 (Horovod) runs under papermill at its grading parameters and grades 100 %; its student copy stops at the
first exercise and grades below 100 %; a wrong port and forged records fail the checks."""
from __future__ import annotations

import pytest

from labtests import ROOT, assert_check_notices, assert_full_marks_within, grade

LAB = ROOT / "labs" / "03_horovod"
pytestmark = [pytest.mark.slow, pytest.mark.horovod, pytest.mark.mpi]


@pytest.fixture(scope="module")
def reference(lab_gradings):
    """The run's one grading of this lab (tests/labtests.py: in the sandbox, at lab.yaml's grading parameters,
    under load): the records and evidence its reference's checks ran on, and the seconds it ran."""
    return lab_gradings.reference(LAB)


def test_reference_solution_grades_full_marks_within_budget(reference):
    assert_full_marks_within(LAB, reference, 180)


def test_reference_horovod_reproduces_ddp_exactly_on_cpu(reference):
    records, _ = reference
    assert records["comparison"]["max_loss_diff"] < 1e-5
    assert all(r["reference_max_diff"] < 1e-6 for rows in records["port"].values() for r in rows)
    fusion = records["hvd_fusion"]
    assert fusion["allreduces"] > fusion["fused_allreduces"] and fusion["cycles"] > fusion["fused_allreduces"]


def test_student_copy_fails_at_the_first_exercise_and_grades_below_full(lab_gradings):
    error, records = lab_gradings.until_first_error(LAB)  # Run All of the released copy, as graded
    # the %%writefile cell only writes the stub; the cell that trains the port is the one that fails
    assert "NotImplementedError" in error.get("ename", "") + "\n".join(error.get("traceback", []))
    assert records == {}
    points, most, _ = grade(LAB, records)
    assert points == 0 < most


def _no_broadcast(r):
    r["port"]["mpi"][1].update(replica_max_diff=0.64, reference_max_diff=0.64)  # what a port without broadcasts gives


@pytest.mark.parametrize("forge, check_name", [
    (_no_broadcast, "port_reproduces_data_parallel_training"),
    (lambda r: r["port"]["gloo"][1].update(losses=r["port"]["gloo"][0]["losses"]), "ranks_trained_on_their_own_shards"),
    (lambda r: r["port"].pop("mpi"), "port_reproduces_data_parallel_training"),
    (lambda r: r["comparison"].update(hvd_over_ddp=r["comparison"]["hvd_over_ddp"] * 1.1), "comparison_recomputed"),
    (lambda r: r["comparison"].update(max_loss_diff=0.5), "comparison_computed"),
    (lambda r: r["engine_runs"][1].update(loss_curve=[x + 0.01 for x in r["engine_runs"][1]["loss_curve"]]),
     "same_run_two_ways"),
    (lambda r: r["timeline"].update(ok=False, error="skipped"), "timeline_recorded"),
    (lambda r: r["engine_runs"][1].update(samples_per_s=1.0), "throughput_is_the_sum_of_ranks"),
    (lambda r: r["engine_runs"][1].update(samples_per_s=2 * r["engine_runs"][1]["samples_per_s"]),
     "engine_runs_are_the_engine_runs"),
    (lambda r: r["hvd_fusion"].update(fused_allreduces=r["hvd_fusion"]["fused_allreduces"] + 1,
                                      tensors_per_fused=r["hvd_fusion"]["allreduces"]
                                      / (r["hvd_fusion"]["fused_allreduces"] + 1)), "horovod_fusion_is_the_timeline"),
    (lambda r: r["hvd_fusion"].update(fused_allreduces=r["hvd_fusion"]["allreduces"], tensors_per_fused=1.0),
     "horovod_fusion_drawn"),
    (lambda r: r["hvd_fusion"].update(run_dir=r["engine_runs"][0]["run_dir"]), "horovod_fusion_drawn"),
    (lambda r: r["hvd_fusion"].update(run_dir=r["engine_runs"][0]["run_dir"]), "horovod_fusion_is_the_timeline"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)
