"""Lab 03 public checks: the Horovod port and its averaged metric, its timeline, the same run with DDP and Horovod,
and the fusion sweep read from its timelines."""
import math

from scalelab.grade.checks import check

CONTROLLERS = {"horovodrun": "gloo", "mpirun": "mpi"}


def _ranks(r):
    """{launcher: the port's rows, rank order}."""
    return {launcher: x["ranks"] for launcher, x in r["port"].items()}


def _not_yet(rows, name):
    missing = sorted({m for row in rows for m in row.get("not_implemented", []) if m.endswith(":" + name)})
    assert not missing, f"{', '.join(missing)}: not implemented yet"


@check(points=4, needs_run=True)
def port_reproduces_data_parallel_training(r):
    """Exercise 1: under each launcher every rank ends identical to rank 0 and to the one-process reference."""
    port = _ranks(r)
    assert port and set(port) <= set(CONTROLLERS), f"the port ran under {sorted(port)}: horovodrun and mpirun expected"
    for launcher, rows in port.items():
        _not_yet(rows, "make_distributed")
        assert len(rows) == rows[0]["size"] >= 2, f"{launcher}: the port ran on fewer than 2 ranks"
        for row in rows:
            assert row["state_spread_after"] == 0.0, f"{launcher}: rank {row['rank']}'s optimizer state differs " \
                f"from rank 0's by {row['state_spread_after']:.3g} after the port: is it broadcast?"
        for row in rows:
            assert row["replica_max_diff"] == 0.0, f"{launcher}: rank {row['rank']} differs from rank 0 by " \
                                                   f"{row['replica_max_diff']:.3g}: are rank 0's parameters broadcast?"
        for row in rows:
            assert row["reference_max_diff"] < 1e-5, f"{launcher}: rank {row['rank']} is " \
                                                     f"{row['reference_max_diff']:.3g} away from the reference: are " \
                                                     "gradients averaged (DistributedOptimizer)?"


@check(points=1, needs_run=True)
def port_ran_under_both_controllers(r):
    """The port ran as a Horovod job with the Gloo controller (horovodrun) and with the MPI controller (mpirun)."""
    port = _ranks(r)
    for launcher, controller in CONTROLLERS.items():
        assert launcher in port, f"the port did not run under {launcher}"
        assert {row["controller"] for row in port[launcher]} == {controller}, \
            f"{launcher}: controllers {sorted({row['controller'] for row in port[launcher]})}, not {controller}"


@check(points=2, needs_run=True)
def metric_averaged_over_ranks(r):
    """Exercise 2: every step, every rank's averaged loss is the mean of the ranks' own losses."""
    for launcher, rows in _ranks(r).items():
        _not_yet(rows, "average_metric")
        for step in range(len(rows[0]["losses"])):
            mean = sum(row["losses"][step] for row in rows) / len(rows)
            for row in rows:
                got = (row["averaged_losses"] or [None] * (step + 1))[step]
                assert isinstance(got, float) and math.isclose(got, mean, rel_tol=1e-5), \
                    f"{launcher} step {step}: rank {row['rank']}'s averaged loss is {got!r}, the ranks' mean {mean:.6g}"


@check(points=1, needs_run=True)
def timeline_recorded(r):
    """A Horovod timeline was written, with negotiation and allreduce activity."""
    tl = r["timeline"]
    assert tl["ok"], f"no timeline: {tl.get('error')}"
    acts = tl["activities"]
    assert acts.get("ALLREDUCE", 0) > 0 and acts.get("NEGOTIATE_ALLREDUCE", 0) > 0, f"activities: {acts}"


@check(points=2, needs_run=True)
def same_run_two_ways(r):
    """DDP and Horovod trained the same RunSpec to the same loss curve."""
    runs = r["engine_runs"]
    assert [(x["strategy"], x["launcher"]) for x in runs] == [("ddp", "local"), ("horovod", "horovodrun")]
    for x in runs:
        assert x["status"] == "succeeded" and x["samples_per_s"] > 0
    ddp, hvd = runs
    diff = max(abs(a - b) for a, b in zip(ddp["loss_curve"], hvd["loss_curve"]))
    assert diff < 1e-3 and len(hvd["loss_curve"]) == len(ddp["loss_curve"]), \
        f"Horovod's loss curve differs from DDP's by {diff:.3g}"


@check(points=2, needs_run=True)
def comparison_computed(r):
    """Exercise 3: the loss difference is tiny and the throughput ratio is positive."""
    c = r["comparison"]
    assert 0 <= c["max_loss_diff"] < 1e-3, f"max_loss_diff={c['max_loss_diff']!r}"
    assert c["hvd_over_ddp"] > 0, f"hvd_over_ddp={c['hvd_over_ddp']!r}"


@check(points=2, needs_run=True)
def horovod_fusion_drawn(r):
    """The profiled Horovod engine run's timeline: gradient all-reduces fused into fewer, in coordinator cycles."""
    f = r["hvd_fusion"]
    assert f["run_dir"] == r["engine_runs"][1]["run_dir"], "draw the timeline of the Horovod engine run"
    assert f["tensors"] >= 2 and f["allreduces"] >= f["tensors"] and f["cycles"] >= 1, f"timeline counts: {f}"
    assert 1 <= f["fused_allreduces"] <= f["allreduces"], f"{f['fused_allreduces']} fused of {f['allreduces']}"
    assert abs(f["tensors_per_fused"] - f["allreduces"] / f["fused_allreduces"]) < 1e-9, "tensors per fused all-reduce"
    assert f["tensors_per_fused"] > 1, "no two tensors were ever fused: is HOROVOD_FUSION_THRESHOLD 0?"


@check(points=3, needs_run=True)
def fusion_sweep_read(r):
    """Exercise 4: every sweep point read (fused all-reduces per step, tensors each, ms per step), and the choice is
    the point with the shortest step."""
    points, choice = r["fusion_readings"], r["fusion_choice"]
    grid = {(p["threshold_mb"], p["cycle_ms"]) for p in points}
    assert len(grid) == len(points) >= 4, f"the sweep has {len(grid)} distinct points: sweep at least 2 x 2"
    for p in points:
        what = f"threshold {p['threshold_mb']} MiB, cycle {p['cycle_ms']} ms"
        assert p["steps"] >= 1 and p["tensors"] >= 2, f"{what}: {p['steps']} steps of {p['tensors']} tensors"
        assert 1 <= p["fused_per_step"] <= p["tensors"], f"{what}: {p['fused_per_step']} fused all-reduces per step"
        assert math.isclose(p["fused_per_step"] * p["tensors_per_fused"], p["tensors"], rel_tol=1e-9), \
            f"{what}: fused_per_step x tensors_per_fused is not the tensors of a step"
        assert p["steps"] >= 2 and p["step_ms"] > 0, f"{what}: step_ms {p['step_ms']!r} from {p['steps']} steps"
        if p["threshold_mb"] == 0:
            assert p["tensors_per_fused"] == 1, f"{what}: fusion is off at threshold 0, yet " \
                                                f"{p['tensors_per_fused']:.2f} tensors per fused all-reduce"
    best = min(points, key=lambda p: p["step_ms"])
    assert (choice["threshold_mb"], choice["cycle_ms"]) == (best["threshold_mb"], best["cycle_ms"]), \
        f"the choice {choice} is not the point with the shortest step (step_ms)"
