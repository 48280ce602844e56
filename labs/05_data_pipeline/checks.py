"""Lab 05 public checks: what a student can self-check on the numbers the notebook recorded."""
from scalelab.grade.checks import check, partial


def _row(rows, **match):
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    assert found, f"no recorded row with {match}: run the cell that measures it"
    return found[0]


@check(points=1, needs_run=True)
def layouts_written(r):
    """All four layouts were written; files has one file per sample, shards only a few."""
    rows = {row["layout"]: row for row in r["layouts"]}
    assert set(rows) == {"files", "shards", "shards-zlib", "hdf5"}, f"layouts recorded: {sorted(rows)}"
    n = r["pfs_params"]["samples"]
    assert rows["files"]["files"] >= n, f"files layout has {rows['files']['files']} files for {n} samples"
    assert rows["shards"]["files"] < n / 10, f"shards layout has {rows['shards']['files']} files"


@check(points=1, needs_run=True)
def metadata_operations_counted(r):
    """An epoch of files opens once per sample; packed shards open a handful of files."""
    files = _row(r["formats"], layout="files", where="pfs")
    shards = _row(r["formats"], layout="shards", where="pfs")
    assert files["opens_per_sample"] >= 0.99, f"files: {files['opens_per_sample']:.2f} opens per sample"
    assert shards["opens_per_sample"] < 0.05, f"shards: {shards['opens_per_sample']:.2f} opens per sample"


@check(points=1, needs_run=True)
def shards_beat_files_on_the_file_system(r):
    """On the simulated parallel file system, packed shards are many times faster than small files."""
    files = _row(r["formats"], layout="files", where="pfs")["samples_per_s"]
    shards = _row(r["formats"], layout="shards", where="pfs")["samples_per_s"]
    assert shards > 5 * files, f"shards {shards:.0f} vs files {files:.0f} samples/s"


@check(points=2, needs_run=True)
def pfs_epoch_predicted(r):
    """Exercise 1: the predicted PFS epoch of the files layout is close to the measured one."""
    measured = _row(r["formats"], layout="files", where="pfs")["elapsed_s"]
    pred = r["predicted_pfs_files_s"]
    assert isinstance(pred, (int, float)) and pred > 0, f"predicted_pfs_files_s must be seconds > 0, got {pred!r}"
    err = abs(pred / measured - 1)
    if err <= 0.25:
        return None
    return partial(max(0.0, 1 - (err - 0.25) / 0.5), f"predicted {pred:.2f} s, measured {measured:.2f} s: "
                   "the local epoch, plus opens times the latency, plus bytes over the bandwidth")


@check(points=1, needs_run=True)
def prefetch_hides_latency(r):
    """More reader threads raise throughput and lower the stall share."""
    rows = sorted(r["prefetch_sweep"], key=lambda row: row["threads"])
    assert len(rows) >= 2 and rows[0]["threads"] == 0, "sweep 0 threads and at least one more count"
    assert rows[-1]["samples_per_s"] > 1.5 * rows[0]["samples_per_s"], "prefetching did not raise throughput"
    assert rows[-1]["stall_fraction"] < rows[0]["stall_fraction"], "prefetching did not lower the stall share"


@check(points=2, needs_run=True)
def reader_threads_sized(r):
    """Exercise 2: needed_threads is a positive count and chosen_threads one of the measured counts."""
    needed, chosen = r["needed_threads"], r["chosen_threads"]
    assert isinstance(needed, int) and needed >= 1, f"needed_threads must be an integer >= 1, got {needed!r}"
    counts = [row["threads"] for row in r["prefetch_sweep"]]
    assert chosen in counts, f"chosen_threads {chosen!r} is not one of the measured counts {counts}"


@check(points=1, needs_run=True)
def cache_serves_later_epochs(r):
    """Through the node-local cache, later epochs are fast and barely touch the shared store."""
    cached = [row for row in r["cache_epochs"] if row["where"] == "cached"]
    first, later = cached[0], cached[1:]
    assert later, "read at least two epochs through the cache"
    for row in later:
        assert row["pfs_opens"] < 0.1 * first["pfs_opens"], f"epoch {row['epoch']} still opened {row['pfs_opens']}"
        assert row["samples_per_s"] > 2 * first["samples_per_s"], f"epoch {row['epoch']} is not faster"


@check(points=2, needs_run=True)
def lru_hit_rate_computed(r):
    """Exercise 3: the LRU hit rate is a fraction, and well below what knowing the future achieves."""
    lru, future = r["lru_hit_rate"], r["reuse"]["future_hit_rate"]
    assert isinstance(lru, float) and 0 <= lru <= 1, f"lru_hit_rate must be a fraction, got {lru!r}"
    assert lru < future, f"LRU {lru:.3f} should be below the order-aware {future:.3f}"


@check(points=1, needs_run=True)
def order_aware_reads_less(r):
    """The order-aware prefetcher reads fewer samples from the store than plain read-ahead."""
    plain = _row(r["order_aware"], policy="read-ahead")
    aware = _row(r["order_aware"], policy="order-aware")
    assert aware["fetches"] < plain["fetches"], f"{aware['fetches']} reads vs {plain['fetches']}"


@check(points=2, needs_run=True)
def straggler_predicted(r):
    """Exercise 4: the predicted efficiency with one straggler matches the measured one."""
    measured, pred = r["straggler"]["straggler"]["efficiency"], r["predicted_efficiency"]
    assert isinstance(pred, float) and 0 < pred <= 1, f"predicted_efficiency must be in (0, 1], got {pred!r}"
    err = abs(pred / measured - 1)
    if err <= 0.25:
        return None
    return partial(max(0.0, 1 - (err - 0.25) / 0.5), f"predicted {pred:.2f}, measured {measured:.2f}")


@check(points=1, needs_run=True)
def engine_trains_from_both_layouts(r):
    """The engine trained from files and from shards: the same losses, shards spending less time on data."""
    rows = {row["format"]: row for row in r["engine_formats"]}
    assert set(rows) == {"files", "shards"}, f"engine runs recorded: {sorted(rows)}"
    assert rows["files"]["final_loss"] == rows["shards"]["final_loss"], "the layout changed the training result"
    assert rows["shards"]["data_fraction"] < rows["files"]["data_fraction"], "shards did not cut the data wait"
