"""Lab 05 (the data pipeline on shared storage) runs under papermill at its grading parameters and grades 100 %;
its story holds in the servers' logs and the runs' files; the wrong code of tests/wrong/05.py (a shard per sample, a
sampler whose ranks overlap, a policy that serves the busiest job first, a read path that always reads the shared
file system) loses the points of its exercise; a wrong or forged record fails the check that guards it. At nodes = 2
on the namespace cluster the lab's own read path reads across the two nodes (the last test)."""
from __future__ import annotations

import pytest

from scalelab.experiments.storage import run_log, shares
from scalelab.grade.evidence import WORKDIR

from labtests import assert_check_notices, assert_wrong_code_loses, grading_parameters, lab_test_module, working_copy

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("05_data_pipeline")


def test_reference_numbers_tell_the_lab_story(reference):
    r, _ = reference
    rows = {row["readers"]: row for row in r["scaling"]["rows"]}
    for n in (2, 4):  # per-reader bandwidth falls about as 1/N (the band the hidden check holds it to)
        assert 0.5 / n < rows[n]["per_reader_mb_s"] / rows[1]["per_reader_mb_s"] < 1.6 / n, rows
    e = r["epoch_layouts"]
    assert e["files"]["opens"] == r["setup"]["samples"] and e["shards"]["opens"] <= e["written"]["files"]
    assert e["shards"]["seconds"] < e["files"]["seconds"]  # the file-per-sample epoch waits on the opens budget
    fair = {row["policy"]: row for row in r["fair_share"]["rows"]}
    assert fair["fifo"]["jobs"]["bulk-c"]["share"] > 0.45  # the large requests win under FIFO
    assert fair["fifo"]["jobs"]["train-a"]["slowdown"] > fair["job-fair"]["jobs"]["train-a"]["slowdown"]
    for policy in ("job-fair", "my_policy:pick"):
        got = shares(run_log(r[WORKDIR], fair[policy]["log"]))
        assert all(abs(s * 3 - 1) <= 0.1 for s in got.values()), (policy, got)
    spread = [row for row in r["spread"]["rows"] if row["run"] == "spread"]
    assert all(row["shared_reads"] == 0 and row["remote_reads"] > 0 for row in spread)  # FanStore: nodes, peers
    assert r["cache"]["cut"]["node"] >= r["cache"]["target"] > r["cache"]["cut"]["private"]  # Lobster's node cache
    alone, beside = r["engine_runs"]
    assert alone["final_loss"] == beside["final_loss"]  # the same training, only the wait differs
    assert beside["mean_wait_ms"] > 2 * alone["mean_wait_ms"]


def test_wrong_code_loses_the_points_of_its_exercises(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "shards_cut_the_opens": "one shard file per sample: an epoch still opens a file per sample",
        "sampler_is_disjoint_complete_and_reshuffled": "ranks seeded apart, n // world each: overlap, gaps",
        "policy_holds_job_fair_shares": "a policy that serves the job with most requests waiting first",
        "read_path_uses_the_nodes_not_the_shared_fs": "a read path that always reads the shared file system",
        "node_cache_cuts_shared_reads_by_n_minus_1_over_n": "a read path that never fills the node cache",
    })


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r["scaling"]["rows"][1].update(per_reader_mb_s=r["scaling"]["rows"][1]["per_reader_mb_s"] * 1.2),
     "per_reader_bandwidth_falls_as_one_over_n"),
    (lambda r: r["fair_share"]["rows"][0]["jobs"]["train-a"].update(share=1 / 3), "recorded_shares_are_the_logs"),
    (lambda r: r["fair_share"]["rows"][-1].update(log=r["fair_share"]["rows"][2]["log"]),
     "policy_holds_job_fair_shares"),  # the built-in job-fair server's log passed off as the student's policy's
    (lambda r: r["sampler_run"].update(world=r["sampler_run"]["world"] + 1),
     "sampler_is_disjoint_complete_and_reshuffled"),
    (lambda r: r["engine_runs"][1].update(log=r["engine_runs"][0]["log"]), "contention_slows_the_training_run"),
    (lambda r: r["engine_runs"][0].update(samples_per_s=r["engine_runs"][0]["samples_per_s"] * 2),
     "engine_runs_read_through_the_server"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)


@pytest.mark.slurm
@pytest.mark.netns
def test_the_lab_at_two_nodes_reads_across_them_through_the_students_read_path(nodes_cluster, tmp_path):
    """Section 6 at nodes = 2 on the namespace cluster: the reference's read path (my_reader.py, written by the lab's
    own cell) runs as one rank on each node; the remote reads cross between the two hosts, both ways, and the ranks'
    files alone say the same (spread_verdict, the grader's reader). The other sections run at their smallest sizes."""
    from scalelab.course.execute import execute_notebook
    from scalelab.experiments import spread as sx
    params = {**grading_parameters(LAB), "nodes": 2, "readers": [1, 2], "scan_seconds": 0.3, "share_seconds": 0.4,
              "engine_steps": 3, "out_dir": str(tmp_path / "runs")}
    work = working_copy(LAB, tmp_path / LAB.name)  # not in labs/: its %%writefile cells would change the lab there
    result = execute_notebook(work / "lab.ipynb", params, output_path=tmp_path / "out.ipynb", cwd=work,
                              cell_timeout=300, total_timeout=600, env=nodes_cluster.env())
    assert result.ok, result.error and result.error.details()
    across = result.records["spread_nodes"]
    assert across["hosts"] == ["node1", "node2"], across  # one rank on each node
    spread_rows = [r for r in across["rows"] if r["run"] == "nodes"]
    assert spread_rows and all(r["path"] == ["my_reader:read_sample"] for r in spread_rows), spread_rows  # not the fallback
    for row in spread_rows:
        assert row["shared_reads"] == 0 and row["bad"] == 0 and row["remote_reads"] > 0, row
        assert set(row["remote_pairs"]) == {"node1->node2", "node2->node1"}, row
    verdict = sx.spread_verdict(tmp_path, across["run_dirs"]["nodes"])
    assert verdict["hosts"] == {0: "node1", 1: "node2"} and verdict["nodes"] == 2, verdict
    assert verdict["misplaced"] == verdict["misrouted"] == 0 and verdict["unserved"] == {0: 0, 1: 0}, verdict
    assert verdict["not_once"] == [] and all(e["shared"] == 0 and e["remote"] > 0 for e in verdict["epochs"]), verdict
    assert verdict["paths"] == ["my_reader:read_sample"] and all("my_reader.py" in c for c in verdict["code"].values())
