"""Lab 09: optimisation at scale — LARS written out (the per-layer trust ratio), time-to-accuracy across batch
sizes and optimizers, and K-FAC distributed the KAISA way (`scalelab.train.kfac`).

    ratios = trust_ratios(model)                                  # per layer: eta |w| / (|g| + wd |w|)
    rows = time_to_accuracy(spec, [{"optimizer": "sgd", "batch": 32, "lr": 0.05}, ...], target=0.8)
    ranks = run_spmd("scalelab.experiments.optimization:kfac_trajectory", world=2, kwargs={"fraction": 0.5})
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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
                        "curve": curve, "target": target, "reached": hit})
    return out
