"""Lab 03 hidden checks: recompute the comparison, cross-check runs, port and timeline."""
import math

from scalelab.grade.checks import check


@check(points=2)
def comparison_recomputed(r):
    """The comparison follows from the recorded engine runs."""
    ddp, hvd = r["engine_runs"]
    c = r["comparison"]
    diff = max(abs(a - b) for a, b in zip(ddp["loss_curve"], hvd["loss_curve"]))
    assert math.isclose(c["max_loss_diff"], diff, rel_tol=1e-6, abs_tol=1e-12)
    assert math.isclose(c["hvd_over_ddp"], hvd["samples_per_s"] / ddp["samples_per_s"], rel_tol=1e-6)


@check(points=1)
def throughput_is_the_sum_of_ranks(r):
    """Each run's samples/s is the sum of its ranks'."""
    for x in r["engine_runs"]:
        assert math.isclose(x["samples_per_s"], sum(x["per_rank_samples_per_s"]), rel_tol=1e-6)


@check(points=1)
def ranks_trained_on_their_own_shards(r):
    """In the port, ranks saw different data (different losses), the same under both controllers."""
    gloo, mpi = r["port"]["gloo"], r["port"]["mpi"]
    assert gloo[0]["losses"] != gloo[1]["losses"]
    assert [x["losses"] for x in gloo] == [x["losses"] for x in mpi], "same port, same data: same losses"


@check(points=1)
def timeline_names_the_model_tensors(r):
    """The timeline's tensors are the model's gradients (allreduce.<parameter name>)."""
    names = r["timeline"]["tensors"]
    assert any(n.startswith("allreduce.") and n.endswith(".weight") for n in names), names[:5]
