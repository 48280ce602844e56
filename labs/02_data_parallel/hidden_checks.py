"""Lab 02 hidden checks: recompute the exercises from the raw records and cross-check the runs."""
import math

from scalelab.grade.checks import check


@check(points=2)
def busbw_recomputed(r):
    """busbw of every row follows from the recorded times and world size."""
    n = r["allreduce"]["world"]
    for raw, row in zip(r["allreduce"]["rows"], r["allreduce_bw"]):
        want = raw["bytes"] / raw["time_s"] / 1e9 * 2 * (n - 1) / n
        assert row["bytes"] == raw["bytes"] and math.isclose(row["busbw_GBps"], want, rel_tol=1e-6)


@check(points=1)
def large_messages_reach_higher_bandwidth(r):
    """The largest message moves more bytes per second than the smallest (latency is amortised)."""
    rows = r["allreduce"]["rows"]
    small, large = rows[0], rows[-1]
    assert large["bytes"] / large["time_s"] > small["bytes"] / small["time_s"]


@check(points=1)
def ranks_trained_on_different_shards(r):
    """In the by-hand comparison, ranks saw different data (different losses) but share one world."""
    rows = r["by_hand"]
    assert len(rows) == rows[0]["world"] >= 2 and [x["rank"] for x in rows] == list(range(len(rows)))
    assert rows[0]["losses"] != rows[1]["losses"], "every rank reported the same losses"


@check(points=2)
def ring_bytes_recomputed(r):
    """ring_bytes_per_rank = 2(N-1)/N x gradient bytes per step."""
    b = r["buckets"]
    want = 2 * (b["world"] - 1) / b["world"] * b["rows"][0]["bytes_per_step"]
    assert math.isclose(r["ring_bytes_per_rank"], want, rel_tol=1e-9)


@check(points=1)
def gradient_bytes_match_the_model(r):
    """DDP reduces 4 bytes (fp32) per parameter per step."""
    b = r["buckets"]
    assert all(row["bytes_per_step"] == 4 * b["parameters"] for row in b["rows"])


@check(points=2)
def efficiency_recomputed(r):
    """efficiency = samples/s(N) / (N x samples/s(1)) of the recorded panel runs."""
    one, many = r["panel_runs"][0], r["panel_runs"][-1]
    want = many["samples_per_s"] / (many["workers"] * one["samples_per_s"])
    assert math.isclose(r["efficiency"], want, rel_tol=1e-6)


@check(points=1)
def global_throughput_is_the_sum_of_ranks(r):
    """Each run's samples/s is the sum of its ranks' samples/s."""
    for x in r["panel_runs"]:
        assert math.isclose(x["samples_per_s"], sum(x["per_rank"]), rel_tol=1e-6)
