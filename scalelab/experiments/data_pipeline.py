"""The measurements of Lab 05, as functions a notebook cell calls and a test can call too.

Every experiment reads real files through a store (`LocalStore`, or `ThrottledStore` standing in for a
parallel file system) and returns plain JSON-ready rows. Where a training step is needed, it is a fixed
`compute_s` sleep per batch: the lab is about the data path, and a sleeping consumer keeps the numbers free of
CPU contention with the readers.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..data.formats import file_count, open_dataset, stored_bytes, write_dataset
from ..data.order import OrderAwarePrefetcher, reuse_distances, sampler_order
from ..data.prefetch import Prefetcher, batch_reader, batches_of
from ..data.store import CachedStore, LocalStore, ThrottledStore
from ..data.stream import ShardStream
from ..data.synthetic import heat_fields

LAYOUTS = {"files": ("files", False), "shards": ("shards", False), "shards-zlib": ("shards", True),
           "hdf5": ("hdf5", False)}
"""The layouts Lab 05 compares: name -> (format, compressed)."""


def write_layouts(x, y, root, samples_per_shard: int = 256) -> list[dict]:
    """Write the data set in every layout under `root`; one row per layout: name, path, files, bytes."""
    rows = []
    for name, (fmt, compress) in LAYOUTS.items():
        t0 = time.perf_counter()
        path = write_dataset(x, y, Path(root) / name, fmt, samples_per_shard, compress)
        rows.append({"layout": name, "path": str(path), "files": file_count(path), "bytes": stored_bytes(path),
                     "write_s": time.perf_counter() - t0})
    return rows


def pfs_store(path, open_latency_s: float, bandwidth: float) -> ThrottledStore:
    """A store with the cost shape of a shared parallel file system."""
    return ThrottledStore(path, open_latency_s, bandwidth)


def read_epoch(dataset, order, batch: int) -> dict:
    """Read and decode `order` batch by batch (no prefetch); samples/s and what the store did."""
    before = dataset.store.stats.as_dict()
    t0 = time.perf_counter()
    n = 0
    for idx in batches_of(order, batch):
        np.stack([dataset.decode(dataset.read(i)) for i in idx])
        n += len(idx)
    elapsed = time.perf_counter() - t0
    after = dataset.store.stats.as_dict()
    opens, nbytes = after["opens"] - before["opens"], after["bytes"] - before["bytes"]
    return {"samples": n, "elapsed_s": elapsed, "samples_per_s": n / elapsed if elapsed else 0.0,
            "opens": opens, "bytes": nbytes, "opens_per_sample": opens / n if n else 0.0}


def stream_epoch(dataset, batch: int, seed: int = 0) -> dict:
    """One epoch of packed shards streamed whole (`ShardStream`); samples/s and what the store did."""
    stream = ShardStream(dataset, batch, seed=seed)
    before = dataset.store.stats.as_dict()
    t0 = time.perf_counter()
    n = sum(len(x) for x, _ in stream)
    elapsed = time.perf_counter() - t0
    after = dataset.store.stats.as_dict()
    opens, nbytes = after["opens"] - before["opens"], after["bytes"] - before["bytes"]
    return {"samples": n, "elapsed_s": elapsed, "samples_per_s": n / elapsed if elapsed else 0.0,
            "opens": opens, "bytes": nbytes, "opens_per_sample": opens / n if n else 0.0}


#: Epochs measured per layout on local storage, the fastest kept: a local epoch of a small set takes milliseconds,
#: so on a busy machine one lost time slice (~10 ms) would otherwise decide the comparison.
LOCAL_TRIES = 3


def format_comparison(layouts: list[dict], open_latency_s: float, bandwidth: float, batch: int,
                      seed: int = 0) -> list[dict]:
    """One shuffled epoch per layout, on local disk (the fastest of LOCAL_TRIES) and through the PFS stand-in
    (fresh stores: cold handles); packed shards also streamed whole (layout 'shards-stream')."""
    def store(path, where):  # a fresh one per measurement: no handle stays open from the one before
        return LocalStore(path) if where == "local" else pfs_store(path, open_latency_s, bandwidth)

    def fastest(measure, where):
        tries = [measure() for _ in range(LOCAL_TRIES if where == "local" else 1)]
        return max(tries, key=lambda r: r["samples_per_s"])

    def epoch(path, where):
        ds = open_dataset(path, store(path, where))
        return read_epoch(ds, sampler_order(len(ds), seed=seed), batch)

    rows = []
    for row in layouts:
        path = row["path"]
        for where in ("local", "pfs"):
            rows.append({"layout": row["layout"], "where": where, **fastest(lambda: epoch(path, where), where)})
            if row["layout"] == "shards":
                streamed = fastest(lambda: stream_epoch(open_dataset(path, store(path, where)), batch, seed), where)
                rows.append({"layout": "shards-stream", "where": where, **streamed})
    return rows


def prefetch_run(path, workers: int, depth: int, batch: int, compute_s: float, open_latency_s: float,
                 bandwidth: float, seed: int = 0, max_batches: int | None = None) -> dict:
    """An epoch through the PFS stand-in with `workers` prefetch threads and at most `depth` batches loaded or
    loading ahead (depth 0: no prefetch); the consumer sleeps `compute_s` per batch. Returns the trace summary
    plus the trace itself (JSON-ready)."""
    ds = open_dataset(path, pfs_store(path, open_latency_s, bandwidth))
    batches = batches_of(sampler_order(len(ds), seed=seed), batch)[:max_batches]
    read, decode = batch_reader(ds, batches)
    pipe = Prefetcher(read, len(batches), decode, workers=workers, depth=depth)
    t0 = time.perf_counter()
    for _ in pipe:
        time.sleep(compute_s)
    elapsed = time.perf_counter() - t0
    summary = pipe.trace.summary()
    return {"workers": workers, "depth": depth, "batches": len(batches), "elapsed_s": elapsed,
            "samples_per_s": len(batches) * batch / elapsed, **{k: v for k, v in summary.items() if k != "workers"},
            "trace": pipe.trace.to_dict()}


def cache_epochs(path, cache_dir, epochs: int, batch: int, open_latency_s: float, bandwidth: float,
                 seed: int = 0) -> list[dict]:
    """`epochs` shuffled epochs read straight from the PFS stand-in, then through a node-local cache in front
    of it; one row per (where, epoch) with samples/s, PFS opens and bytes."""
    rows = []
    for where in ("pfs", "cached"):
        remote = pfs_store(path, open_latency_s, bandwidth)
        store = remote if where == "pfs" else CachedStore(remote, cache_dir)
        ds = open_dataset(path, store)
        for epoch in range(epochs):
            before = remote.stats.as_dict()
            result = read_epoch(ds, sampler_order(len(ds), seed=seed, start_epoch=epoch), batch)
            after = remote.stats.as_dict()
            rows.append({"where": where, "epoch": epoch, "samples_per_s": result["samples_per_s"],
                         "elapsed_s": result["elapsed_s"], "pfs_opens": after["opens"] - before["opens"],
                         "pfs_bytes": after["bytes"] - before["bytes"]})
        if where == "cached":
            store.clear()
    return rows


def reuse_summary(order, capacity: int) -> dict:
    """Reuse distances of an access order and what caches of `capacity` samples would hit."""
    from ..data.order import reuse_distances, simulate_cache
    d = reuse_distances(order)
    again = d[d >= 0]
    return {"accesses": int(len(d)), "first_accesses": int((d < 0).sum()), "capacity": int(capacity),
            "median_distance": float(np.median(again)) if len(again) else None,
            "lru_hit_rate_lib": simulate_cache(order, capacity, "lru")["hit_rate"],
            "future_hit_rate": simulate_cache(order, capacity, "future")["hit_rate"],
            "histogram": np.histogram(again, bins=20)[0].tolist() if len(again) else [],
            "histogram_edges": np.histogram(again, bins=20)[1].tolist() if len(again) else []}


def order_aware_run(path, order, capacity: int, lookahead: int, workers: int, compute_s: float,
                    open_latency_s: float, bandwidth: float) -> dict:
    """Consume `order` sample by sample (sleeping `compute_s` each) through the order-aware prefetcher."""
    ds = open_dataset(path, pfs_store(path, open_latency_s, bandwidth))
    pf = OrderAwarePrefetcher(ds, order, capacity=capacity, lookahead=lookahead, workers=workers)
    t0 = time.perf_counter()
    for _ in pf:
        time.sleep(compute_s)
    elapsed = time.perf_counter() - t0
    return {"policy": "order-aware", "capacity": capacity, "elapsed_s": elapsed, "fetches": pf.stats["fetches"],
            "accesses": len(order), "stall_s": pf.trace.summary()["stall_s"], **pf.stats}


def readahead_run(path, order, workers: int, lookahead: int, compute_s: float, open_latency_s: float,
                  bandwidth: float) -> dict:
    """The same consumption with plain read-ahead (no cache): every access is a fetch."""
    ds = open_dataset(path, pfs_store(path, open_latency_s, bandwidth))
    order = np.asarray(order)
    pipe = Prefetcher(lambda k: ds.read(int(order[k])), len(order), ds.decode, workers=workers, depth=lookahead)
    t0 = time.perf_counter()
    for _ in pipe:
        time.sleep(compute_s)
    elapsed = time.perf_counter() - t0
    return {"policy": "read-ahead", "capacity": 0, "elapsed_s": elapsed, "fetches": len(order),
            "accesses": len(order), "stall_s": pipe.trace.summary()["stall_s"]}


__all__ = ["heat_fields", "reuse_distances", "sampler_order", "LAYOUTS", "write_layouts", "pfs_store", "read_epoch", "stream_epoch", "format_comparison",
           "prefetch_run", "cache_epochs", "reuse_summary", "order_aware_run", "readahead_run"]
