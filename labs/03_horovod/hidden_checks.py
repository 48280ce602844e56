"""Lab 03 hidden checks: the engine runs against their event files; the comparison, port and timeline
cross-checked.

The DDP and Horovod engine runs write events, and the profiled Horovod run its timeline, which the grader re-reads
from the working copy (no link followed) to re-derive the fusion counts. The port comes back from the Horovod ranks
as return values and the port's timeline is Horovod's own file, so those are held against each other only. Every
check needs a real run (`needs_run`).
"""
import math

from scalelab.experiments.horovod_port import fusion_summary, horovod_timeline_text
from scalelab.experiments.profiling import read_run_file
from scalelab.grade.checks import check, close, evidence
from scalelab.grade.evidence import WORKDIR


@check(points=3, needs_run=True)
def engine_runs_are_the_engine_runs(r):
    """Each engine run's strategy, world size, samples/s (global and per rank), final loss and loss curve are what
    its event files show."""
    for x in r["engine_runs"]:
        found = evidence(r, x["run_dir"])
        what = f"{x['strategy']} run"
        assert found["strategy"] == x["strategy"], f"{what}: the events are of a {found['strategy']} run"
        assert found["world_size"] == len(x["per_rank_samples_per_s"]) >= 2, f"{what}: {found['world_size']} ranks"
        close(found["samples_per_s"], x["samples_per_s"], what=f"{what} samples/s")
        for a, b in zip(found["per_rank_samples_per_s"], x["per_rank_samples_per_s"]):
            close(a, b, what=f"{what} per-rank samples/s")
        close(found["final_loss"], x["final_loss"], what=f"{what} final loss")
        assert found["loss_curve"] == x["loss_curve"], f"{what}: the loss curve is not the run's"


@check(points=2, needs_run=True)
def comparison_recomputed(r):
    """The comparison follows from the recorded engine runs."""
    ddp, hvd = r["engine_runs"]
    c = r["comparison"]
    diff = max(abs(a - b) for a, b in zip(ddp["loss_curve"], hvd["loss_curve"]))
    assert math.isclose(c["max_loss_diff"], diff, rel_tol=1e-6, abs_tol=1e-12)
    rate = {x["strategy"]: evidence(r, x["run_dir"])["samples_per_s"] for x in (ddp, hvd)}
    close(rate["horovod"] / rate["ddp"], c["hvd_over_ddp"], what="hvd_over_ddp")


@check(points=1, needs_run=True)
def throughput_is_the_sum_of_ranks(r):
    """Each run's samples/s is the sum of its ranks'."""
    for x in r["engine_runs"]:
        assert math.isclose(x["samples_per_s"], sum(x["per_rank_samples_per_s"]), rel_tol=1e-6)


@check(points=1, needs_run=True)
def ranks_trained_on_their_own_shards(r):
    """In the port, ranks saw different data (different losses), the same under both controllers."""
    gloo, mpi = r["port"]["gloo"], r["port"]["mpi"]
    assert gloo[0]["losses"] != gloo[1]["losses"]
    assert [x["losses"] for x in gloo] == [x["losses"] for x in mpi], "same port, same data: same losses"


@check(points=1, needs_run=True)
def timeline_names_the_model_tensors(r):
    """The timeline's tensors are the model's gradients (allreduce.<parameter name>)."""
    names = r["timeline"]["tensors"]
    assert any(n.startswith("allreduce.") and n.endswith(".weight") for n in names), names[:5]


@check(points=2, needs_run=True)
def horovod_fusion_is_the_timeline(r):
    """The fusion counts are what the Horovod engine run's own timeline shows."""
    f = r["hvd_fusion"]
    found, work = evidence(r, f["run_dir"]), r[WORKDIR]
    assert found["strategy"] == "horovod", f"the events are of a {found['strategy']} run"
    try:
        text = read_run_file(work, f"{f['run_dir']}/traces/horovod-timeline.json")
        again = fusion_summary(horovod_timeline_text(text))
    except Exception as e:  # missing, a link, too big, not a timeline: all the student's files
        raise AssertionError(f"the run's Horovod timeline could not be read ({type(e).__name__}: {e})") from None
    for key in ("tensors", "allreduces", "fused_allreduces", "cycles"):
        assert again[key] == f[key], f"{key}: the timeline shows {again[key]}, the record says {f[key]}"
    close(again["negotiate_ms"], f["negotiate_ms"], what="mean negotiation ms")
