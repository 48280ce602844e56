"""Lab 05's read / decode balance (Argonne's Lobster): a loader's reads wait on storage, its decoding and augmenting
is CPU work; with a fixed number of workers, the split between the two stages sets the throughput.

    make_dataset(out, samples=128, size=128, channels=3, name="images")   # (experiments.spread)
    res = balance_threads(out, total=4)    # rows per (read threads, decode workers); best, predicted
    balance_figure(res)

The read threads fetch from the shared file system (a `ThrottledStore`: one round trip per request; a waiting read
holds no core and no GIL), the decode workers inflate, crop, resample, flip and normalize (`decode_augment`), at
most two samples per worker in flight, as in a loader. Lobster balances threads of C++; in Python, decode threads
share one GIL (numpy on small images holds it much of the time), so the decode workers are processes by default, as
PyTorch's DataLoader workers are (`decoders="threads"` measures the threads instead). A decode worker needs a free
core: on a busy machine the measurement says what the cores left give.
"""
from __future__ import annotations

import queue
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from ..data.spread import GlobalIndex, SpreadReader
from ..machine import usable_cpus
from ..data.store import ThrottledStore


def decode_augment(raw: bytes, meta: dict, rng, scale=(0.35, 1.0)) -> np.ndarray:
    """One sample's CPU work, as an image loader's: inflate, 8-bit to float, a random resized crop (a random box of
    `scale` of the area, aspect 3:4 to 4:3, resampled bilinearly back to full size), a random flip, normalize.
    Returns float32 (C, H, W)."""
    c, h, w = meta["shape"]
    img = np.frombuffer(zlib.decompress(raw), dtype=np.uint8).reshape(c, h, w).astype(np.float32) / 255.0
    area, aspect = rng.uniform(*scale), np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    ch, cw = min(h, max(2, round(h * np.sqrt(area / aspect)))), min(w, max(2, round(w * np.sqrt(area * aspect))))
    y0, x0 = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    ys = np.clip(y0 + (np.arange(h) + 0.5) * ch / h - 0.5, 0, h - 1)
    xs = np.clip(x0 + (np.arange(w) + 0.5) * cw / w - 0.5, 0, w - 1)
    yi, xi = np.minimum(ys.astype(int), h - 2), np.minimum(xs.astype(int), w - 2)
    fy, fx = (ys - yi)[:, None], (xs - xi)[None, :]
    top, bottom = img[:, yi], img[:, yi + 1]
    out = ((top[:, :, xi] * (1 - fx) + top[:, :, xi + 1] * fx) * (1 - fy)
           + (bottom[:, :, xi] * (1 - fx) + bottom[:, :, xi + 1] * fx) * fy)
    if rng.random() < 0.5:
        out = out[:, :, ::-1]
    return np.ascontiguousarray((out - out.mean()) / (out.std() + 1e-6), dtype=np.float32)


def balance_threads(out, total: int = 4, samples: int = 128, latency_s: float = 0.001, splits=None,
                    seed: int = 0, name: str = "images", decoders: str = "processes") -> dict:
    """Lobster's balance: one process reading `samples` samples of `<out>/shared/<name>` (make_dataset(out, size=128,
    channels=3, name="images"): decoding is real work there) from the shared file system with R read threads and
    decoding + augmenting them with D decode workers (`decoders`: "processes" or "threads"), R + D = `total`, for
    each split. Returns {"rows": split,
    samples_per_s; "best": the fastest split; "read_ms", "decode_ms": one thread's cost per sample of each stage
    (measured first); "cores": CPUs this process may use; each row's "model_samples_per_s": the slower stage's rate,
    R / read_ms against min(D, cores) / decode_ms (reads wait, so they overlap; decoding needs a core each);
    "predicted": the split the model rates highest (a tie goes to more read threads)}."""
    out = Path(out).resolve()
    index = GlobalIndex(out / "shared" / name, 1)
    store = ThrottledStore(index.shared_dir, open_latency_s=latency_s)
    reader = SpreadReader(index, 0, store)
    ids = np.random.default_rng(seed).permutation(len(index))[:samples]
    t0 = time.perf_counter()
    raws = [reader.read(i) for i in ids[:16]]
    read_ms = 1000 * (time.perf_counter() - t0) / len(raws)
    t0 = time.perf_counter()
    for k, raw in enumerate(raws * 2):
        decode_augment(raw, index.meta, np.random.default_rng(k))
    decode_ms = 1000 * (time.perf_counter() - t0) / (2 * len(raws))
    splits = splits or [(r, total - r) for r in range(1, total)]
    rows = [{"read_threads": r, "decode_threads": d, **_pipeline(reader, index.meta, ids, r, d, decoders)}
            for r, d in splits]
    best = max(rows, key=lambda row: row["samples_per_s"])
    cores = usable_cpus()
    for row in rows:
        row["model_samples_per_s"] = 1000 * min(row["read_threads"] / read_ms,
                                                min(row["decode_threads"], cores) / decode_ms)
    top = max(rows, key=lambda row: (round(row["model_samples_per_s"], 6), row["read_threads"]))
    predicted = top["read_threads"]
    return {"rows": rows, "best": (best["read_threads"], best["decode_threads"]), "read_ms": read_ms,
            "decode_ms": decode_ms, "cores": cores, "predicted": (predicted, total - predicted), "total": total}


def _pipeline(reader, meta, ids, read_threads: int, decoders: int, kind: str = "processes") -> dict:
    """Read threads feed `decoders` decode workers (processes or threads), at most 2 samples per worker in flight;
    samples/s end to end (the workers are started before the clock starts)."""
    todo = queue.Queue()
    for i in ids:
        todo.put(int(i))
    in_flight, done, lock = threading.BoundedSemaphore(2 * decoders), [0], threading.Lock()

    def finished(_):
        with lock:
            done[0] += 1
        in_flight.release()

    if kind == "processes":  # fork: the workers start at once and need nothing but numpy and zlib
        import multiprocessing
        pool = multiprocessing.get_context("fork").Pool(decoders)
        pool.map(_decode_job, [(None, meta, 0)] * decoders)  # every worker up
    else:
        from multiprocessing.pool import ThreadPool
        pool = ThreadPool(decoders)

    def read_worker():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            raw = reader.read(i)
            in_flight.acquire()
            pool.apply_async(_decode_job, ((raw, meta, i),), callback=finished)

    t0 = time.perf_counter()
    readers = [threading.Thread(target=read_worker) for _ in range(read_threads)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    pool.close()
    pool.join()
    seconds = time.perf_counter() - t0
    return {"samples": done[0], "seconds": seconds, "samples_per_s": done[0] / seconds}


def _decode_job(job):
    raw, meta, i = job
    return None if raw is None else decode_augment(raw, meta, np.random.default_rng(i))


def balance_figure(result):
    """Samples/s per (read threads, decode threads) split, each bar noted with the model's rate (* : predicted)."""
    from .plots import bars
    rows = result["rows"]
    labels = [f"{r['read_threads']}R+{r['decode_threads']}D" for r in rows]
    notes = [f"model {r['model_samples_per_s']:.0f}"
             + (" *" if (r["read_threads"], r["decode_threads"]) == tuple(result["predicted"]) else "") for r in rows]
    return bars(labels, [r["samples_per_s"] for r in rows],
                f"Read vs decode threads ({result['total']} in all, {result['cores']} cores)", "samples/s", notes=notes)


__all__ = ["decode_augment", "balance_threads", "balance_figure"]
