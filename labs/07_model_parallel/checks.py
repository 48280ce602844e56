"""Lab 07 public checks: memory arithmetic, FSDP vs DDP, tensor parallelism by hand, pipeline bubble, your pipeline
schedules in the engine, resharding, a 3D layout and a dp x tp mesh in the engine."""
import math

from scalelab.grade.checks import check


def _zero(P, N, stage):
    params, grads, adam = 4 * P, 4 * P, 8 * P
    return (params / N if stage >= 3 else params) + (grads / N if stage >= 2 else grads) + \
        (adam / N if stage >= 1 else adam)


@check(points=2, needs_run=True)
def state_arithmetic_written(r):
    """Exercise 1: state bytes per rank for ZeRO stages 0-3 follow the 4P + 4P + 8P rule and its sharding."""
    t = r["my_state_table"]
    want = [_zero(t["P"], t["N"], s) for s in range(4)]
    for stage, (got, exp) in enumerate(zip(t["bytes"], want)):
        assert math.isclose(got, exp, rel_tol=1e-9), f"ZeRO-{stage}: {got!r} bytes, expected {exp:.6g}"


@check(points=2, needs_run=True)
def fsdp_trains_like_ddp(r):
    """FSDP (both shardings) follows DDP's loss curve step for step."""
    runs = r["fsdp_runs"]
    assert set(runs) >= {"ddp", "fsdp_full", "fsdp_grad_op"}, f"runs recorded: {sorted(runs)}"
    ddp = runs["ddp"]["loss_curve"]
    for name in ("fsdp_full", "fsdp_grad_op"):
        curve = runs[name]["loss_curve"]
        assert len(curve) == len(ddp) and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
                                              for a, b in zip(curve, ddp)), f"{name}'s losses differ from DDP's"


@check(points=2, needs_run=True)
def fsdp_halves_the_state(r):
    """Full shard holds at most 0.6 of DDP's state per rank; the all-gathers and reduce-scatters were counted."""
    runs = r["fsdp_runs"]
    ddp, full = runs["ddp"], runs["fsdp_full"]
    assert full["memory"]["state_bytes"] <= 0.6 * ddp["memory"]["state_bytes"], "full shard did not cut the state"
    assert set(full["comm"]) == {"all_gather", "reduce_scatter"} and set(ddp["comm"]) == {"all_reduce"}, \
        f"collectives: FSDP {sorted(full['comm'])}, DDP {sorted(ddp['comm'])}"


@check(points=3, needs_run=True)
def measured_against_the_arithmetic(r):
    """Exercise 2: P from DDP's parameter bytes, the ZeRO-3 prediction (within 2 % of the measurement), the
    measured state ratio and the traffic ratio."""
    a, runs = r["memory_answers"], r["fsdp_runs"]
    ddp, full = runs["ddp"], runs["fsdp_full"]
    assert a["P"] == ddp["memory"]["param_bytes"] // 4, f"P {a['P']!r}: fp32 parameters are 4 bytes each"
    assert math.isclose(a["predicted_fsdp_bytes"], _zero(a["P"], r["lab07_params"]["workers"], 3), rel_tol=1e-9)
    assert math.isclose(a["predicted_fsdp_bytes"], full["memory"]["state_bytes"], rel_tol=0.02), \
        "the ZeRO-3 prediction is more than 2 % off the measured state"
    assert math.isclose(a["fsdp_over_ddp"], full["memory"]["state_bytes"] / ddp["memory"]["state_bytes"],
                        rel_tol=1e-9), "fsdp_over_ddp is FSDP full shard's state_bytes over DDP's"
    moved = sum(c["bytes"] for c in full["comm"].values()) / sum(c["bytes"] for c in ddp["comm"].values())
    assert math.isclose(a["traffic_ratio"], moved, rel_tol=1e-9), f"traffic_ratio should be {moved:.3f}"


@check(points=3, needs_run=True)
def tensor_parallel_by_hand_is_exact(r):
    """Exercise 3: the column/row-parallel MLP built on your operators equals the serial layers, outputs and all
    gradients, on every rank, with two all-reduces."""
    for row in r["tensor_parallel"]:
        assert row["out_diff"] < 1e-4, f"rank {row['rank']}: outputs differ by {row['out_diff']:.3g} (forward of g)"
        assert row["input_grad_diff"] < 1e-4, f"rank {row['rank']}: dL/dx differs by {row['input_grad_diff']:.3g}" \
                                              " (backward of f)"
        assert max(row["grad_diffs"].values()) < 1e-4, f"rank {row['rank']}: weight gradients differ"
        assert row["comm"].get("all_reduce", {}).get("calls") == 2, f"rank {row['rank']}: {row['comm']}"


@check(points=2, needs_run=True)
def bubble_formula_written(r):
    """Exercise 4: each measurement's formula is (p - 1) / (m + p - 1)."""
    for key, row in r["pipeline"].items():
        want = (row["stages"] - 1) / (row["micro"] + row["stages"] - 1)
        assert math.isclose(row["formula"], want, rel_tol=1e-9), f"{key}: formula {row['formula']!r}, want {want:.4f}"


@check(points=2, needs_run=True)
def bubble_shrinks_and_1f1b_holds_less(r):
    """The measured bubble falls from the fewest to the most micro-batches for both schedules; with several
    micro-batches 1F1B holds fewer at once than GPipe; the pipeline's losses equal the unsplit batch's."""
    rows = r["pipeline"]
    for schedule in ("gpipe", "1f1b"):
        mine = sorted((row for row in rows.values() if row["schedule"] == schedule), key=lambda x: x["micro"])
        assert len(mine) >= 2, f"measure {schedule} at two or more micro-batch counts"
        assert mine[-1]["measured_bubble"] < mine[0]["measured_bubble"] - 0.05, \
            f"{schedule}: bubble {mine[0]['measured_bubble']:.2f} -> {mine[-1]['measured_bubble']:.2f}"
    most = max(row["micro"] for row in rows.values())
    if most > 1:
        assert max(rows[f"1f1b/{most}"]["peak_in_flight"]) < max(rows[f"gpipe/{most}"]["peak_in_flight"])
    for key, row in rows.items():
        assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(row["losses"], row["serial_losses"])), key


@check(points=1, needs_run=True)
def my_schedules_ran(r):
    """Exercises 4b and 4c: the engine ran your GPipe and your 1F1B to the end, at m >= 4 micro-batches, and measured
    each stage's activation bytes."""
    runs = r["pipeline_runs"]
    for name in ("my_gpipe", "my_1f1b"):
        row = runs.get(name)
        assert row is not None, f"{name} was not run"
        assert "error" not in row, f"{name}: {row['error']}"
        assert row["micro"] >= 4, f"{name} ran at m = {row['micro']}: measure at 4 or more micro-batches"
        assert len(row["activation_peak_bytes"]) == row["stages"] >= 2, f"{name}: {row['activation_peak_bytes']}"


@check(points=1, needs_run=True)
def torch_schedules_beside_yours(r):
    """torch.distributed.pipelining's GPipe and 1F1B ran on the same stages to the same losses; its 1F1B holds
    fewer activation bytes on stage 0 than its GPipe."""
    runs = r["pipeline_runs"]
    gpipe, one = runs["torch_gpipe"], runs["torch_1f1b"]
    assert "error" not in gpipe and "error" not in one, f"{gpipe.get('error') or one.get('error')}"
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(one["loss_curve"], gpipe["loss_curve"])), \
        "torch's 1F1B and GPipe trained to different losses"
    assert one["activation_peak_bytes"][0] < gpipe["activation_peak_bytes"][0], \
        f"stage 0: 1F1B {one['activation_peak_bytes'][0]} bytes, GPipe {gpipe['activation_peak_bytes'][0]}"


@check(points=2, needs_run=True)
def checkpoint_reshards_exactly(r):
    """The sharded checkpoint saved on 2 ranks came back exactly on 1 and, saved again, on 2."""
    s = r["reshard"]
    assert s["worlds"] == [2, 1, 2], f"worlds {s['worlds']}"
    assert s["one_equal"] and s["two_equal"], "a restored state differs from the saved one"


@check(points=2, needs_run=True)
def seventy_b_sized(r):
    """Exercise 5: GPUs of 80 GB for 70e9 parameters at 16 bytes each under ZeRO-3, and 8-GPU nodes."""
    s = r["sizing"]
    assert s["gpus_for_70b"] == math.ceil(70e9 * 16 / 80e9), f"gpus_for_70b {s['gpus_for_70b']!r}"
    assert s["nodes_for_70b"] == math.ceil(s["gpus_for_70b"] / 8), f"nodes_for_70b {s['nodes_for_70b']!r}"


@check(points=2, needs_run=True)
def a_feasible_3d_layout(r):
    """Exercise 6: the chosen dp x tp x pp uses all 64 GPUs, fits, and keeps tensor-parallel groups in a node."""
    p = r["planner"]["layout"]
    assert p["world"] == 64, f"dp x tp x pp = {p['world']}, the cluster has 64 GPUs"
    assert p["links"]["tp"] == "intra", "tensor-parallel groups cross nodes: keep tp within a node's 8 GPUs"
    assert p["feasible"], f"the layout does not work: {'; '.join(p['problems'])}"


@check(points=2, needs_run=True)
def a_3d_mesh_trains_like_ddp(r):
    """Exercise 7: the dp x tp mesh follows DDP's losses, each rank holds at most 0.6 of DDP's state, and the
    prediction (16 bytes per parameter over tp, no ZeRO) is within 2 % of the measurement."""
    m, ddp = r["mesh_run"], r["fsdp_runs"]["ddp"]
    assert len(m["loss_curve"]) == len(ddp["loss_curve"]) and all(
        math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(m["loss_curve"], ddp["loss_curve"])), \
        "the mesh's losses differ from DDP's"
    assert len(m["state_bytes"]) == 2 * r["lab07_params"]["workers"], f"{len(m['state_bytes'])} ranks reported"
    assert max(m["state_bytes"]) <= 0.6 * ddp["memory"]["state_bytes"], "the mesh's ranks did not split the state"
    want = 16 * (ddp["memory"]["param_bytes"] // 4) / m["tp"]
    assert math.isclose(m["predicted_state_bytes"], want, rel_tol=1e-9), \
        f"mesh_state_bytes {m['predicted_state_bytes']!r}: 16 bytes per parameter, over tp, expected {want:.6g}"
    assert math.isclose(m["predicted_state_bytes"], m["state_bytes"][0], rel_tol=0.02), \
        "the prediction is more than 2 % off the measured state"
