"""Events -> the numbers a run is judged by: throughput, loss, time breakdown."""
from __future__ import annotations

import math
from collections import defaultdict


def warmup_skip(n_steps: int) -> int:
    """Steps left out of throughput: the first step pays for process-group set-up, allocator warm-up, etc."""
    return min(max(1, n_steps // 10), max(n_steps - 1, 0))


def per_rank_steps(events) -> dict[int, list[dict]]:
    """Step events grouped by rank, in step order."""
    steps = defaultdict(list)
    for e in events:
        if e.get("type") == "step":
            steps[e["rank"]].append(e)
    for rank in steps:
        steps[rank].sort(key=lambda e: e["step"])
    return dict(steps)


def summarize(events, world_size: int) -> dict:
    """Throughput (global and per rank), losses, and where the time went, from a run's events."""
    by_rank = per_rank_steps(events)
    ends = {e["rank"]: e for e in events if e.get("type") == "end"}
    rates, totals = {}, defaultdict(float)
    for rank, steps in by_rank.items():
        measured = steps[warmup_skip(len(steps)):]
        busy = sum(s["step_s"] for s in measured)
        rates[rank] = sum(s["samples"] for s in measured) / busy if busy > 0 else 0.0
        for key in ("step_s", "data_s", "compute_s", "comm_s"):
            totals[key] += sum(s[key] for s in measured)
    main = by_rank.get(0) or next(iter(by_rank.values()), [])
    final_loss = ends[0]["final_loss"] if 0 in ends else (main[-1]["loss"] if main else math.nan)
    return {
        "world_size": world_size,
        "steps": main[-1]["step"] if main else 0,
        "final_loss": final_loss,
        "samples_per_s": sum(rates.values()),
        "per_rank_samples_per_s": [rates.get(r, 0.0) for r in range(world_size)],
        "eval_accuracy": ends[0].get("eval_accuracy") if 0 in ends else None,
        "time_fraction": exclusive_fractions(totals),
        "comm_in_flight": totals["comm_s"] / totals["step_s"] if totals["step_s"] else 0.0,
        "loss_curve": [s["loss"] for s in main],
    }


def exclusive_fractions(totals: dict) -> dict:
    """Where step time went, as shares that add up to 1: data (waiting for the loader), compute, comm (exposed
    communication: time a step waited for its all-reduce), other (what no timer covered).

    Horovod's loop times communication apart from compute. DDP's all-reduce runs in buckets while backward is still
    computing, and its timer spans each bucket from launch to completion: there the in-flight time overlaps
    compute (`comm_in_flight` in the summary reports it apart), and comm here is taken out of compute as an
    upper bound of the exposed part."""
    step = totals.get("step_s", 0.0)
    if step <= 0:
        return {"data": 0.0, "compute": 0.0, "comm": 0.0, "other": 0.0}
    data, compute, comm = (max(totals.get(k, 0.0), 0.0) / step for k in ("data_s", "compute_s", "comm_s"))
    if data + compute + comm > 1.0 + 1e-9:  # overlapped: the comm timer ran inside compute
        compute = max(compute - comm, 0.0)
    used = data + compute + comm
    if used > 1.0:  # timer jitter: scale to the step time
        data, compute, comm = data / used, compute / used, comm / used
    return {"data": data, "compute": compute, "comm": comm, "other": max(1.0 - data - compute - comm, 0.0)}


def scaling_efficiency(rate_n: float, rate_1: float, n: int) -> float:
    """Weak-scaling efficiency: throughput with n workers over n times the 1-worker throughput."""
    return rate_n / (n * rate_1) if rate_1 > 0 else 0.0
