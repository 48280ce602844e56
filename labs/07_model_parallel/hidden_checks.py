"""Lab 07 hidden checks: the DDP and FSDP runs against their event files; answers recomputed from other records.

The training runs (DDP, two FSDP modes, section 2b's gpt under four layouts, the dp x tp mesh) are engine runs
with event files: their world size, strategy and loss curves are held against them. The pipeline schedule runs of section 4b (the student's GPipe
and 1F1B, torch's two) are engine runs too: the schedule each ran, the submitted my_pipeline.py, the activation
bytes per stage and the bubble come from their `pipeline` events. The SPMD experiments (tensor parallel, pipeline,
resharding) write no event files and are held against each other. Every check needs a real run (`needs_run`).
"""
import hashlib
import math

from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import WORKDIR
from scalelab.grade.untrusted import UntrustedFileError, read_beneath


@check(points=0.5, needs_run=True)
def fsdp_runs_are_the_engine_runs(r):
    """Each recorded run's loss curve and final loss are its event files', with the recorded ranks and strategy."""
    workers, steps = r["lab07_params"]["workers"], r["lab07_params"]["steps"]
    want = {"ddp": "ddp", "fsdp_full": "fsdp", "fsdp_grad_op": "fsdp"}
    for name, strategy in want.items():
        run = r["fsdp_runs"][name]
        found = evidence(r, run["run_dir"], total_steps="steps", world_size="workers")
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


@check(points=0.5, needs_run=True)
def grad_op_gathers_once(r):
    """grad_op keeps forward's gathered parameters for backward: half full shard's all-gather bytes, the same
    state per rank."""
    full, grad_op = r["fsdp_runs"]["fsdp_full"], r["fsdp_runs"]["fsdp_grad_op"]
    assert grad_op["comm"]["all_gather"]["bytes"] * 2 == full["comm"]["all_gather"]["bytes"]
    assert grad_op["memory"]["state_bytes"] == full["memory"]["state_bytes"]


@check(points=0.5, needs_run=True)
def gpt_layouts_train_the_same_model(r):
    """Section 2b: the gpt's DDP, FSDP, tensor- and pipeline-parallel (1F1B, torch's interleaved) runs ran as
    recorded (strategy, the grader's gpt_steps and ranks, final loss: their event files); rank 0's losses agree
    where they are the same batch's (DDP and FSDP: its own half; TP and PP: the whole batch, DDP's two halves
    averaged), and FSDP's rank 0 holds 1/N of DDP's state."""
    runs, workers = r["gpt_runs"], r["lab07_params"]["workers"]
    assert {"ddp", "fsdp", "tp", "pp"} <= set(runs), f"layouts recorded: {sorted(runs)}"
    found = {}
    for name, row in runs.items():
        found[name] = evidence(r, row["run_dir"], total_steps="gpt_steps", world_size="workers")
        assert found[name]["strategy"] == row["strategy"], \
            f"{name}: the events show strategy {found[name]['strategy']!r}, not {row['strategy']!r}"
        close(found[name]["final_loss"], row["final_loss"], rel=1e-6, what=f"{name} final loss")
    same = lambda a, b, tol: len(a) == len(b) > 0 and all(abs(x - y) <= tol for x, y in zip(a, b))  # noqa: E731
    assert same(found["fsdp"]["loss_curve"], found["ddp"]["loss_curve"], 1e-4), "FSDP's losses are not DDP's"
    assert same(found["tp"]["loss_curve"], found["pp"]["loss_curve"], 1e-3), "TP's and PP's losses differ"
    if "pp_interleaved" in found:  # torch's interleaved 1F1B: the same pipeline's computation in another order
        assert same(found["pp_interleaved"]["loss_curve"], found["pp"]["loss_curve"], 1e-4), \
            "torch's interleaved schedule's losses are not the 1F1B pipeline's"
    assert same(found["tp"]["loss_curve"], runs["ddp"]["loss_curve"], 1e-3), \
        "TP's whole-batch losses are not DDP's ranks' averaged"
    ratio = runs["fsdp"]["state_bytes"] / runs["ddp"]["state_bytes"]
    assert math.isclose(ratio, 1 / workers, rel_tol=0.02), f"FSDP's rank 0 holds {ratio:.3f} of DDP's state"


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


def _schedule_run(r, name: str, schedule: str) -> dict:
    """The evidence of the schedule run `name` (section 4b): its events name `schedule`; a schedule of the
    student's must have run the submitted my_pipeline.py (its SHA-256 in the start event)."""
    row = r["pipeline_runs"][name]
    assert "error" not in row, f"{name}: {row['error']}"
    found = evidence(r, row["run_dir"], total_steps="pipeline_steps", world_size="workers")
    pipe = found.get("pipeline")
    assert pipe, f"{name}: the run wrote no pipeline events"
    assert pipe["schedule"] == schedule, f"{name}: the run's events show pipeline.schedule {pipe['schedule']!r}"
    if ":" in schedule:
        try:
            sha = hashlib.sha256(read_beneath(r[WORKDIR], "my_pipeline.py", 1 << 20)).hexdigest()
        except UntrustedFileError as e:
            raise AssertionError(f"my_pipeline.py could not be read from the submission ({e})") from None
        assert found["code"].get("my_pipeline.py") == sha, \
            f"{name} did not run the submitted my_pipeline.py (the run's code: {sorted(found['code'])})"
    assert found["steps"] == pipe["steps"] == r["lab07_params"]["pipeline_steps"], \
        f"{name}: {found['steps']} steps, {pipe['steps']} with pipeline events"
    return found


def _same_losses(a: dict, b: dict) -> bool:
    return len(a["loss_curve"]) == len(b["loss_curve"]) and all(
        math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a["loss_curve"], b["loss_curve"]))


@check(points=4, needs_run=True)
def my_gpipe_runs_in_the_engine(r):
    """Exercise 4b, from the run's events: the engine ran your gpipe_ops on every stage (every forward, then every
    backward, in order), holding the bytes torch's GPipe holds on each stage, to its losses."""
    mine = _schedule_run(r, "my_gpipe", "my_pipeline:gpipe_ops")
    torch_gpipe = _schedule_run(r, "torch_gpipe", "torch-gpipe")
    m = mine["pipeline"]["micro"]
    want = " ".join([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    for s, ops in enumerate(mine["pipeline"]["ops"]):
        assert ops == want, f"stage {s} ran {ops}"
    assert mine["pipeline"]["activation_peak_bytes"] == torch_gpipe["pipeline"]["activation_peak_bytes"], \
        f"activation bytes {mine['pipeline']['activation_peak_bytes']}, torch's GPipe " \
        f"{torch_gpipe['pipeline']['activation_peak_bytes']}"
    assert _same_losses(mine, torch_gpipe), "your GPipe's losses are not torch's GPipe's"


@check(points=2, needs_run=True)
def my_1f1b_runs_in_the_engine(r):
    """Exercise 4c, from the run's events: the engine ran your one_f_one_b_ops on every stage, at m >= 4, to the
    losses of torch's GPipe at the same seed (within 1e-5: the same gradients)."""
    mine = _schedule_run(r, "my_1f1b", "my_pipeline:one_f_one_b_ops")
    torch_gpipe = _schedule_run(r, "torch_gpipe", "torch-gpipe")
    assert mine["pipeline"]["micro"] >= 4, f"measured at m = {mine['pipeline']['micro']}: 4 or more, please"
    assert mine["pipeline"]["micro"] == torch_gpipe["pipeline"]["micro"], "GPipe ran at another m"
    assert _same_losses(mine, torch_gpipe), \
        f"losses {mine['loss_curve']} against torch's GPipe's {torch_gpipe['loss_curve']}"


@check(points=5, needs_run=True)
def my_1f1b_holds_fewer_activation_bytes(r):
    """Exercise 4c, from the runs' events: at the same m >= 4, every stage of your 1F1B held at most the activation
    bytes torch's GPipe held there, and stage 0 strictly fewer (GPipe holds all m micro-batches, 1F1B at most p)."""
    mine = _schedule_run(r, "my_1f1b", "my_pipeline:one_f_one_b_ops")["pipeline"]
    gpipe = _schedule_run(r, "torch_gpipe", "torch-gpipe")["pipeline"]
    assert mine["micro"] >= 4 and mine["micro"] == gpipe["micro"], f"m = {mine['micro']} and {gpipe['micro']}"
    ours, theirs = mine["activation_peak_bytes"], gpipe["activation_peak_bytes"]
    assert len(ours) == len(theirs) == mine["stages"], f"stages measured: {len(ours)}, {len(theirs)}"
    assert all(a <= b for a, b in zip(ours, theirs)), f"activation bytes per stage {ours}, GPipe {theirs}"
    assert ours[0] < theirs[0], f"stage 0 holds {ours[0]} bytes, as many as GPipe: is it still GPipe's order?"


@check(points=2, needs_run=True)
def my_1f1b_bubble_near_the_formula(r):
    """Exercise 4c, from the runs' events: your 1F1B's bubble (replayed from the stages' timelines) is at most 0.15
    above the larger of (p-1)/(m+p-1) and torch's GPipe's bubble measured beside it (uneven stages and a loaded
    machine add to both alike); a schedule that never overlaps its stages idles (p-1)/p of every step, 0.5 on 2."""
    pipe = _schedule_run(r, "my_1f1b", "my_pipeline:one_f_one_b_ops")["pipeline"]
    gpipe = _schedule_run(r, "torch_gpipe", "torch-gpipe")["pipeline"]
    p, m = pipe["stages"], pipe["micro"]
    formula = (p - 1) / (m + p - 1)
    assert pipe["bubble"] is not None and gpipe["bubble"] is not None, "no bubble was measured"
    assert pipe["bubble"] <= max(formula, gpipe["bubble"]) + 0.15, \
        f"bubble {pipe['bubble']:.3f}; formula {formula:.3f}, torch's GPipe {gpipe['bubble']:.3f}"


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
    found = evidence(r, m["run_dir"], total_steps="steps",
                     world_size=2 * param(r, "workers") if param(r, "workers") else None)
    assert found["world_size"] == 2 * workers, f"{found['world_size']} ranks ran, {2 * workers} expected"
    assert found["strategy"] == "3d", f"the events show strategy {found['strategy']!r}"
    assert found["loss_curve"] == m["loss_curve"], "the loss curve is not the run's"
    close(found["final_loss"], m["final_loss"], rel=1e-6, what="mesh final loss")
