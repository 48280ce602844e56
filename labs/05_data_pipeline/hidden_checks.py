"""Lab 05 hidden checks: the engine runs against their event files; answers recomputed from other records.

Only the two engine runs at the end write events. The layouts, the format comparison, the prefetch sweep, the
cache, the reuse analysis and the straggler are measured in the notebook's own process, so they are held against
each other only. Every check needs a real run (`needs_run`).
"""
import math

from scalelab.grade.checks import check, close, evidence, made_runs


def _run_of(r, row):
    """The evidence of an engine row: by its recorded run dir, or (a submission from before the notebook recorded
    run dirs) the run of this notebook whose events show exactly its samples/s."""
    if "run_dir" in row:
        return evidence(r, row["run_dir"])
    same = [v for v in made_runs(r).values() if isinstance(v.get("samples_per_s"), float)
            and math.isclose(v["samples_per_s"], row["samples_per_s"], rel_tol=1e-9)]
    assert same, f"no run of this notebook shows {row['samples_per_s']:.0f} samples/s ({row['format']})"
    return same[0]


@check(points=2, needs_run=True)
def engine_formats_are_the_engine_runs(r):
    """Each engine run's samples/s, data share of the step and final loss are what its event files show."""
    for x in r["engine_formats"]:
        found = _run_of(r, x)
        close(found["samples_per_s"], x["samples_per_s"], what=f"{x['format']} samples/s")
        close(found["time_fraction"]["data"], x["data_fraction"], what=f"{x['format']} data fraction")
        close(found["final_loss"], x["final_loss"], what=f"{x['format']} final loss")


def _row(rows, **match):
    return next(r for r in rows if all(r.get(k) == v for k, v in match.items()))


@check(points=2, needs_run=True)
def prediction_follows_from_the_recorded_epoch(r):
    """predicted_pfs_files_s is the local epoch + opens x latency + bytes / bandwidth of the recorded rows."""
    p, row = r["pfs_params"], _row(r["formats"], layout="files", where="pfs")
    want = _row(r["formats"], layout="files", where="local")["elapsed_s"] + row["opens"] * p["open_latency_ms"] / 1000
    if p["bandwidth_mb_s"]:
        want += row["bytes"] / (p["bandwidth_mb_s"] * 1e6)
    assert math.isclose(r["predicted_pfs_files_s"], want, rel_tol=1e-6), "does not follow from the recorded epoch"


@check(points=1, needs_run=True)
def format_rows_are_consistent(r):
    """Every format row's samples/s is its samples over its elapsed time; files opens once per sample."""
    for row in r["formats"]:
        assert math.isclose(row["samples_per_s"], row["samples"] / row["elapsed_s"], rel_tol=1e-6), row["layout"]
    for where in ("local", "pfs"):
        row = _row(r["formats"], layout="files", where=where)
        assert row["opens"] == row["samples"], f"files/{where}: {row['opens']} opens for {row['samples']} samples"


@check(points=2, needs_run=True)
def needed_threads_follows_from_the_unprefetched_run(r):
    """needed_threads is ceil(read+decode time per batch / compute time) of the 0-thread run."""
    row = _row(r["prefetch_sweep"], threads=0)
    want = math.ceil((row["read_s"] + row["decode_s"]) / row["batches"] / (r["pfs_params"]["compute_ms"] / 1000))
    assert r["needed_threads"] == want, f"needed_threads {r['needed_threads']} does not follow from the sweep"


@check(points=1, needs_run=True)
def chosen_threads_is_the_smallest_good_count(r):
    """chosen_threads is the smallest count within 90 % of the best throughput."""
    rows = {row["threads"]: row["samples_per_s"] for row in r["prefetch_sweep"]}
    best = max(rows.values())
    assert r["chosen_threads"] == min(w for w, v in rows.items() if v >= 0.9 * best), "not the smallest such count"


@check(points=2, needs_run=True)
def lru_hit_rate_matches_the_simulation(r):
    """lru_hit_rate equals the library's LRU simulation of the same order and capacity."""
    assert math.isclose(r["lru_hit_rate"], r["reuse"]["lru_hit_rate_lib"], abs_tol=1e-9), \
        f"{r['lru_hit_rate']} vs simulated {r['reuse']['lru_hit_rate_lib']}"


@check(points=2, needs_run=True)
def efficiency_follows_from_the_parameters(r):
    """predicted_efficiency is ((ranks - 1) + s) / (ranks * s)."""
    p = r["pfs_params"]
    n, s = p["ranks"], p["straggler_slowdown"]
    assert math.isclose(r["predicted_efficiency"], (n - 1 + s) / (n * s), rel_tol=1e-9), "not the formula"


@check(points=1, needs_run=True)
def straggler_rows_are_consistent(r):
    """Each straggler result's efficiency is its mean busy time over its step time, and the straggler is the
    rank that never waits."""
    for name, res in r["straggler"].items():
        busy = sum(res["rank_busy_s"]) / len(res["rank_busy_s"])
        assert math.isclose(res["efficiency"], busy / res["step_s"], rel_tol=1e-6), name
    slow = r["straggler"]["straggler"]
    assert slow["wait_s"][-1] == min(slow["wait_s"]), "the slow rank should wait least"


@check(points=1, needs_run=True)
def order_aware_counts_add_up(r):
    """Order-aware hits + misses cover every access; it never reads more than once per access."""
    aware = _row(r["order_aware"], policy="order-aware")
    assert aware["hits"] + aware["misses"] == aware["accesses"]
    assert aware["fetches"] <= aware["accesses"]
