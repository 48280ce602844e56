"""Lab 09: optimisation at scale — LARS written out (the per-layer trust ratio), time-to-accuracy across batch
sizes and optimizers, and K-FAC distributed the KAISA way (`scalelab.train.kfac`).

    ratios = trust_ratios(model)                                  # per layer: eta |w| / (|g| + wd |w|)
    race_rows = time_to_target(spec, [{"optimizer": "sgd", "batch": 32, "lr": 0.05}, ...], target=0.8, samples=8000)
    ranks = run_spmd("scalelab.experiments.optimization:kfac_trajectory", world=2, kwargs={"fraction": 0.5})
    times = step_times_on_ranks(spec, race_rows, ranks=[1, 2], out_dir="runs/on-ranks", steps=6)   # engine runs
    table = time_to_accuracy_on_ranks(race_rows, times)          # steps to the target (B) x step time (B, N)
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..machine import usable_cpus
from ..train.kfac import KFAC


# -- K-FAC / KAISA on ranks ---------------------------------------------------------------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _kfac_problem(seed: int, batch: int, width: int):
    """A small classification MLP and one fixed global batch with features on very different scales."""
    torch.manual_seed(seed)
    scale = torch.logspace(0, 2, 16)
    x = torch.randn(batch, 16) * scale
    y = (x / scale).sum(1).gt(0).long() + 2 * (x[:, 0] / scale[0]).gt(0.5).long()
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    return model, x, y


def kfac_trajectory(steps: int = 4, fraction: float = 1.0, seed: int = 0, batch: int = 32, width: int = 24,
                    lr: float = 0.1) -> dict:
    """K-FAC on this rank's slice of one global batch, gradients averaged over the ranks by hand (what DDP does):
    the parameters after `steps`, the losses of the global batch, and the optimizer's `stats()`. On W ranks the
    result equals one process's on the whole batch, whatever `fraction` (KAISA changes who computes, not what)."""
    torch.set_num_threads(1)
    rank, world = _rank_world()
    model, x, y = _kfac_problem(seed, batch, width)
    part = slice(rank * batch // world, (rank + 1) * batch // world)
    opt = KFAC(model, lr=lr, momentum=0.9, damping=0.01, inv_every=2, grad_worker_fraction=fraction)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x[part]), y[part])
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            t = loss.detach().clone()
            dist.all_reduce(t)
            loss = t / world
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"params": params[:: max(1, params.numel() // 200)].tolist(), "losses": losses, "stats": opt.stats(),
            "rank": rank, "world": world, "pid": os.getpid()}


def kfac_cost(steps: int = 20, fraction: float = 1.0, width: int = 256, batch: int = 64, seed: int = 0) -> dict:
    """Seconds per step, bytes held and bytes sent per rank for one grad-worker fraction (KAISA's knob)."""
    torch.set_num_threads(1)
    rank, world = _rank_world()
    model, x, y = _kfac_problem(seed, batch * world, width)
    part = slice(rank * batch, (rank + 1) * batch)
    opt = KFAC(model, lr=0.05, inv_every=5, grad_worker_fraction=fraction)
    t0 = time.perf_counter()
    for _ in range(steps):
        F.cross_entropy(model(x[part]), y[part]).backward()
        for p in model.parameters():
            if world > 1:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        opt.zero_grad()
    return {"fraction": fraction, "step_s": (time.perf_counter() - t0) / steps, **opt.stats()}


def kfac_dims(width: int = 256) -> list[tuple[int, int]]:
    """(inputs incl. the bias' 1, outputs) of each layer K-FAC preconditions in kfac_cost's model."""
    model, _, _ = _kfac_problem(0, 2, width)
    return [(m.in_features + 1, m.out_features) for m in model if isinstance(m, nn.Linear)]


# -- LARS by hand --------------------------------------------------------------------------------------------
class LarsByHand(torch.optim.Optimizer):
    """LARS (You et al. 2017) with the trust ratio computed by a function the student writes:

        ratio = trust_ratio(|w|, |g|, eta, weight_decay)     for every weight matrix (ndim > 1)
        d = (g + weight_decay w) * ratio;  buf = momentum buf + d;  w -= lr buf

    Biases and norms (ndim 1) get plain SGD with momentum, as in pytorch-optimizer's LARS. Every ratio is kept in
    `ratios[name]`, one per step, for the per-layer plot."""

    def __init__(self, named_params, trust_ratio, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001):
        named = list(named_params)
        super().__init__([p for _, p in named], {"lr": lr})
        self.names = {id(p): n for n, p in named}
        self.trust_ratio, self.momentum, self.weight_decay, self.eta = trust_ratio, momentum, weight_decay, eta
        self.ratios: dict[str, list[float]] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if p.ndim > 1:
                    w_norm, g_norm = float(p.norm()), float(p.grad.norm())
                    ok = w_norm > 0 and g_norm + self.weight_decay * w_norm > 0
                    ratio = float(self.trust_ratio(w_norm, g_norm, self.eta, self.weight_decay)) if ok else 1.0
                    self.ratios.setdefault(self.names[id(p)], []).append(ratio)
                    d = (p.grad + self.weight_decay * p) * ratio
                buf = self.state[p].get("buf")
                buf = d.clone() if buf is None else buf.mul_(self.momentum).add_(d)
                self.state[p]["buf"] = buf
                p.add_(buf, alpha=-group["lr"])


def lars_by_hand(spec, trust_ratio, steps: int = 20, batch: int = 256, lr: float = 1.0, eta: float = 0.001,
                 weight_decay: float = 1e-4) -> dict:
    """Train the spec's model twice from the same start on the same batches: with LarsByHand(trust_ratio) and
    with pytorch-optimizer's LARS. Returns the largest parameter difference, both loss curves and the per-layer
    trust ratios per step."""
    import pytorch_optimizer as po
    from ..data import build_dataset
    from .large_batch import one_thread
    from ._common import build_workload
    with one_thread():
        dataset = build_dataset(spec.data, spec.seed)
        mine, ref = (build_workload(spec.with_overrides({"world.workers_per_node": 1}), torch.device("cpu"), dataset)
                     for _ in range(2))
        opt_mine = LarsByHand(mine.model.named_parameters(), trust_ratio, lr, momentum=0.9,
                              weight_decay=weight_decay, eta=eta)
        opt_ref = po.LARS(ref.model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay,
                          trust_coefficient=eta)
        g = torch.Generator().manual_seed(spec.seed)
        x_all, y_all = dataset.tensors
        curves = {"mine": [], "library": []}
        for _ in range(steps):
            idx = torch.randint(0, len(x_all), (batch,), generator=g)
            for key, wl, opt in (("mine", mine, opt_mine), ("library", ref, opt_ref)):
                loss = F.cross_entropy(wl.model(x_all[idx]), y_all[idx])
                loss.backward()
                opt.step()
                opt.zero_grad()
                curves[key].append(float(loss))
        diff = max(float((a - b).abs().max()) for a, b in zip(mine.model.parameters(), ref.model.parameters()))
    return {"max_param_diff": diff, "losses": curves, "ratios": opt_mine.ratios, "steps": steps, "batch": batch,
            "lr": lr, "eta": eta, "weight_decay": weight_decay}


# -- time to accuracy ----------------------------------------------------------------------------------------
def time_to_target(spec, runs: list[dict], target: float, samples: int, evals: int = 16) -> list[dict]:
    """Train each run (optimizer, batch, lr, warmup_steps and optim.kfac_* overrides under "set") from the
    spec's start for `samples` samples, evaluating `evals` times; returns per run the curve of (samples, train
    seconds, accuracy) and the samples, steps and seconds at which held-out accuracy first reached `target`
    (None if never). Training seconds exclude the evaluations."""
    from ..data import build_dataset
    from ..train.optim import build_optimizer, lr_at
    from .large_batch import evaluate, one_thread
    from ._common import build_workload
    dataset = build_dataset(spec.data, spec.seed)
    out = []
    with one_thread():
        for run in runs:
            batch, lr = run["batch"], float(run["lr"])
            s = spec.with_overrides({"optim.name": run["optimizer"], "optim.batch_per_worker": batch, "optim.lr": lr,
                                     "optim.lr_scaling": "none", "optim.warmup_steps": 0,
                                     "world.workers_per_node": 1, **run.get("set", {})})
            wl = build_workload(s, torch.device("cpu"), dataset)
            opt = build_optimizer(s.optim, wl.model, lr)
            steps = max(1, samples // batch)
            every = max(1, steps // evals)
            g = torch.Generator().manual_seed(spec.seed)
            x_all, y_all = dataset.tensors
            curve, train_s, hit = [], 0.0, None
            for step in range(steps):
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, lr, run.get("warmup_steps", 0))
                idx = torch.randint(0, len(x_all), (batch,), generator=g)
                t0 = time.perf_counter()
                F.cross_entropy(wl.model(x_all[idx]), y_all[idx]).backward()
                opt.step()
                opt.zero_grad()
                train_s += time.perf_counter() - t0
                if (step + 1) % every == 0 or step == steps - 1:
                    _, acc = evaluate(wl.model, s)
                    curve.append({"samples": (step + 1) * batch, "seconds": train_s, "accuracy": acc})
                    if hit is None and acc >= target:
                        hit = {"samples": (step + 1) * batch, "steps": step + 1, "seconds": train_s}
            label = run.get("label") or f"{run['optimizer']} b{batch}"
            out.append({"label": label, "optimizer": run["optimizer"], "batch": batch, "lr": lr, "steps": steps,
                        "seconds_per_step": train_s / steps, "final_accuracy": curve[-1]["accuracy"],
                        "curve": curve, "target": target, "reached": hit, "set": dict(run.get("set", {}))})
    return out


# -- time to accuracy on N ranks -----------------------------------------------------------------------------
def engine_step_s(events: list[dict]) -> float:
    """A run's seconds per step from its own events: rank 0's mean `step_s - data_s` (the step's compute and
    communication, the wait for the loader left out), its first step(s) left out as the engine's throughput leaves
    them out (`run.metrics.warmup_skip`: process-group set-up, allocator warm-up). Why without the loader's wait:
    over a few steps on a busy machine one step that waited for the loader (hundreds of ms of `data_s`, where a
    step computes in a few) is most of the mean; the mean, not the median, so that K-FAC's eigendecompositions
    (every `kfac_inv_every` steps) count at their share."""
    from ..run.metrics import warmup_skip
    steps = sorted((e for e in events if e.get("type") == "step" and e.get("rank") == 0), key=lambda e: e["step"])
    measured = steps[warmup_skip(len(steps)):]
    if not measured:
        raise ValueError("the run wrote no step events on rank 0: no step time to read")
    return sum(e["step_s"] - e.get("data_s", 0.0) for e in measured) / len(measured)


def step_times_on_ranks(spec, rows: list[dict], ranks: list[int], out_dir, steps: int, device: str = "cpu",
                        processes: int | None = None, timeout: float = 300) -> list[dict]:
    """One engine run of `spec` (DDP) per race row that reached its target and per rank count N in `ranks`: the
    row's optimizer, its "set" overrides (K-FAC's) and its global batch B, split B / N per rank, for `steps`
    steps. Runs go side by side, at most `processes` ranks measuring at once (by default as many as this machine
    has cores, up to 4: one rank per core, so no run measures a step on a shared core; on 2 cores two 1-rank runs
    or one 2-rank run),
    the next starting as one has written its last event: a run's start-up and wind-down (imports, process group)
    are most of its seconds at these sizes, and each run's step time is then measured beside about as many ranks
    as any other's. Returns per run, in the order of `rows` then `ranks`: label, optimizer, batch, ranks, run_dir
    and step_s (`engine_step_s` of its events). A row that never reached the target needs no step time: it is
    skipped."""
    from ..launch import launch
    processes = processes or max(1, min(4, usable_cpus()))
    todo = []
    for row in rows:
        if not row["reached"]:
            continue
        for n in ranks:
            if row["batch"] % n:
                raise ValueError(f"{row['label']}: global batch {row['batch']} does not split over {n} ranks; "
                                 "pick rank counts that divide every batch")
            name = f"{row['label'].replace(' ', '-')}-n{n}"
            todo.append((row, n, spec.with_overrides({
                "name": f"lab09-{name}", "output_dir": str(Path(out_dir) / name), "device": device, "steps": steps,
                "log_every": 1, "world.workers_per_node": n, "world.threads_per_worker": 1,
                "optim.name": row["optimizer"], "optim.batch_per_worker": row["batch"] // n, "optim.lr": row["lr"],
                "optim.lr_scaling": "none", "optim.warmup_steps": 0, **row.get("set", {})})))
    out: dict[int, dict] = {}
    for i, run in _side_by_side([(n, one) for _, n, one in todo], processes, timeout, launch):
        row, n, _ = todo[i]
        out[i] = {"label": row["label"], "optimizer": row["optimizer"], "batch": row["batch"], "ranks": n,
                  "run_dir": str(run.run_dir), "step_s": engine_step_s(run.events())}
    return [out[i] for i in sorted(out)]


def _side_by_side(todo: list[tuple[int, object]], processes: int, timeout: float, launch):
    """Launch each (ranks, spec) of `todo`, fewest ranks first, with at most `processes` ranks measuring at once (a
    run larger than that alone): the next starts as soon as one has written every rank's `end` event (its step
    events are all written; what is left is the processes winding down, seconds on a busy machine), not when a
    whole group has. Yields (index, run) for each such run; every run is waited for before the generator ends, and
    one that fails or outlives `timeout` stops the others and raises."""
    from ..run.handle import ACTIVE

    def ended(run, n: int) -> bool:
        return run.poll() not in ACTIVE or len({e.get("rank") for e in run.events() if e["type"] == "end"}) >= n

    pending = sorted(range(len(todo)), key=lambda i: todo[i][0])
    active: dict[int, tuple[object, float]] = {}
    winding: list = []
    try:
        while pending or active:
            while pending and (not active or sum(todo[i][0] for i in active) + todo[pending[0]][0] <= processes):
                i = pending.pop(0)
                active[i] = (launch(todo[i][1]), time.monotonic())
            for i, (run, t0) in list(active.items()):
                if ended(run, todo[i][0]):
                    del active[i]
                    winding.append((run, t0))
                    if run.poll() not in ACTIVE:
                        run.wait(timeout=0)  # raises RunFailed where it failed
                    yield i, run
                elif time.monotonic() - t0 > timeout:
                    run.wait(timeout=0)  # raises RunTimeout
            time.sleep(0.05)
        for run, t0 in winding:
            run.wait(timeout=max(timeout - (time.monotonic() - t0), 1.0))
    finally:
        for run, _ in list(active.values()) + winding:  # one failed or timed out: the others stop too
            if run.poll() in ACTIVE:
                run.stop()


def time_to_accuracy_on_ranks(race: list[dict], step_times: list[dict]) -> list[dict]:
    """time_to_target(B, N) = steps_to_target(B) x step_time(B, N). N ranks of B / N samples compute the gradient
    of one batch of B (lab 02), so the steps a run needs to reach the target depend on the global batch B and the
    optimizer, not on N: they come from the in-process `race` (`time_to_target`'s rows); the seconds each step
    takes on N ranks come from engine runs (`step_times_on_ranks`). One row per step time, in its order: label,
    optimizer, batch, ranks, steps, step_s, seconds and run_dir; a label the race never ran is an error."""
    by_label = {row["label"]: row for row in race}
    out = []
    for st in step_times:
        row = by_label.get(st["label"])
        if row is None:
            raise ValueError(f"step time for {st['label']!r}, which the race did not run: labels {sorted(by_label)}")
        if row["batch"] != st["batch"] or row["optimizer"] != st["optimizer"]:
            raise ValueError(f"{st['label']!r}: the race ran {row['optimizer']} at batch {row['batch']}, the step "
                             f"time is of {st['optimizer']} at batch {st['batch']}")
        steps = row["reached"]["steps"] if row["reached"] else None
        out.append({"label": st["label"], "optimizer": st["optimizer"], "batch": st["batch"], "ranks": st["ranks"],
                    "steps": steps, "step_s": st["step_s"], "seconds": None if steps is None else steps * st["step_s"],
                    "run_dir": st.get("run_dir")})
    return out
