"""Lab 03 public checks: the Horovod port, its timeline, and the same run with DDP and Horovod."""
from scalelab.grade.checks import check


@check(points=4, needs_run=True)
def port_reproduces_data_parallel_training(r):
    """Exercise 1: under both controllers every rank ends identical to rank 0 and to the one-process reference."""
    port = r["port"]
    assert set(port) == {"gloo", "mpi"}, f"the port must run under horovodrun (gloo) and mpirun (mpi), got {sorted(port)}"
    for controller, rows in port.items():
        assert len(rows) == rows[0]["size"] >= 2, f"{controller}: the port ran on fewer than 2 ranks"
        for row in rows:
            assert row["replica_max_diff"] == 0.0, f"{controller}: rank {row['rank']} differs from rank 0 by " \
                                                   f"{row['replica_max_diff']:.3g}: are rank 0's parameters broadcast?"
            assert row["reference_max_diff"] < 1e-5, f"{controller}: rank {row['rank']} is " \
                                                     f"{row['reference_max_diff']:.3g} away from the reference: are " \
                                                     "gradients averaged (DistributedOptimizer)?"


@check(points=1, needs_run=True)
def port_ran_under_both_controllers(r):
    """The port ran as a Horovod job with the Gloo controller and with the MPI controller."""
    assert {row["controller"] for row in r["port"]["gloo"]} == {"gloo"}
    assert {row["controller"] for row in r["port"]["mpi"]} == {"mpi"}


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
    """Exercise 2: the loss difference is tiny and the throughput ratio is positive."""
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
