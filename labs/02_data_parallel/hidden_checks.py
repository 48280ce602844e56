"""Lab 02 hidden checks: the LaunchPanel runs against their event files; the exercises recomputed from the raw
records.

Only the LaunchPanel runs and the profiled DDP run write events. The allreduce timings, the gradient comparison,
the bucket sweep and the replicas come back from the SpMD pool's ranks as return values, so they are held against
each other only; the bucket sweep's traces and the DDP run's traces are files in the working copy, which the grader
re-reads (no link followed) to re-derive the exercise's numbers and the timeline's. Every check needs a real run
(`needs_run`).
"""
import json
import math

from scalelab.experiments.profiling import merge, overlap_seconds, read_run_file, trace_intervals, trace_summary
from scalelab.grade.checks import check, close, evidence
from scalelab.grade.evidence import RUNS, WORKDIR


def _intervals(r, path: str) -> dict:
    """A trace the notebook's run wrote, read by the grader from the working copy."""
    work = r[WORKDIR]
    try:
        return trace_intervals(json.loads(read_run_file(work, path)))
    except Exception as e:  # missing, a link, too big, not a trace: all the student's files
        raise AssertionError(f"the trace {path} could not be read ({type(e).__name__}: {e})") from None


@check(points=2, needs_run=True)
def busbw_recomputed(r):
    """busbw of every row follows from the recorded times and world size."""
    n = r["allreduce"]["world"]
    for raw, row in zip(r["allreduce"]["rows"], r["allreduce_bw"]):
        want = raw["bytes"] / raw["time_s"] / 1e9 * 2 * (n - 1) / n
        assert row["bytes"] == raw["bytes"] and math.isclose(row["busbw_GBps"], want, rel_tol=1e-6)


@check(points=1, needs_run=True)
def large_messages_reach_higher_bandwidth(r):
    """The largest message moves more bytes per second than the smallest (latency is amortised)."""
    rows = r["allreduce"]["rows"]
    small, large = rows[0], rows[-1]
    assert large["bytes"] / large["time_s"] > small["bytes"] / small["time_s"]


@check(points=1, needs_run=True)
def ranks_trained_on_different_shards(r):
    """In the by-hand comparison, ranks saw different data (different losses) but share one world."""
    rows = r["by_hand"]
    assert len(rows) == rows[0]["world"] >= 2 and [x["rank"] for x in rows] == list(range(len(rows)))
    assert rows[0]["losses"] != rows[1]["losses"], "every rank reported the same losses"


@check(points=2, needs_run=True)
def ring_bytes_recomputed(r):
    """ring_bytes_per_rank = 2(N-1)/N x gradient bytes per step."""
    b = r["buckets"]
    want = 2 * (b["world"] - 1) / b["world"] * b["rows"][0]["bytes_per_step"]
    assert math.isclose(r["ring_bytes_per_rank"], want, rel_tol=1e-9)


@check(points=1, needs_run=True)
def gradient_bytes_match_the_model(r):
    """DDP reduces 4 bytes (fp32) per parameter per step."""
    b = r["buckets"]
    assert all(row["bytes_per_step"] == 4 * b["parameters"] for row in b["rows"])


@check(points=3, needs_run=True)
def panel_runs_are_the_engine_runs(r):
    """Each LaunchPanel run's world size, samples/s (global and per rank), final loss and loss curve are what its
    event files show."""
    for x in r["panel_runs"]:
        found = evidence(r, x["run_dir"])
        assert found["world_size"] == x["workers"], f"{x['workers']} workers recorded, {found['world_size']} ran"
        close(found["samples_per_s"], x["samples_per_s"], what=f"{x['workers']}-worker samples/s")
        assert len(found["per_rank_samples_per_s"]) == len(x["per_rank"]), "one samples/s per rank"
        for a, b in zip(found["per_rank_samples_per_s"], x["per_rank"]):
            close(a, b, what=f"{x['workers']}-worker per-rank samples/s")
        close(found["final_loss"], x["final_loss"], what=f"{x['workers']}-worker final loss")
        assert found["loss_curve"] == x["loss_curve"], f"the {x['workers']}-worker loss curve is not the run's"


@check(points=2, needs_run=True)
def efficiency_recomputed(r):
    """efficiency = samples/s(N) / (N x samples/s(1)) of the panel runs, as their event files show them."""
    one, many = r["panel_runs"][0], r["panel_runs"][-1]
    rate_1, rate_n = (evidence(r, x["run_dir"])["samples_per_s"] for x in (one, many))
    close(rate_n / (many["workers"] * rate_1), r["efficiency"], what="efficiency")


@check(points=1, needs_run=True)
def global_throughput_is_the_sum_of_ranks(r):
    """Each run's samples/s is the sum of its ranks' samples/s."""
    for x in r["panel_runs"]:
        assert math.isclose(x["samples_per_s"], sum(x["per_rank"]), rel_tol=1e-6)


@check(points=2, needs_run=True)
def ddp_timeline_is_the_engine_run(r):
    """The timeline's run is a DDP engine run (its events), and every rank's all-reduces, comm ms and overlap are
    what its trace shows."""
    t = r["ddp_timeline"]
    found = evidence(r, t["run_dir"])
    assert found["strategy"] == "ddp" and found["world_size"] == len(t["ranks"]), \
        f"the events are of a {found['world_size']}-rank {found['strategy']} run"
    for rank, x in t["ranks"].items():
        s = trace_summary(_intervals(r, f"{t['run_dir']}/traces/rank-{int(rank)}.json"))
        assert s["collectives"].get("all_reduce", 0) == x["allreduces"], f"rank {rank}: all-reduces"
        close(1e3 * s["comm_s"] / s["steps"], x["comm_ms"], what=f"rank {rank} comm ms")
        close(s["overlap"], x["overlap"], what=f"rank {rank} overlap")


@check(points=3, needs_run=True)
def bucket_overlap_is_the_traces(r):
    """Exercise 4 re-derived from the sweep's traces: all-reduces (= buckets x traced steps), comm and hidden ms."""
    assert r[RUNS] is not None  # the traces count once the notebook's engine runs do
    rows = {x["bucket_cap_mb"]: x for x in r["buckets"]["rows"]}
    for x in r["bucket_overlap"]:
        row = rows[x["bucket_cap_mb"]]
        iv = _intervals(r, row["trace"])
        comm, steps = merge((a, b) for _, a, b, _ in iv["comm"]), len(iv["steps"])
        assert len(iv["comm"]) == x["allreduces"] == row["buckets"] * steps, \
            f"cap {x['bucket_cap_mb']} MB: {len(iv['comm'])} all-reduces traced over {steps} steps"
        close(1e3 * sum(b - a for a, b in comm) / steps, x["comm_ms"], what=f"cap {x['bucket_cap_mb']} comm ms")
        close(1e3 * overlap_seconds(comm, iv["compute"]) / steps, x["hidden_ms"],
              what=f"cap {x['bucket_cap_mb']} hidden ms")
