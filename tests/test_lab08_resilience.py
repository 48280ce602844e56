"""Lab 08 (resilience) runs under papermill at its grading parameters and grades 100 %; its student copy stops at
the first exercise and grades far below; a wrong or forged record fails the check that guards it.

The grader's sandbox has no Slurm, so grading runs with use_slurm = use_nodes = False; the cluster cells (a Slurm
job preempted and requeued, a node of the 2-node namespace cluster lost) run here once more, with the setup and the
uninterrupted reference run they compare with, against the real local clusters."""
from __future__ import annotations

import nbformat
import pytest

from scalelab.course.execute import execute_notebook
from scalelab.grade.evidence import run_evidence

from labtests import (assert_check_notices, assert_stops_at_first_exercise, assert_wrong_code_loses, grade,
                     grading_parameters, lab_test_module)

# the template every lab test module shares (labtests.lab_test_module): its folder, the slow mark, the
# `reference` fixture (this run's one grading of the lab) and the full-marks-within-budget test
LAB, pytestmark, reference, test_reference_solution_grades_full_marks_within_budget = \
    lab_test_module("08_resilience")


def test_reference_numbers_tell_the_lab_story(reference):
    r, _ = reference
    assert r["crash"]["failed_rank"] == 1 and r["hang"]["failed_rank"] == 0  # a hang is blamed on the waiter
    assert r["hang"]["detect_s"] >= r["lab08_params"]["hang_timeout_s"] * 0.9 > r["crash"]["detect_s"]
    assert r["preempt"]["status"] == "preempted" and r["max_param_diff"] == 0.0
    assert r["preempt"]["preempted"] == {"0": r["preempt"]["step"], "1": r["preempt"]["step"]}  # the student's vote
    assert "my_preempt.py" in r["preempt"]["code"]  # the ranks imported the student's handler
    s = r["interval_runs"]  # real runs, the same Poisson faults in every interval: the best within 2 x Young's
    assert 0.5 - 1e-9 <= s["best_interval_s"] / s["young_s"] <= 2 + 1e-9, (s["best_interval_s"], s["young_s"])
    assert len({len(row["runs"]) for row in s["rows"]}) == 1 and len(s["rows"][0]["runs"]) == s["trials"] >= 4
    best = next(row for row in s["rows"] if row["interval_s"] == s["best_interval_s"])
    assert abs(best["fraction"] - best["predicted"]) <= 0.25  # as Daly predicts for the runs' own C and R
    assert r["elastic"]["identical"] is True and r["elastic"]["start_steps"] == [0, 10]
    assert r["forward"]["world_size"] == 1 and r["forward"]["lr_factor"] == 0.5
    assert r["recovery_speedup"] > 5  # new processes vs re-forming a group in place
    h = r["hvd_elastic"]  # Horovod elastic: 3 workers, one SIGKILLed, the other two roll back and finish
    assert h["world_sizes"] == [3, 2] and h["finished"] and h["replay_max_diff"] < 1e-4


def test_student_copy_stops_at_the_first_exercise_and_grades_far_below(lab_gradings):
    assert_stops_at_first_exercise(lab_gradings, LAB, recorded="hang", not_yet="suspect", share=0.2)


def test_wrong_code_loses_the_points_of_its_exercises(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "useful_work_is_accounted_from_the_logs": "an accounting that counts the work a fault threw away as useful",
        "handler_stopped_every_rank_after_one_step": "a handler where each rank stops on its own signal, no vote",
        "preemption_saved_and_left_cleanly": "a handler where each rank stops on its own signal, no vote",
    })


@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r.update(suspect=0), "hung_rank_found"),
    (lambda r: r["hang"].update(detect_s=0.01), "hang_is_noticed_after_the_timeout"),
    (lambda r: r.update(young_s=r["young_s"] * 1.1), "young_interval_computed"),
    (lambda r: r.update(ckpt_s=r["ckpt_s"] / 3, young_s=(2 * r["ckpt_s"] / 3 * r["lab08_params"]["mtbf_s"]) ** .5),
     "checkpoint_cost_is_the_runs"),
    (lambda r: r["interval_runs"]["rows"][1].update(fraction=r["interval_runs"]["rows"][1]["fraction"] + 0.05),
     "useful_work_is_accounted_from_the_logs"),
    (lambda r: r["interval_runs"]["rows"][1].update(runs=r["interval_runs"]["rows"][0]["runs"]),
     "useful_work_is_accounted_from_the_logs"),
    (lambda r: r["interval_runs"].update(rows=r["interval_runs"]["rows"][1:-1]), "measured_optimum_is_near_young"),
    (lambda r: r["lab08_params"].update(sweep_mtbf_s=r["lab08_params"]["sweep_mtbf_s"] * 100),
     "measured_optimum_is_near_young"),
    (lambda r: r["interval_runs"]["rows"][0].update(runs=r["interval_runs"]["rows"][0]["runs"][:1]),
     "measured_optimum_is_near_young"),
    (lambda r: r["preempt"]["preempted"].update({"1": r["preempt"]["step"] + 1}), "preemption_saved_and_left_cleanly"),
    (lambda r: r["preempt"].update(run_dir=r["elastic"]["run_dir"]), "handler_stopped_every_rank_after_one_step"),
    (lambda r: r.update(max_param_diff=1e-7), "preempted_resume_is_exact"),
    (lambda r: r["preempt"].update(step=r["preempt"]["step"] + 1, start_step=r["preempt"]["step"] + 1),
     "preempted_run_is_the_engine_run"),
    (lambda r: r["elastic"].update(run_dir=r["forward"]["run_dir"]), "recoveries_are_the_engine_runs"),
    (lambda r: r.update(recovery_speedup=r["recovery_speedup"] * 2), "recovery_compared"),
    (lambda r: r.update(redone_steps=0), "recovery_compared"),
    (lambda r: r["hang"].update(errors={"1": "RuntimeError"}), "fault_runs_named_the_right_ranks"),
    (lambda r: r["multilevel"].update(resumed_from=r["multilevel"]["resumed_from"].replace("checkpoints",
                                                                                            "node-local")),
     "multilevel_restart_reads_the_shared_tier"),
    (lambda r: r["multilevel"].update(start_step=r["multilevel"]["start_step"] - 5), "multilevel_run_is_the_engine_run"),
    (lambda r: r["hvd_elastic"].update(final_world_size=3), "horovod_elastic_goes_on_with_the_survivors"),
    (lambda r: r["hvd_elastic"].update(rolled_back_steps=0), "horovod_elastic_report_is_consistent"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)


# -- the cluster cells (use_slurm, use_nodes) on the real local Slurm and the 2-node namespace cluster -------------

CLUSTER_CELLS = ("lab08-01", "lab08-02", "lab08-08", "lab08-nodes", "lab08-19")  # params, setup, reference, ...
CLUSTER_CHECKS = ("slurm_job_requeued_and_resumed_exactly", "node_loss_restarts_read_the_right_tier",
                  "slurm_job_is_the_engine_run", "node_loss_run_is_the_engine_run")


@pytest.fixture(scope="module")
def on_clusters(slurm_cluster, nodes_cluster, tmp_path_factory):
    """The reference notebook's cluster cells, with the cells they build on, executed with use_slurm and use_nodes:
    the records, with the grader's evidence from the runs' event files."""
    out = tmp_path_factory.mktemp("lab08-clusters")
    nb = nbformat.read(LAB / "lab.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if c.get("id") in CLUSTER_CELLS]
    assert tuple(c.id for c in nb.cells) == CLUSTER_CELLS
    nbformat.write(nb, out / "lab.ipynb")
    params = {**grading_parameters(LAB), "out_dir": str(out / "runs"), "use_slurm": True, "use_nodes": True,
              "nodes_state_dir": str(nodes_cluster.state_dir)}
    result = execute_notebook(out / "lab.ipynb", params, output_path=out / "out.ipynb", cell_timeout=150,
                              total_timeout=300)
    result.raise_for_status()
    return {**result.records, **run_evidence(out)}


@pytest.mark.slurm
@pytest.mark.netns
def test_cluster_cells_requeue_a_slurm_job_and_lose_a_node_and_resume_exactly(on_clusters):
    r = on_clusters
    s = r["slurm_preempt"]
    assert s["status"] == "succeeded" and s["restarts"] == 1 and len(s["start_steps"]) == 2  # one job id, 2 runs
    assert s["start_steps"][1] == s["preempted"][0]["step"] > 0 and s["preempted"][0]["signal"] == "SIGUSR1"
    assert s["max_param_diff"] == 0.0
    n = r["node_loss"]
    assert [a["tier"] for a in n["attempts"]] == [None, "local", "shared"]
    assert [a["host"] for a in n["attempts"]] == ["node1", "node1", "node2"] and n["survivor_hosts"] == ["node2"]
    assert n["status"] == "succeeded" and n["max_param_diff"] == 0.0
    results = {res.name: res for res in grade(LAB, r)[2]}
    assert all(results[c].outcome == "pass" and not results[c].message for c in CLUSTER_CHECKS), \
        [(results[c].name, results[c].outcome, results[c].message) for c in CLUSTER_CHECKS]


@pytest.mark.slurm
@pytest.mark.netns
@pytest.mark.parametrize("forge, check_name", [
    (lambda r: r["slurm_preempt"].update(restarts=0), "slurm_job_requeued_and_resumed_exactly"),
    (lambda r: r["slurm_preempt"].update(max_param_diff=1e-7), "slurm_job_requeued_and_resumed_exactly"),
    (lambda r: r["slurm_preempt"]["start_steps"].__setitem__(1, r["slurm_preempt"]["start_steps"][1] + 1),
     "slurm_job_is_the_engine_run"),
    (lambda r: r["node_loss"]["attempts"][2].update(resumed_from=r["node_loss"]["attempts"][1]["resumed_from"]),
     "node_loss_restarts_read_the_right_tier"),
    (lambda r: r["node_loss"].update(survivor_hosts=["node1", "node2"]), "node_loss_restarts_read_the_right_tier"),
    (lambda r: r["node_loss"]["attempts"][2].update(start_step=r["node_loss"]["attempts"][1]["start_step"]),
     "node_loss_run_is_the_engine_run"),
    (lambda r: r["node_loss"].update(run_dir=r["slurm_preempt"]["run_dir"]), "node_loss_run_is_the_engine_run"),
])
def test_cluster_checks_catch_a_wrong_or_forged_record(on_clusters, forge, check_name):
    assert_check_notices(LAB, on_clusters, forge, check_name)


@pytest.mark.parametrize("section, check_name", [("use_slurm", "slurm_job_requeued_and_resumed_exactly"),
                                                 ("use_nodes", "node_loss_run_is_the_engine_run")])
def test_a_cluster_section_said_to_have_run_must_have_its_records(reference, section, check_name):
    assert_check_notices(LAB, reference[0], lambda r: r["lab08_params"].update({section: True}), check_name)
