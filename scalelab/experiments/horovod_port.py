"""Lab 03: the training step ported to Horovod by the student, checked against the arithmetic it must reproduce.

`train_ported` runs on every rank under `SpmdPool(launcher="horovodrun" | "mpirun", init="none")`. Each rank
builds the engine's model with a *rank-dependent* seed (as if every rank had initialised its own weights), hands
model and optimizer to the student's `make_distributed(model, optimizer)`, and trains. A correct port broadcasts
rank 0's parameters and averages gradients, so every rank must end bit-identical to rank 0 and equal to a
reference trained in one process on the whole global batch (N shards of B samples = one batch of N x B).
`timeline_summary` reads the Chrome-trace timeline Horovod writes when HOROVOD_TIMELINE names a file;
`horovod_timeline` turns it into spans on one clock, and `fusion_summary` counts what tensor fusion did: how many
gradient all-reduces Horovod ran as how many fused ones, in how many coordinator cycles.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import build_dataset, build_loader
from ..run.spec import from_dict
from ..train.profiling import horovod_timeline_path
from ._common import build_workload


def _shard_batches(spec, dataset, rank: int, world: int, steps: int):
    loader = build_loader(dataset, spec.data, spec.optim.batch_per_worker, rank, world, spec.seed)
    return [b for _, b in zip(range(steps), loader)]


def train_ported(port: str, spec: dict, steps: int = 3) -> dict:
    """Train `steps` steps with the optimizer `port` ("module:function") returns; compare with the reference."""
    import horovod.torch as hvd
    from ..launch.spmd_rank import resolve
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    spec = from_dict(spec).validate()
    dataset = build_dataset(spec.data, spec.seed)
    mine = build_workload(spec.replace(seed=spec.seed + 1000 * rank), dataset=dataset)  # rank-dependent start
    optimizer = resolve(port)(mine.model, mine.optimizer)
    reference = build_workload(spec, dataset=dataset)  # rank 0's start, trained on the global batch
    shards = [_shard_batches(spec, dataset, r, size, steps) for r in range(size)]
    losses = []
    for step in range(steps):
        x, y = shards[rank][step]
        loss = F.cross_entropy(mine.model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        gx = torch.cat([shards[r][step][0] for r in range(size)])
        gy = torch.cat([shards[r][step][1] for r in range(size)])
        F.cross_entropy(reference.model(gx), gy).backward()
        reference.optimizer.step()
        reference.optimizer.zero_grad()
    replica = max(float((p.detach() - hvd.broadcast(p.detach(), root_rank=0, name=f"check.{n}")).abs().max())
                  for n, p in mine.model.named_parameters())
    ref_diff = max(float((a.detach() - b.detach()).abs().max())
                   for a, b in zip(mine.model.parameters(), reference.model.parameters()))
    return {"rank": rank, "size": size, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
            "replica_max_diff": replica, "reference_max_diff": ref_diff, "losses": losses,
            "wrapped": type(optimizer).__name__}


def timeline_summary(path: str | Path) -> dict:
    """Events per activity name (NEGOTIATE_ALLREDUCE, ALLREDUCE, MEMCPY_IN_FUSION_BUFFER, ...) and tensor names
    in a Horovod timeline; a file cut short (the job was killed) is read up to its last complete event."""
    path = Path(path)
    if not path.exists():
        return {"ok": False, "error": f"{path} was not written", "events": 0, "activities": {}, "tensors": []}
    events = _timeline_events(path.read_text())
    names = Counter(e["name"] for e in events if e.get("ph") == "B" and "name" in e)
    tensors = sorted({e["args"]["name"] for e in events if e.get("name") == "process_name"
                      and "name" in e.get("args", {})})
    return {"ok": True, "events": len(events), "activities": dict(names), "tensors": tensors, "path": str(path)}


def _timeline_events(text: str) -> list:
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # no closing bracket: Horovod had not shut down
        return json.loads(text[: text.rfind("}") + 1].rstrip(",") + "]")


def horovod_timeline(path) -> dict:
    """Horovod's timeline as spans: {"spans": [(activity, start_s, end_s, tensor)], "cycles": [t_s, ...]}.

    Times are seconds from the timeline's start (hvd.init). A file cut short (the job was killed) is read up to
    its last complete event."""
    return {**horovod_timeline_text(Path(path).read_text()), "path": str(path)}


def horovod_timeline_text(text: str) -> dict:
    """`horovod_timeline` of the file's text."""
    events = _timeline_events(text)
    tensors = {e.get("pid"): e["args"]["name"] for e in events
               if e.get("name") == "process_name" and "name" in e.get("args", {})}
    open_: dict[tuple, list] = {}
    spans, cycles = [], []
    for e in events:
        ph, ts = e.get("ph"), e.get("ts")
        if ts is None:
            continue
        key = (e.get("pid"), e.get("tid"))
        if ph == "B":
            open_.setdefault(key, []).append((e.get("name", ""), ts / 1e6))
        elif ph == "E" and open_.get(key):
            name, start = open_[key].pop()
            if ts / 1e6 > start:
                spans.append((name, start, ts / 1e6, tensors.get(e.get("pid"), "")))
        elif ph == "X" and e.get("dur"):  # zero-length X events mark which rank is ready: left out
            spans.append((e.get("name", ""), ts / 1e6, (ts + e.get("dur", 0)) / 1e6, tensors.get(e.get("pid"), "")))
        elif ph in ("i", "I") and "CYCLE" in e.get("name", "").upper():
            cycles.append(ts / 1e6)
    return {"spans": sorted(spans, key=lambda x: x[1]), "cycles": sorted(cycles)}


def fusion_summary(timeline: dict) -> dict:
    """What tensor fusion did in a Horovod timeline: gradient all-reduces (one per tensor per step), the fused
    all-reduces they ran as (tensors whose ALLREDUCE spans overlap went through the fusion buffer together), the
    tensors per fused all-reduce, the coordinator's cycles, and the mean ms of negotiation and of an all-reduce."""
    spans = [s for s in timeline["spans"] if s[3].startswith("allreduce.")]
    reduce = sorted((a, b) for name, a, b, _ in spans if name == "ALLREDUCE")
    fused: list[list[float]] = []
    for a, b in reduce:
        if fused and a < fused[-1][1]:
            fused[-1][1] = max(fused[-1][1], b)
        else:
            fused.append([a, b])
    negotiate = [b - a for name, a, b, _ in spans if name == "NEGOTIATE_ALLREDUCE"]
    return {"tensors": len({s[3] for s in spans}), "allreduces": len(reduce), "fused_allreduces": len(fused),
            "tensors_per_fused": len(reduce) / len(fused) if fused else 0.0, "cycles": len(timeline["cycles"]),
            "negotiate_ms": 1e3 * sum(negotiate) / len(negotiate) if negotiate else 0.0,
            "fused_allreduce_ms": 1e3 * sum(b - a for a, b in fused) / len(fused) if fused else 0.0}


def run_fusion(run_dir) -> dict:
    """`fusion_summary` of a profiled horovod run's timeline, with the run dir and the timeline's path."""
    path = horovod_timeline_path(run_dir)
    return {"run_dir": str(run_dir), "timeline": str(path), **fusion_summary(horovod_timeline(path))}
