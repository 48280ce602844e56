"""Lab 02 hidden checks: the LaunchPanel runs against their event files; the exercises recomputed from the raw
records.

Only the LaunchPanel runs write events. The allreduce timings, the gradient comparison, the bucket sweep and the
replicas come back from the SpMD pool's ranks as return values, so they are held against each other only. Every
check needs a real run (`needs_run`).
"""
import math

from scalelab.grade.checks import check, close, evidence


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
