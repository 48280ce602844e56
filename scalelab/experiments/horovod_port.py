"""Lab 03: the training step ported to Horovod by the student, checked against the arithmetic it must reproduce, and
a tensor-fusion sweep read from Horovod's timelines.

`train_ported` runs on every rank under `SpmdPool(launcher="horovodrun" | "mpirun", init="none")`. Each rank
builds the engine's model with a *rank-dependent* seed (as if every rank had initialised its own weights), and rank
0's optimizer has another learning rate (it plays a rank that resumed from a checkpoint); it hands model and
optimizer to the student's `make_distributed(model, optimizer)`, trains, and averages each step's loss with the
student's `average_metric(value, name)`. A correct port broadcasts rank 0's parameters and optimizer state and
averages gradients, so every rank must end bit-identical to rank 0 (SHA-256 digests of parameters and optimizer
state) and equal to a reference trained in one process on the whole global batch (N shards of B samples = one
batch of N x B); the averaged loss must be the mean of the ranks' losses.

`fusion_sweep` runs `train_sweep_point` as one Horovod job per HOROVOD_FUSION_THRESHOLD x HOROVOD_CYCLE_TIME
point, each writing its own timeline. `timeline_summary` reads the Chrome-trace timeline Horovod writes when
HOROVOD_TIMELINE names a file; `horovod_timeline` turns it into spans on one clock, and `fusion_summary` counts
what tensor fusion did: how many gradient all-reduces Horovod ran as how many fused ones, in how many coordinator
cycles.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import build_dataset, build_loader
from ..run.spec import from_dict
from ..train.profiling import horovod_timeline_path
from ._common import build_workload


def _shard_batches(spec, dataset, rank: int, world: int, steps: int):
    """This rank's first `steps` batches (the shard read again from its start if one pass holds fewer)."""
    loader = build_loader(dataset, spec.data, spec.optim.batch_per_worker, rank, world, spec.seed)
    batches: list = []
    while len(batches) < steps:
        batches += [b for _, b in zip(range(steps - len(batches)), loader)]
    return batches


def train_ported(port: str, spec: dict, steps: int = 3, average: str | None = None) -> dict:
    """Train `steps` steps with the optimizer `port` ("module:function") returns; compare with the reference.

    Every rank starts from its own weights *and its own optimizer state*: rank 0 plays a rank that resumed from a
    checkpoint, whose learning rate is `RESUMED_LR_FACTOR` of the configured one, while the others were built
    from the configuration. A port must broadcast both. `average` ("module:function", optional) averages each
    step's loss over the ranks (the student's `average_metric(value, name)`). A student function that raises
    NotImplementedError is reported in `not_implemented` instead of ending the job: the plain local optimizer
    trains in its place (and the checks find the replicas apart)."""
    import horovod.torch as hvd
    from ..launch.spmd_rank import resolve
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    spec = from_dict(spec).validate()
    dataset = build_dataset(spec.data, spec.seed)
    shards = [_shard_batches(spec, dataset, r, size, steps) for r in range(size)]
    mine = build_workload(spec.replace(seed=spec.seed + 1000 * rank), dataset=dataset)  # rank-dependent start
    if rank == 0:
        _resume_lr(mine.optimizer)
    state_spread_before = _spread(hvd, optimizer_state(mine.optimizer), "check.state_before")
    missing = []
    try:
        optimizer = resolve(port)(mine.model, mine.optimizer)
    except NotImplementedError:
        optimizer, missing = mine.optimizer, missing + [port]
    state_after = optimizer_state(optimizer)
    state_spread_after = _spread(hvd, state_after, "check.state_after")
    reference = build_workload(spec, dataset=dataset)  # rank 0's start, trained on the global batch
    _resume_lr(reference.optimizer)
    losses, averaged = [], []
    for step in range(steps):
        x, y = shards[rank][step]
        loss = F.cross_entropy(mine.model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        averaged.append(_averaged(resolve, average, losses[-1], missing))
        gx = torch.cat([shards[r][step][0] for r in range(size)])
        gy = torch.cat([shards[r][step][1] for r in range(size)])
        F.cross_entropy(reference.model(gx), gy).backward()
        reference.optimizer.step()
        reference.optimizer.zero_grad()
    params = [p.detach() for p in mine.model.parameters()]
    replica = _spread(hvd, params, "check.params")
    ref_diff = max(float((a - b.detach()).abs().max()) for a, b in zip(params, reference.model.parameters()))
    return {"rank": rank, "size": size, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
            "replica_max_diff": replica, "reference_max_diff": ref_diff, "losses": losses,
            "averaged_losses": averaged if average and average not in missing else None,
            "state_spread_before": state_spread_before, "state_spread_after": state_spread_after,
            "state_sha256": digest(state_after), "params_sha256": digest(params),
            "not_implemented": missing, "wrapped": type(optimizer).__name__}


RESUMED_LR_FACTOR = 0.5
"""Rank 0's learning rate in `train_ported`, as a fraction of the configured one (it resumed mid-schedule)."""


def _resume_lr(optimizer) -> None:
    for group in optimizer.param_groups:
        group["lr"] *= RESUMED_LR_FACTOR


def _averaged(resolve, average, value, missing):
    if not average or average in missing:
        return None
    try:
        return float(resolve(average)(value, "train_loss"))
    except NotImplementedError:
        missing.append(average)
        return None


def optimizer_state(optimizer) -> list:
    """The optimizer's state as tensors, in order: each parameter group's numeric options (lr, momentum, ...),
    then every state tensor (SGD: a momentum buffer per parameter, once a step has made it)."""
    options = [torch.tensor([float(v) for k, v in sorted(g.items()) if isinstance(v, (int, float))],
                            dtype=torch.float64) for g in optimizer.param_groups]
    return options + [v.detach() for group in optimizer.param_groups for p in group["params"]
                      for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]


def _spread(hvd, tensors, name: str) -> float:
    """The largest |x - rank 0's x| over the tensors (0.0 exactly: every rank holds rank 0's bits)."""
    return max((float((t - hvd.broadcast(t, root_rank=0, name=f"{name}.{i}")).abs().max())
                for i, t in enumerate(tensors)), default=0.0)


def digest(tensors) -> str:
    """SHA-256 of the tensors' bytes, in order: equal digests, bit-identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_sweep_point(spec: dict, steps: int) -> dict:
    """One point of the fusion sweep, on every rank: `steps` steps of data-parallel training ported to Horovod by
    the library itself (not the student's port, so the sweep runs whatever exercise 1 holds), under the
    HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME the pool's environment set. Horovod is shut down at the end,
    which completes the timeline file before the job returns."""
    import horovod.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    spec = from_dict(spec).validate()
    dataset = build_dataset(spec.data, spec.seed)
    work = build_workload(spec, dataset=dataset)
    optimizer = hvd.DistributedOptimizer(work.optimizer, named_parameters=work.model.named_parameters(),
                                         op=hvd.Average)
    hvd.broadcast_parameters(work.model.state_dict(), root_rank=0)
    step_s, losses = [], []
    for x, y in _shard_batches(spec, dataset, rank, size, steps):
        start = time.perf_counter()
        loss = F.cross_entropy(work.model(x), y)
        loss.backward()
        optimizer.step()  # waits for this step's all-reduces
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    time.sleep(TIMELINE_DRAIN_S)  # Horovod's timeline writer lags the collectives: let it catch up
    hvd.shutdown()
    return {"rank": rank, "size": size, "step_s": step_s, "losses": losses,
            "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD"),
            "cycle_time": os.environ.get("HOROVOD_CYCLE_TIME")}


TIMELINE_DRAIN_S = 0.2
"""Seconds a sweep point waits after its last step before Horovod shuts down: the timeline's writer thread drains
its queue in the meantime (without the wait a timeline often lacked its last step's events)."""


def fusion_sweep(out_dir, spec: dict, thresholds_mb, cycle_times_ms, steps: int = 8, world: int = 2,
                 threads: int = 1, launcher: str = "horovodrun", timeout: float = 180) -> list[dict]:
    """Train `steps` steps at every HOROVOD_FUSION_THRESHOLD (MiB) x HOROVOD_CYCLE_TIME (ms) of the grid, one
    Horovod job each (Horovod reads both when it starts, and cannot start twice in one process), each with its
    timeline in `<out_dir>/fusion-<MiB>mb-cycle-<ms>ms/timeline.json`. Returns one row per point:
    threshold_mb, cycle_ms, run_dir, timeline, and step_ms_rank0: rank 0's median ms per step on its own clock.
    A finished job's ranks are left to exit while the next job starts (they only tear down by then)."""
    from ..launch.spmd import SpmdPool
    points, closing = [], []
    try:
        for mb in thresholds_mb:
            for ms in cycle_times_ms:
                run_dir = Path(out_dir).resolve() / f"fusion-{mb:g}mb-cycle-{ms:g}ms"
                timeline = run_dir / "timeline.json"
                env = {"HOROVOD_FUSION_THRESHOLD": str(int(mb * 2**20)), "HOROVOD_CYCLE_TIME": f"{ms:g}",
                       "HOROVOD_TIMELINE": str(timeline), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
                pool = SpmdPool(world, launcher=launcher, init="none", threads=threads, run_dir=run_dir, env=env)
                try:
                    ranks = pool.run("scalelab.experiments.horovod_port:train_sweep_point", timeout=timeout,
                                     spec=spec, steps=steps)
                finally:
                    closing.append(threading.Thread(target=pool.close, daemon=True))
                    closing[-1].start()
                points.append({"threshold_mb": mb, "cycle_ms": ms, "run_dir": str(run_dir), "timeline": str(timeline),
                               "step_ms_rank0": 1e3 * statistics.median(ranks[0]["step_s"])})
    finally:
        for thread in closing:
            thread.join()  # the timelines are complete, and no rank outlives the sweep
    return points


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
