"""Lab 02: what an allreduce costs, against message size. Run on N ranks with `run_spmd` or an `SpmdPool`:

    rows = run_spmd("scalelab.experiments.collectives:allreduce_sweep", world=2,
                    kwargs={"sizes": [4096, 1 << 20]})[0]["rows"]

Time per call is the slowest rank's median over `repeats` calls (a collective ends when its last rank does; the
median ignores the odd call a busy OS delayed).
`bandwidths()` turns times into the two figures NCCL's tests report: algorithm bandwidth (bytes / time) and bus
bandwidth (algbw x 2(n-1)/n: what each link carried in a ring allreduce, comparable across rank counts).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def _group(backend: str):
    """(process group, device) for `backend`: the default group, or a new one (e.g. NCCL beside a gloo default)."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "default"
    if backend in ("default", dist.get_backend()):
        backend, group = dist.get_backend(), None
    else:
        group = dist.new_group(backend=backend)  # every rank calls this, as new_group requires
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return group, torch.device("cuda", torch.cuda.current_device()), backend
    return group, torch.device("cpu"), backend


def allreduce_sweep(sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 22), repeats: int = 10, warmup: int = 2,
                    backend: str = "default") -> dict:
    """Per message size in bytes (fp32): median allreduce time over `repeats`, slowest rank's. Also checks the sum.

    `backend`: "default" (the group's own, gloo in a default pool), "nccl", "gloo" or "auto" (nccl with CUDA).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    group, device, backend = _group(backend)
    probe = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(probe, group=group)
    sum_ok = bool(torch.all(probe == world * (world + 1) / 2))  # 1 + 2 + ... + world on every element
    tensors = [torch.ones(max(1, int(nbytes) // 4), device=device) for nbytes in sizes]
    for t in tensors:  # a first pass over every size: buffers, connections and caches warm before any timing
        for _ in range(warmup):
            dist.all_reduce(t, group=group)
    rows = []
    for t in tensors:
        for _ in range(warmup):
            dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)
        per_call = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()  # NCCL calls return before the GPU has finished them
            per_call.append(time.perf_counter() - start)
        # the median call: robust to a rank that the OS scheduler delayed once (common on a shared laptop)
        median = torch.tensor([sorted(per_call)[len(per_call) // 2]], dtype=torch.float64, device=device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
        rows.append({"bytes": t.numel() * 4, "time_s": float(median)})
    return {"rank": rank, "world": world, "backend": backend, "sum_ok": sum_ok, "rows": rows}


def bandwidths(rows, world: int) -> list[dict]:
    """Rows with algbw_GBps = bytes/time and busbw_GBps = algbw x 2(world-1)/world added (GB = 1e9 bytes)."""
    factor = 2 * (world - 1) / world
    return [{**r, "algbw_GBps": r["bytes"] / r["time_s"] / 1e9,
             "busbw_GBps": r["bytes"] / r["time_s"] / 1e9 * factor} for r in rows]


def fit_latency_bandwidth(rows) -> dict:
    """Least-squares fit of time = latency + bytes / bandwidth (the alpha-beta model) to measured rows."""
    n = len(rows)
    xs, ys = [r["bytes"] for r in rows], [r["time_s"] for r in rows]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    latency = my - slope * mx
    return {"latency_us": max(latency, 0.0) * 1e6, "bandwidth_GBps": (1 / slope / 1e9) if slope > 0 else float("inf")}
