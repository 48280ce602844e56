"""Lab 04 (scaling) runs under papermill at its grading parameters and grades 100 %; its student copy stops at the
first exercise and grades below 100 %; wrong code (tests/wrong/04.py) and wrong or forged records fail the checks;
on the 2-node namespace cluster the reference's batch script runs across both nodes and a script asking for one
node fails its check."""
from __future__ import annotations

import json
import os

import pytest

from labtests import (assert_check_notices, assert_wrong_code_loses, grade, grading_parameters, lab_test_module,
                     replace_block, working_copy, wrong_solutions)

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("04_scaling")


def test_reference_numbers_tell_the_lab_story(reference):
    records, _ = reference
    study = {(r["batch"], r["rule"]): r["eval_loss"] for r in records["lr_study"]}
    assert study[(256, "linear")] < study[(256, "none")]          # scaling the lr recovers a moderate batch
    assert study[(1024, "linear")] > study[(32, "none")] + 1.0    # ... but not a very large one
    opt = {r["label"]: r["eval_loss"] for r in records["optimizers"]}
    assert opt["lamb"] < opt["sgd linear"] - 1.0
    assert 10 < records["b_noise"] < 1000
    runs = {r["label"]: r for r in records["schedule_runs"]}
    # the decayed run settles: at peak 0.48 after 20 warm-up steps its tail loss was 0.02-0.53 x the constant run's over
    # 15 seeds here (the grading's nonce draws the initial weights; at 0.64 after 10, half the seeds diverged)
    assert runs["yours"]["tail_loss"] < 0.75 * runs["constant"]["tail_loss"]
    best = {p["batch"]: p["steps"] for p in records["target_study"]["best"]}
    assert len(best) >= 4 and best[16] > 2 * min(best.values())  # small batches need many more steps ...
    assert 5 < records["critical_batch"]["b_crit"] < 500            # ... up to a critical batch of tens of samples
    growth = {r["label"]: r for r in records["growth_vs_decay"]}
    assert growth["growth"]["steps"] < 0.6 * growth["decay"]["steps"]
    assert growth["growth"]["eval_loss"] < growth["constant"]["eval_loss"]
    assert records["lab04_nodes"] == 1 and records["job_run"] is None  # no multi-node Slurm in the grader's sandbox


def test_schedule_check_recomputes_the_schedule_from_the_run_and_the_job_check_waits_for_two_nodes(reference):
    results = {r.name: r for r in grade(LAB, reference[0])[2]}
    assert results["schedule_is_yours_and_right"].outcome == "pass"
    job = results["batch_job_ran_on_two_nodes"]  # not counted at nodes = 1: full points, and it says why
    assert job.points == job.max_points and "not run here" in job.message


def test_wrong_code_loses_the_schedule_exercise(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "schedule_is_yours_and_right": "a cosine decay counted from step 0 instead of from the end of the warm-up"})
    checks = {c.name: c for c in lab_gradings.batch(LAB).by["wrong_code"].checks}
    assert checks["schedule_is_yours_and_right"].points > 0  # the warm-up part was right: half the points


def test_student_copy_fails_at_the_first_exercise_and_grades_below_full(lab_gradings):
    error, records = lab_gradings.until_first_error(LAB)  # Run All of the released copy, as graded
    assert error.get("ename") == "NotImplementedError"
    assert "strong_rows" in records and "karp_flatt" not in records
    points, most, results = grade(LAB, records)
    assert points < 0.3 * most  # the sweeps ran; every exercise and all that follows is missing
    outcome = {r.name: r.outcome for r in results}
    assert {outcome[n] for n in ("serial_fraction_estimated", "learning_rates_scaled", "noise_scale_estimated",
                                 "schedule_warms_up_then_decays", "schedule_is_yours_and_right")} == {"missing"}


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
    (lambda r: [x.update(tail_loss=x["tail_loss"] * 0.5) for x in r["schedule_runs"]], "decay_ends_below_constant"),
    (lambda r: r["schedule_runs"].reverse() or [x.update(label={"yours": "constant", "constant": "yours"}[x["label"]])
                                                for x in r["schedule_runs"]], "schedule_is_yours_and_right"),
    (lambda r: r["critical_batch"].update(b_crit=r["critical_batch"]["b_crit"] * 1.2), "critical_batch_fit_recomputed"),
    (lambda r: r["target_study"]["best"][0].update(steps=r["target_study"]["best"][0]["steps"] - 1),
     "critical_batch_fit_recomputed"),
    (lambda r: r["growth_vs_decay"][2].update(steps=r["growth_vs_decay"][2]["steps"] // 2),
     "growth_matches_decay_in_fewer_steps"),
    (lambda r: r["schedule_preview"]["lr"].__setitem__(0, 0.0), "schedule_warms_up_then_decays"),
    (lambda r: r.update(lab04_nodes=2, job_run={"run_dir": r["schedule_runs"][0]["run_dir"], "samples_per_s": 1.0,
                                                "steps": 93}), "batch_job_ran_on_two_nodes"),
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
    job = result.records["job_run"]  # exercise 6: the reference's batch script, one rank on each node
    assert job["hosts"] == ["node1", "node2"] and job["world_size"] == 2 and job["weak_efficiency"] > 0
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


def _job_scripts(tmp_path):
    """The reference's weak_scaling.sbatch and tests/wrong/04.py's (asking for one node), as the cell writes them."""
    nb = json.loads((LAB / "lab.ipynb").read_text())
    cell = next(c["source"] for c in nb["cells"] if c["source"].startswith("%%writefile weak_scaling.sbatch"))
    anchor, code = next((a, c) for a, c in wrong_solutions(LAB) if a.startswith("#SBATCH"))
    wrong, found = replace_block(cell, anchor, code)
    assert found
    paths = {}
    for name, text in (("reference", cell), ("one_node", wrong)):
        paths[name] = tmp_path / f"{name}.sbatch"
        paths[name].write_text(text.split("\n", 1)[1])  # the file %%writefile writes: the cell less its magic line
    return paths


@pytest.mark.slurm
@pytest.mark.netns
def test_the_reference_batch_script_runs_on_two_nodes_and_one_asking_for_one_node_fails_its_check(nodes_cluster,
                                                                                                   tmp_path):
    """Exercise 6 on the 2-node namespace cluster, without the rest of the lab: each script submitted as the lab
    submits it, and the hidden check graded on the job's events."""
    from scalelab.experiments.multinode import submit_job_script
    from scalelab.grade.evidence import run_evidence
    from scalelab.run.spec import preset
    spec = preset("tiny").with_overrides({"steps": 6, "world.threads_per_worker": 1})
    outcome = {}
    for name, script in _job_scripts(tmp_path).items():
        two_nodes = spec.with_overrides({"launcher": "slurm", "world.nodes": 2, "world.workers_per_node": 1})
        row = submit_job_script(script, two_nodes, tmp_path / "runs" / name, timeout=300,
                                env={**os.environ, **nodes_cluster.env()})
        records = {"lab04_nodes": 2, "job_run": row, **run_evidence(tmp_path)}
        result = {r.name: r for r in grade(LAB, records)[2]}["batch_job_ran_on_two_nodes"]
        outcome[name] = (row["hosts"], row["world_size"], result.outcome, result.message)
    assert outcome["reference"][:3] == (["node1", "node2"], 2, "pass"), outcome
    hosts, world, result, message = outcome["one_node"]
    assert len(hosts) == 1 and world == 2 and result == "fail" and "ask Slurm for 2 nodes" in message, outcome
