"""Lab 07 hidden checks: the DDP and FSDP runs against their event files; answers recomputed from other records.

The four training runs (DDP, two FSDP modes, the dp x tp mesh) are engine runs with event files: their world
size, strategy and loss curves are held against them. The SPMD experiments (tensor parallel, pipeline, resharding) write no event files and are held
against each other. Every check needs a real run (`needs_run`).
"""
import math

from scalelab.grade.checks import check, close, evidence


@check(points=3, needs_run=True)
def fsdp_runs_are_the_engine_runs(r):
    """Each recorded run's loss curve and final loss are its event files', with the recorded ranks and strategy."""
    workers, steps = r["lab07_params"]["workers"], r["lab07_params"]["steps"]
    want = {"ddp": "ddp", "fsdp_full": "fsdp", "fsdp_grad_op": "fsdp"}
    for name, strategy in want.items():
        run = r["fsdp_runs"][name]
        found = evidence(r, run["run_dir"])
        assert found["world_size"] == workers, f"{name}: {found['world_size']} ranks ran, {workers} recorded"
        assert found["strategy"] == strategy, f"{name}: the events show strategy {found['strategy']!r}"
        assert found["steps"] == steps and found["loss_curve"] == run["loss_curve"], \
            f"{name}: the loss curve is not the run's"
        close(found["final_loss"], run["final_loss"], rel=1e-6, what=f"{name} final loss")


@check(points=2, needs_run=True)
def sharding_halves_state_and_triples_collective_bytes(r):
    """With 2 ranks, full shard holds half of DDP's state (within 2 %) and its collectives carry 3x the bytes
    (all-gather twice, reduce-scatter once, against one all-reduce)."""
    a, workers = r["memory_answers"], r["lab07_params"]["workers"]
    assert math.isclose(a["fsdp_over_ddp"], 1 / workers, rel_tol=0.02), f"fsdp_over_ddp {a['fsdp_over_ddp']!r}"
    assert math.isclose(a["traffic_ratio"], 3.0, rel_tol=0.01), f"traffic_ratio {a['traffic_ratio']!r}"


@check(points=2, needs_run=True)
def grad_op_gathers_once(r):
    """grad_op keeps forward's gathered parameters for backward: half full shard's all-gather bytes, the same
    state per rank."""
    full, grad_op = r["fsdp_runs"]["fsdp_full"], r["fsdp_runs"]["fsdp_grad_op"]
    assert grad_op["comm"]["all_gather"]["bytes"] * 2 == full["comm"]["all_gather"]["bytes"]
    assert grad_op["memory"]["state_bytes"] == full["memory"]["state_bytes"]


@check(points=2, needs_run=True)
def pipeline_records_agree(r):
    """Every schedule was measured at every recorded micro-batch count; m = 1 leaves each of 2 stages idle half
    the step; GPipe holds all m micro-batches."""
    rows, micro = r["pipeline"], r["lab07_params"]["micro_batches"]
    assert set(rows) == {f"{s}/{m}" for s in ("gpipe", "1f1b") for m in micro}, sorted(rows)
    for key, row in rows.items():
        if row["micro"] == 1 and row["stages"] == 2:
            assert math.isclose(row["measured_bubble"], 0.5, abs_tol=1e-6), f"{key}: {row['measured_bubble']}"
        if row["schedule"] == "gpipe":
            assert row["peak_in_flight"][0] == row["micro"], f"{key}: GPipe held {row['peak_in_flight']}"


@check(points=1, needs_run=True)
def seventy_b_is_two_nodes(r):
    """14 GPUs, 2 nodes: 1.12 TB of state over 80 GB devices."""
    assert r["sizing"]["gpus_for_70b"] == 14 and r["sizing"]["nodes_for_70b"] == 2


@check(points=1, needs_run=True)
def planner_predicts_the_measured_state(r):
    """The planner's fp32 ZeRO-3 estimate is the FSDP run's measured state per rank."""
    measured = r["fsdp_runs"]["fsdp_full"]["memory"]["state_bytes"]
    assert math.isclose(r["planner"]["fp32_zero3_bytes"], measured, rel_tol=0.02), \
        f"planner {r['planner']['fp32_zero3_bytes']!r}, measured {measured}"


@check(points=2, needs_run=True)
def mesh_run_is_the_engine_run(r):
    """The dp x tp run's loss curve is its event files', on 2 x workers ranks with strategy 3d."""
    m, workers = r["mesh_run"], r["lab07_params"]["workers"]
    found = evidence(r, m["run_dir"])
    assert found["world_size"] == 2 * workers, f"{found['world_size']} ranks ran, {2 * workers} expected"
    assert found["strategy"] == "3d", f"the events show strategy {found['strategy']!r}"
    assert found["loss_curve"] == m["loss_curve"], "the loss curve is not the run's"
    close(found["final_loss"], m["final_loss"], rel=1e-6, what="mesh final loss")
