"""Lab 02: inside DistributedDataParallel. Each function runs on every rank under `run_spmd` (gloo group ready)
and takes the RunSpec as a dict (`spec.to_dict()`), so the model, data and optimizer are the engine's.

- `compare_with_ddp`: gradients averaged by a student's `average_gradients(model)` vs DDP's, step by step.
- `bucket_sweep`: DDP's gradient buckets (bucket_cap_mb): allreduce calls per step, step time, and how much
  communication is left exposed after overlapping with the backward pass; with `trace_dir`, a few steps per cap
  profiled into a Chrome trace per rank (`<trace_dir>/cap-<cap>/rank-<r>.json`, the engine's phase names), which
  `scalelab.experiments.profiling` reads back: where each bucket's all-reduce ran against backward.
- `accumulation`: k micro-batches per optimizer step, allreducing every one vs `no_sync()` for all but the last.
- `replicas`: do the ranks' parameters stay bit-identical (DDP) or drift apart (no gradient averaging)?
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..data import build_dataset, build_loader
from ..run.spec import from_dict
from ..train.profiling import PREFIX
from ._common import build_workload
from .profiling import overlap_by_rank


def _spec(spec: dict):
    s = from_dict(spec)
    s.validate()
    return s


def _batches(spec, dataset, rank, world):
    loader = build_loader(dataset, spec.data, spec.optim.batch_per_worker, rank, world, spec.seed)
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _max_diff(params_a, params_b) -> float:
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(params_a, params_b))


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def max_diff_from_rank0(model) -> float:
    """Largest |parameter - rank 0's parameter| on this rank (0.0 means a bit-identical replica)."""
    worst = 0.0
    for p in model.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        worst = max(worst, float((p.detach() - ref).abs().max()))
    return worst


def checksum(model) -> float:
    """Sum of all parameters in float64: equal on replicas that are identical."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def compare_with_ddp(average: str, spec: dict, steps: int = 3) -> dict:
    """Train two copies from the same start: one DDP-wrapped, one averaged by `average` ("module:function").

    Returns the largest gradient difference seen after any step's averaging, the final parameter difference,
    and how far this rank's hand-averaged copy is from rank 0's.
    """
    from ..launch.spmd_rank import resolve
    spec = _spec(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    average_gradients = resolve(average)
    dataset = build_dataset(spec.data, spec.seed)
    ref, mine = build_workload(spec, dataset=dataset), build_workload(spec, dataset=dataset)
    ddp = DDP(ref.model)
    batches = _batches(spec, dataset, rank, world)
    grad_diff, losses = 0.0, []
    for _ in range(steps):
        x, y = next(batches)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # DDP averages gradients during backward
        F.cross_entropy(mine.model(x), y).backward()
        average_gradients(mine.model)  # the student's allreduce
        grad_diff = max(grad_diff, _max_diff(_grads(ref.model), _grads(mine.model)))
        for wl in (ref, mine):
            wl.optimizer.step()
            wl.optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"rank": rank, "world": world, "grad_max_diff": grad_diff,
            "param_max_diff": _max_diff(ref.model.parameters(), mine.model.parameters()),
            "replica_max_diff": max_diff_from_rank0(mine.model), "losses": losses}


def _counting_hook(state: dict, bucket):
    """DDP's default arithmetic (sum, divide by world), counting calls: one call per bucket per backward."""
    state["calls"] += 1
    state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def _timed_steps(step, n: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        step()
    elapsed = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return float(elapsed) * 1000


def bucket_sweep(spec: dict, caps_mb=(0.1, 1.0, 25.0), steps: int = 8, warmup: int = 2, trace_dir: str | None = None,
                 trace_steps: int = 3) -> dict:
    """Per bucket_cap_mb: buckets (allreduce calls) per step, step ms, the same step under no_sync (no
    communication), and exposed communication = the difference. With `trace_dir`, `trace_steps` more steps per
    cap are profiled (each row gains `trace`, this rank's trace path)."""
    spec = _spec(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = build_dataset(spec.data, spec.seed)
    rows = []
    for cap in caps_mb:
        wl = build_workload(spec, dataset=dataset)
        ddp = DDP(wl.model, bucket_cap_mb=cap)
        state = {"calls": 0, "bytes": 0}
        ddp.register_comm_hook(state, _counting_hook)
        batches = _batches(spec, dataset, rank, world)

        def step(sync=True):
            x, y = next(batches)
            with contextlib.nullcontext() if sync else ddp.no_sync():
                F.cross_entropy(ddp(x), y).backward()
            wl.optimizer.step()
            wl.optimizer.zero_grad()

        step_ms = _timed_steps(step, steps, warmup)
        state.update(calls=0, bytes=0)
        step()  # buckets are rebuilt after the first iterations: count on a settled one
        buckets, nbytes = state["calls"], state["bytes"]
        nosync_ms = _timed_steps(lambda: step(sync=False), steps, warmup)
        rows.append({"bucket_cap_mb": cap, "buckets": buckets, "bytes_per_step": nbytes, "step_ms": step_ms,
                     "nosync_step_ms": nosync_ms, "exposed_comm_ms": max(step_ms - nosync_ms, 0.0)})
        if trace_dir:
            path = Path(trace_dir) / f"cap-{cap:g}" / f"rank-{rank}.json"
            rows[-1].update(trace=str(path), traced_steps=trace_steps)
            _trace_steps(ddp, wl.optimizer, batches, trace_steps, path)
    params = sum(p.numel() for p in build_workload(spec, dataset=dataset).model.parameters())
    return {"rank": rank, "world": world, "parameters": params, "rows": rows}


def _trace_steps(ddp, optimizer, batches, n: int, path: Path) -> None:
    """Profile `n` DDP steps (after one warm-up step) into a Chrome trace, phases named as the engine names them."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    path.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()  # both ranks trace the same steps
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=n, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(n + 1):
            x, y = next(batches)
            with record_function(PREFIX + "forward"):
                loss = F.cross_entropy(ddp(x), y)
            with record_function(PREFIX + "backward"):
                loss.backward()  # the bucket all-reduces start in here, on gloo's own thread
            with record_function(PREFIX + "optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            prof.step()


def accumulation(spec: dict, k: int = 4, steps: int = 3, warmup: int = 1) -> dict:
    """k micro-batches per optimizer step: allreduce after each (naive) vs `no_sync()` on all but the last.

    Both give the same averaged gradient (the mean of sums equals the sum of means); `no_sync` sends k times
    fewer allreduces. Returns calls and ms per optimizer step for each, and their gradient difference.
    """
    spec = _spec(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = build_dataset(spec.data, spec.seed)
    out = {"rank": rank, "world": world, "k": k}
    grads = {}
    for mode in ("naive", "no_sync"):
        wl = build_workload(spec, dataset=dataset)
        ddp = DDP(wl.model)
        state = {"calls": 0, "bytes": 0}
        ddp.register_comm_hook(state, _counting_hook)
        batches = _batches(spec, dataset, rank, world)

        def micro_steps(apply=True):
            for i in range(k):
                x, y = next(batches)
                skip = mode == "no_sync" and i < k - 1
                with ddp.no_sync() if skip else contextlib.nullcontext():
                    (F.cross_entropy(ddp(x), y) / k).backward()
            if apply:
                wl.optimizer.step()
                wl.optimizer.zero_grad()

        micro_steps(apply=False)  # the first accumulation from the common start: compare its gradients
        grads[mode] = [g.clone() for g in _grads(wl.model)]
        wl.optimizer.zero_grad()
        state.update(calls=0, bytes=0)
        micro_steps()
        out[f"calls_{mode}"] = state["calls"]
        out[f"ms_{mode}"] = _timed_steps(micro_steps, steps, warmup)
    out["buckets"] = out["calls_no_sync"]
    out["grad_max_diff"] = _max_diff(grads["naive"], grads["no_sync"])
    return out


def _train_replica(spec, dataset, steps: int, average: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    wl = build_workload(spec, dataset=dataset)
    model = DDP(wl.model) if average else wl.model
    batches = _batches(spec, dataset, rank, world)
    for _ in range(steps):
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        wl.optimizer.step()
        wl.optimizer.zero_grad()
    return {"checksum": checksum(wl.model), "max_diff_from_rank0": max_diff_from_rank0(wl.model)}


def replicas(spec: dict, steps: int = 5) -> dict:
    """Train `steps` steps twice from the same start, each rank on its own shard: with DDP, and without any
    gradient averaging. Returns this rank's parameter checksum and largest difference from rank 0, for each."""
    spec = _spec(spec)
    dataset = build_dataset(spec.data, spec.seed)
    return {"rank": dist.get_rank(), "ddp": _train_replica(spec, dataset, steps, average=True),
            "no_averaging": _train_replica(spec, dataset, steps, average=False)}


def timeline_record(run_dir) -> dict:
    """Per rank of a profiled DDP run: traced steps, all-reduces, comm ms per step and the overlap ratio."""
    ranks = {str(rank): {"steps": s["steps"], "allreduces": s["collectives"].get("all_reduce", 0),
                         "comm_ms": 1e3 * s["comm_s"] / max(s["steps"], 1), "overlap": s["overlap"]}
             for rank, s in overlap_by_rank(run_dir).items()}
    return {"run_dir": str(run_dir), "ranks": ranks}
