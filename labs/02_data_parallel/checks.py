"""Lab 02 public checks: allreduce, gradients by hand vs DDP, buckets, no_sync, replicas, LaunchPanel runs."""
import math

from scalelab.grade.checks import check


@check(points=1, needs_run=True)
def allreduce_timed(r):
    """Allreduce was timed over growing message sizes and summed correctly on every rank."""
    a = r["allreduce"]
    assert a["sum_ok"], "the allreduce probe did not sum 1 + 2 + ... + N on every rank"
    sizes = [row["bytes"] for row in a["rows"]]
    assert len(sizes) >= 3 and sizes == sorted(sizes), f"time at least 3 growing sizes, got {sizes}"
    assert all(row["time_s"] > 0 for row in a["rows"])


@check(points=2, needs_run=True)
def bandwidths_computed(r):
    """Exercise 1: every row has algbw_GBps = bytes/time/1e9 and busbw_GBps = algbw x 2(N-1)/N."""
    n = r["allreduce"]["world"]
    rows = r["allreduce_bw"]
    assert len(rows) == len(r["allreduce"]["rows"]), "one bandwidth row per timed size"
    for row in rows:
        alg = row["bytes"] / row["time_s"] / 1e9
        assert math.isclose(row["algbw_GBps"], alg, rel_tol=1e-6), f"algbw for {row['bytes']} B should be {alg:.4g}"
        assert math.isclose(row["busbw_GBps"] / row["algbw_GBps"], 2 * (n - 1) / n, rel_tol=1e-6), \
            f"busbw/algbw must be 2(N-1)/N = {2 * (n - 1) / n:.3f} for N = {n}"


@check(points=3, needs_run=True)
def by_hand_matches_ddp(r):
    """Exercise 2: gradients averaged by hand equal DDP's on every rank, and so do the parameters."""
    for row in r["by_hand"]:
        assert row["grad_max_diff"] < 1e-5, f"rank {row['rank']}: gradients differ from DDP's by " \
                                            f"{row['grad_max_diff']:.3g} (sum, then divide by the world size)"
        assert row["param_max_diff"] < 1e-5, f"rank {row['rank']}: parameters differ by {row['param_max_diff']:.3g}"
        assert row["replica_max_diff"] == 0.0, f"rank {row['rank']}'s hand-averaged copy differs from rank 0's"


@check(points=1, needs_run=True)
def buckets_shrink_with_the_cap(r):
    """Larger bucket caps mean fewer allreduces per step; the bytes reduced stay the same."""
    rows = sorted(r["buckets"]["rows"], key=lambda x: x["bucket_cap_mb"])
    counts = [x["buckets"] for x in rows]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], f"bucket counts {counts}"
    assert len({x["bytes_per_step"] for x in rows}) == 1, "every cap must reduce the same gradient bytes"


@check(points=2, needs_run=True)
def ring_bytes(r):
    """Exercise 3: the bytes a rank sends per step lie between 1x and 2x the gradient bytes."""
    grad = r["buckets"]["rows"][0]["bytes_per_step"]
    v = r["ring_bytes_per_rank"]
    assert grad <= v < 2 * grad, f"ring_bytes_per_rank={v!r}; in a ring each rank sends 2(N-1)/N x {grad} bytes"


@check(points=1, needs_run=True)
def no_sync_saves_allreduces(r):
    """no_sync on all but the last micro-batch sends k times fewer allreduces for the same gradient."""
    a = r["accumulation"]
    assert a["calls_naive"] == a["k"] * a["calls_no_sync"], f"{a['calls_naive']} vs {a['k']} x {a['calls_no_sync']}"
    assert a["grad_max_diff"] < 1e-5, f"the two gradients differ by {a['grad_max_diff']:.3g}"


@check(points=1, needs_run=True)
def replicas_stay_identical_only_with_averaging(r):
    """With DDP every rank's parameters equal rank 0's exactly; without averaging they drift."""
    reps = r["replicas"]
    assert all(x["ddp"]["max_diff_from_rank0"] == 0.0 for x in reps), "DDP replicas differ"
    assert any(x["no_averaging"]["max_diff_from_rank0"] > 0 for x in reps), "unaveraged replicas did not drift"


@check(points=1, needs_run=True)
def panel_runs_launched(r):
    """The LaunchPanel ran 1 worker and N > 1 workers, with a throughput for every rank."""
    runs = r["panel_runs"]
    assert [x["workers"] for x in runs][0] == 1 and runs[-1]["workers"] > 1, "launch 1 worker, then more"
    for x in runs:
        assert len(x["per_rank"]) == x["workers"] and all(v > 0 for v in x["per_rank"]), x


@check(points=2, needs_run=True)
def efficiency_in_range(r):
    """Exercise 4: weak-scaling efficiency is a positive number no larger than about 1."""
    e = r["efficiency"]
    assert isinstance(e, (int, float)) and 0 < e <= 1.5, f"efficiency={e!r}: throughput(N) / (N x throughput(1))"


@check(points=1, needs_run=True)
def ddp_timeline_drawn(r):
    """A profiled DDP engine run on N > 1 ranks: every rank traced its bucket all-reduces (overlap in [0, 1])."""
    ranks = r["ddp_timeline"]["ranks"]
    assert len(ranks) >= 2, f"the timeline shows {len(ranks)} rank(s): profile a run on 2 or more"
    for rank, x in ranks.items():
        assert x["steps"] >= 1 and x["allreduces"] >= x["steps"] and x["comm_ms"] > 0, f"rank {rank}: {x}"
        assert x["overlap"] is not None and 0 <= x["overlap"] <= 1, f"rank {rank}: overlap {x['overlap']!r}"


@check(points=2, needs_run=True)
def bucket_traces_read(r):
    """Exercise 4: per cap, comm and hidden ms per step with exposed = comm - hidden and overlap = hidden / comm;
    the least exposed cap is the one with the smallest exposed time."""
    rows = r["bucket_overlap"]
    caps = [x["bucket_cap_mb"] for x in r["buckets"]["rows"]]
    assert [x["bucket_cap_mb"] for x in rows] == caps, f"one row per cap of the sweep, in its order: {caps}"
    for x in rows:
        what = f"cap {x['bucket_cap_mb']} MB"
        assert 0 <= x["hidden_ms"] <= x["comm_ms"] * (1 + 1e-9) and x["comm_ms"] > 0, \
            f"{what}: hidden {x['hidden_ms']!r} ms must lie between 0 and comm {x['comm_ms']!r} ms"
        assert math.isclose(x["exposed_ms"], x["comm_ms"] - x["hidden_ms"], rel_tol=1e-6, abs_tol=1e-9), \
            f"{what}: exposed_ms must be comm_ms - hidden_ms"
        assert math.isclose(x["overlap"], x["hidden_ms"] / x["comm_ms"], rel_tol=1e-6), \
            f"{what}: overlap must be hidden_ms / comm_ms"
    best = min(rows, key=lambda x: x["exposed_ms"])["bucket_cap_mb"]
    assert r["least_exposed_cap"] == best, f"least_exposed_cap={r['least_exposed_cap']!r}, but {best} MB leaves " \
                                           "the least communication exposed"


@check(points=1, needs_run=True)
def compression_runs_made(r):
    """Section 7: the five compression runs trained, each with bytes sent per step and a loss (a run your hook
    broke shows its error here)."""
    rows = {x["name"]: x for x in r["compression"]}
    for name in ("allreduce", "fp16", "powersgd", "topk_ef", "topk_no_ef"):
        assert name in rows, f"no {name} run"
        assert "error" not in rows[name], f"the {name} run failed: {rows[name]['error']}"
        assert rows[name]["wire_bytes"] > 0 and math.isfinite(rows[name]["tail_loss"])
