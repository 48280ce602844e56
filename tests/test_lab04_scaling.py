"""Lab 04 (scaling) runs under papermill at its grading parameters and grades 100 %; its student copy stops at the
first exercise and grades below 100 %; wrong or forged records fail the checks."""
from __future__ import annotations

import pytest

from labtests import ROOT, assert_check_notices, assert_full_marks_within, grade, grading_parameters, working_copy

LAB = ROOT / "labs" / "04_scaling"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(lab_gradings):
    """The run's one grading of this lab (tests/labtests.py: in the sandbox, at lab.yaml's grading parameters,
    under load): the records and evidence its reference's checks ran on, and the seconds it ran."""
    return lab_gradings.reference(LAB)


def test_reference_solution_grades_full_marks_within_budget(reference):
    assert_full_marks_within(LAB, reference, 180)


def test_reference_numbers_tell_the_lab_story(reference):
    records, _ = reference
    study = {(r["batch"], r["rule"]): r["eval_loss"] for r in records["lr_study"]}
    assert study[(256, "linear")] < study[(256, "none")]          # scaling the lr recovers a moderate batch
    assert study[(1024, "linear")] > study[(32, "none")] + 1.0    # ... but not a very large one
    opt = {r["label"]: r["eval_loss"] for r in records["optimizers"]}
    assert opt["lamb"] < opt["sgd linear"] - 1.0
    assert 10 < records["b_noise"] < 1000


def test_student_copy_fails_at_the_first_exercise_and_grades_below_full(lab_gradings):
    error, records = lab_gradings.until_first_error(LAB)  # Run All of the released copy, as graded
    assert error.get("ename") == "NotImplementedError"
    assert "strong_rows" in records and "karp_flatt" not in records
    points, most, results = grade(LAB, records)
    assert points < 0.3 * most  # the sweeps ran; every exercise and all that follows is missing
    outcome = {r.name: r.outcome for r in results}
    assert {outcome[n] for n in ("serial_fraction_estimated", "learning_rates_scaled", "noise_scale_estimated")} == \
        {"missing"}


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(karp_flatt=r["karp_flatt"] + 0.05), "karp_flatt_recomputed"),
    (lambda r: r["weak_rows"][-1].update(samples_per_s=2 * r["weak_rows"][-1]["samples_per_s"]),
     "sweeps_are_the_engine_runs"),
    (lambda r: r.update(amdahl_64=r["amdahl_64"] * 2), "serial_fraction_estimated"),
    (lambda r: [x.update(lr=x["lr"] * 2) for x in r["lr_study"] if x["rule"] == "sqrt"], "learning_rates_scaled"),
    (lambda r: r.update(b_noise=r["b_noise"] * 1.1), "noise_scale_recomputed"),
    (lambda r: r.update(b_noise=-5.0), "noise_scale_estimated"),
    (lambda r: r["weak_rows"][-1].update(efficiency=1.0), "sweep_rows_are_consistent"),
    (lambda r: r["strong_rows"][-1].update(samples_per_s=r["strong_rows"][-1]["samples_per_s"] * 1.3),
     "shared_run_is_one_measurement"),
    (lambda r: [x.update(eval_loss=9.0) for x in r["optimizers"] if x["label"] in ("lars", "lamb")],
     "lars_or_lamb_recover_the_large_batch"),
    (lambda r: r["strong_rows"][1].update(global_batch=999), "strong_sweep_ran"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)


@pytest.mark.slurm
@pytest.mark.netns
def test_the_lab_at_two_nodes_trains_across_them_and_a_slow_link_shows_in_the_comm_share(nodes_cluster, tmp_path):
    """Section 5 at nodes = 2 on the namespace cluster: 1 node x 2 ranks, 2 nodes x 1 rank, and 2 nodes on links
    shaped to 1 Mbit/s; the exercise's numbers follow from the rows, and the shaping is taken off afterwards."""
    from scalelab.course.execute import execute_notebook
    params = {**grading_parameters(LAB), "nodes": 2, "slow_link": "1mbit", "out_dir": str(tmp_path / "runs")}
    work = working_copy(LAB, tmp_path / LAB.name)  # not in labs/: its %%writefile cells would change the lab there
    result = execute_notebook(work / "lab.ipynb", params, output_path=tmp_path / "out.ipynb", cwd=work,
                              cell_timeout=300, total_timeout=600, env=nodes_cluster.env())
    assert result.ok, result.error and result.error.details()
    rows = result.records["node_rows"]
    assert [r["layout"] for r in rows] == ["1 node x 2 ranks", "2 nodes x 1 rank", "2 nodes x 1 rank, 1mbit links"]
    assert len(rows[0]["hosts"]) == 1 and rows[1]["hosts"] == rows[2]["hosts"] == ["node1", "node2"]
    one, unshaped, slow = rows
    assert result.records["cross_node_slowdown"] == pytest.approx(one["samples_per_s"] / unshaped["samples_per_s"])
    # 1 Mbit/s for every all-reduce: each takes hundreds of ms (on a loaded machine the unshaped runs also wait,
    # for each other, so compare the all-reduce time per step, not its share)
    assert slow["comm_ms_per_step"] > 2.5 * unshaped["comm_ms_per_step"] and slow["comm_fraction"] > 0.6, rows
    assert slow["samples_per_s"] < unshaped["samples_per_s"]
    from scalelab.cluster import netns
    assert [netns.link_rate(n) for n in nodes_cluster.node_names] == [None, None]  # the shaping was taken off
