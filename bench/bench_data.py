"""Data loading: packed shards vs one file per sample, and shards vs a raw sequential read of the same bytes.

    .venv/bin/python bench/bench_data.py                 # writes bench/results/bench_data.json
    .venv/bin/python bench/bench_data.py --samples 5000 --repeats 3     # quicker

Both loaders deliver the same thing: epochs of (x, y) batches as torch tensors (the file-per-sample layout holds
the first `--file-samples` samples only: creating 100k files takes minutes; samples/s compare per-sample costs).
- file-per-sample: for each sample open its .npy file, read it, parse it, then stack the batch
  (`FileDataset`, the layout of an image folder);
- packed shards: `ShardStream`: each shard mapped whole, every sample copied once to its shuffled place in a
  reused batch buffer, batches are views of it.
- raw read: every shard file read front to back in 1 MiB pieces into a reused buffer, nothing else.

All three read from the page cache (the files were just written; dropping caches would disturb the other users
of this machine), so the comparison is of software overhead per sample, which is what a metadata-bound parallel
file system multiplies. A second, smaller measurement goes through `ThrottledStore` (1 ms per open) to show
the file-system-like case. Targets: shards >= 10x file-per-sample samples/s; shards >= 0.5 of raw bytes/s.
Each figure is the median of `--repeats` runs, the ratios the median of the per-repeat ratios (each repeat runs
the three back to back) with their quartiles (`spread`); the machine's load average is recorded with them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab.data.formats import open_dataset, shard_name, write_dataset  # noqa: E402
from scalelab.data.order import sampler_order  # noqa: E402
from scalelab.data.store import ThrottledStore  # noqa: E402
from scalelab.data.stream import ShardStream  # noqa: E402
from scalelab.data.synthetic import heat_fields  # noqa: E402


def file_loader_epoch(ds, batch: int, seed: int, limit: int | None = None) -> int:
    """One epoch of batches from one file per sample, in a shuffled order; returns samples delivered."""
    order = sampler_order(len(ds), seed=seed)[:limit]
    n = 0
    for k in range(0, len(order) - batch + 1, batch):
        idx = order[k:k + batch]
        x = torch.from_numpy(np.stack([ds.decode(ds.read(int(i))) for i in idx]))
        y = torch.from_numpy(ds.labels[idx])
        n += len(x)
    return n


def shard_loader_epoch(stream: ShardStream, epoch: int) -> int:
    """One epoch of batches from the shard stream; returns samples delivered."""
    stream.set_epoch(epoch)
    return sum(len(x) for x, _ in stream)


def raw_read(directory: Path, shards: int) -> int:
    """Read every shard file sequentially in 1 MiB pieces; returns bytes read."""
    buf = bytearray(1 << 20)
    total = 0
    for k in range(shards):
        with open(directory / shard_name(k), "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def timed(fn, repeats: int) -> tuple[float, list[float], int]:
    """(median seconds, all seconds, units) of `repeats` calls (after one warm-up call)."""
    fn()
    runs, units = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        units = fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), runs, units


def _quartiles(values: list[float]) -> list[float]:
    """First and third quartiles of per-repeat ratios: the spread the median sits in."""
    if len(values) < 2:
        return list(values) * 2
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100000, help="samples in the shards (and raw read)")
    parser.add_argument("--file-samples", type=int, default=20000,
                        help="samples written one per file (fewer: 100k files take minutes to create)")
    parser.add_argument("--size", type=int, default=16, help="field side: a sample is size*size float32")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_data.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    x, y = heat_fields(args.samples, args.size, 4, seed=0)
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        files = write_dataset(x[:args.file_samples], y[:args.file_samples], Path(tmp) / "files", "files")
        shards = write_dataset(x, y, Path(tmp) / "shards", "shards", samples_per_shard=1024)
        fds, sds = open_dataset(files), open_dataset(shards)
        stream = ShardStream(sds, args.batch, window=2)
        epoch = iter(range(1_000_000))
        runs = {"files": [], "shards": [], "raw": []}
        fns = {"files": lambda: file_loader_epoch(fds, args.batch, 0),
               "shards": lambda: shard_loader_epoch(stream, next(epoch)),
               "raw": lambda: raw_read(shards, sds.shard_count())}
        units = {name: fn() for name, fn in fns.items()}  # warm-up
        for r in range(args.repeats):  # interleaved, in a rotating order: all three see the same (shared) load
            for name in list(fns)[r % 3:] + list(fns)[:r % 3]:
                t0 = time.perf_counter()
                units[name] = fns[name]()
                runs[name].append(time.perf_counter() - t0)
        runs_files, runs_shards, runs_raw = runs["files"], runs["shards"], runs["raw"]
        n_files, n_shards, n_raw = units["files"], units["shards"], units["raw"]
        t_files, t_shards, t_raw = (statistics.median(runs[k]) for k in ("files", "shards", "raw"))
        shard_bytes = sum((shards / shard_name(k)).stat().st_size for k in range(sds.shard_count()))

        # the parallel-file-system case: 1 ms per open, on a slice of the data (files) / all of it (shards)
        slow_files = open_dataset(files, ThrottledStore(files, open_latency_s=0.001))
        slow_shards = ShardStream(open_dataset(shards, ThrottledStore(shards, open_latency_s=0.001)), args.batch)
        t_sf, _, n_sf = timed(lambda: file_loader_epoch(slow_files, args.batch, 0, limit=2048), 1)
        t_ss, _, n_ss = timed(lambda: shard_loader_epoch(slow_shards, next(epoch)), 1)

    files_sps, shards_sps = n_files / t_files, n_shards / t_shards
    shard_bytes_per_s = shards_sps * shard_bytes / args.samples
    raw_bytes_per_s = n_raw / t_raw
    # per repeat, the ratio of two runs made back to back; the target is judged on their median
    raw_ratios = [r / s for r, s in zip(runs_raw, runs_shards)]
    file_ratios = [(n_shards / s) / (n_files / f) for s, f in zip(runs_shards, runs_files)]
    over_raw, over_files = statistics.median(raw_ratios), statistics.median(file_ratios)
    result = {
        "benchmark": "data loading: packed shards vs file per sample vs raw sequential read",
        "command": "python bench/bench_data.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "samples": args.samples, "file_samples": args.file_samples, "sample_bytes": int(x[0].nbytes),
        "batch": args.batch, "repeats": args.repeats,
        "page_cache": "warm (files just written); software overhead per sample is what is compared",
        "file_per_sample": {"samples_per_s": files_sps, "runs_s": runs_files},
        "packed_shards": {"samples_per_s": shards_sps, "bytes_per_s": shard_bytes_per_s, "runs_s": runs_shards},
        "raw_sequential_read": {"bytes_per_s": raw_bytes_per_s, "bytes": n_raw, "runs_s": runs_raw},
        "interleaved": "each repeat runs file-per-sample, shards and raw read back to back (rotating order)",
        "shards_over_files": over_files,
        "shards_over_raw_read": over_raw,
        "shards_over_raw_read_of_medians": shard_bytes_per_s / raw_bytes_per_s,
        "spread": {"shards_over_raw_read": {"per_repeat": raw_ratios, "quartiles": _quartiles(raw_ratios)},
                   "shards_over_files": {"per_repeat": file_ratios, "quartiles": _quartiles(file_ratios)}},
        "throttled_1ms_per_open": {"file_per_sample_samples_per_s": n_sf / t_sf, "packed_shards_samples_per_s": n_ss / t_ss,
                                   "shards_over_files": (n_ss / t_ss) / (n_sf / t_sf)},
        "targets": {"shards_over_files": ">= 10", "shards_over_raw_read": ">= 0.8 (issue 22, item 1)"},
    }
    result["met"] = {"shards_over_files": result["shards_over_files"] >= 10,
                     "shards_over_raw_read": result["shards_over_raw_read"] >= 0.8}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"file per sample {files_sps:10.0f} samples/s")
    print(f"packed shards   {shards_sps:10.0f} samples/s  ({shard_bytes_per_s / 1e6:.0f} MB/s)  "
          f"x{result['shards_over_files']:.1f} vs files")
    q = result["spread"]["shards_over_raw_read"]["quartiles"]
    print(f"raw read        {raw_bytes_per_s / 1e6:10.0f} MB/s  shards/raw = {result['shards_over_raw_read']:.2f} "
          f"(median of {args.repeats} interleaved repeats; quartiles {q[0]:.2f}-{q[1]:.2f})")
    print(f"throttled 1 ms/open: shards x{result['throttled_1ms_per_open']['shards_over_files']:.0f} vs files")
    print(f"wrote {args.out}")
    return 0 if all(result["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
