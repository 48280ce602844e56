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
