"""Lab 08 hidden checks: the engine runs against their event files; answers recomputed from other records.

The reference, preempted, elastic and forward-recovery runs are held against their event files (checkpoints and
their cost, launches and resume steps, steps reached); the interval sweep is recomputed from the recorded inputs.
The cluster sections (use_slurm, use_nodes) count only where they ran: the grader's sandbox has no cluster.
"""
from scalelab.experiments.resilience import interval_sweep
from scalelab.grade.checks import check, close, evidence, partial


@check(points=2, needs_run=True)
def checkpoint_cost_is_the_runs(r):
    """ckpt_s is the reference run's blocked time per checkpoint, as its events show."""
    found = evidence(r, r["reference_run_dir"])
    assert found["checkpoints"] > 0, "the reference run's events show no checkpoint"
    assert found["world_size"] == r["lab08_params"]["workers"], "the reference ran another number of ranks"
    close(found["blocked_s"] / found["checkpoints"], r["ckpt_s"], rel=1e-4, what="checkpoint cost")  # summed in another order


@check(points=2, needs_run=True)
def preempted_run_is_the_engine_run(r):
    """The preempted run's events show two launches, the second from the recorded emergency step, to the end."""
    p = r["preempt"]
    found = evidence(r, p["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == p["step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] and found["loss_curve"] == p["resumed_losses"]


@check(points=2, needs_run=True)
def recoveries_are_the_engine_runs(r):
    """The elastic run's events show the restart from the recorded step; the forward run reached the last step."""
    e, f, steps = r["elastic"], r["forward"], r["lab08_params"]["steps"]
    found = evidence(r, e["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == e["start_steps"][-1], \
        f"elastic events: {found['launches']} launches from step {found['start_step']}"
    assert found["steps"] == steps
    found = evidence(r, f["run_dir"])
    assert found["launches"] == 1 and found["steps"] == steps, "the forward run restarted or stopped early"
    close(found["final_loss"], f["final_loss"], rel=1e-9, what="forward final loss")


@check(points=1, needs_run=True)
def sweep_follows_from_its_inputs(r):
    """The recorded sweep is what the simulation gives for the recorded inputs."""
    s, m = r["sweep"], r["lab08_params"]["mtbf_s"]
    again = interval_sweep(s["work_s"], r["ckpt_s"], s["restart_s"], m, [p["interval_s"] for p in s["points"]],
                           trials=s["trials"])
    for mine, theirs in zip(s["points"], again):
        close(theirs["waste_s"], mine["waste_s"], rel=1e-9, what=f"waste at {mine['interval_s']:.3g} s")
    assert s["best_interval_s"] == min(again, key=lambda p: p["waste_s"])["interval_s"]


@check(points=1, needs_run=True)
def fault_runs_named_the_right_ranks(r):
    """The crash and hang records agree with the fault the runs injected, and the hang's errors came from rank 0."""
    assert r["crash"]["fault_rank"] == 1 and r["hang"]["fault_rank"] == 1
    assert set(r["hang"]["errors"]) == {"0"}, f"errors by rank: {r['hang']['errors']}"


@check(points=1, needs_run=True)
def multilevel_run_is_the_engine_run(r):
    """The multilevel run's events show two launches, the second from the recorded step, to its last step."""
    m = r["multilevel"]
    found = evidence(r, m["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == m["start_step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] + 2 * r["lab08_params"]["every"]


@check(points=1, needs_run=True)
def slurm_job_is_the_engine_run(r):
    """With use_slurm: the job's events show two launches, the second from the preempted step, to the last step."""
    if not r["lab08_params"].get("use_slurm", False):
        return partial(1, "not run here (use_slurm = False)")
    s = r["slurm_preempt"]
    found = evidence(r, s["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == s["start_steps"][-1] == s["preempted"][0]["step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] and found["world_size"] == r["lab08_params"]["workers"]


@check(points=1, needs_run=True)
def node_loss_run_is_the_engine_run(r):
    """With use_nodes: the run's events show three launches, the last from the recorded shared-tier step, to the
    last step, with the lab's world size."""
    if not r["lab08_params"].get("use_nodes", False):
        return partial(1, "not run here (use_nodes = False)")
    n = r["node_loss"]
    found = evidence(r, n["run_dir"])
    assert found["launches"] == 3 and found["start_step"] == n["attempts"][-1]["start_step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] and found["world_size"] == r["lab08_params"]["workers"]


@check(points=1, needs_run=True)
def horovod_elastic_report_is_consistent(r):
    """The elastic run's report adds up: the rolled-back steps, the lost worker, detection before recovery."""
    h = r["hvd_elastic"]
    assert h["rolled_back_steps"] == h["failed_step"] - h["resumed_step"], "rolled_back_steps"
    assert h["lost"] == [1] and h["resets"] >= 1, f"lost {h['lost']}: the fault was on worker 1"
    assert 0 <= h["detect_s"] <= h["recovery_s"], f"detected {h['detect_s']} s, training again {h['recovery_s']} s"
    assert h["fault_step"] is not None and h["resumed_step"] < h["fault_step"] + 1
