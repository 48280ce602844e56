"""Lab 04: what a larger global batch does to optimisation, measured in one process.

Data-parallel training with N ranks of B samples computes exactly the gradient of one batch of N x B (Lab 02), so
the *optimisation* side of scaling can be studied on one rank with the global batch: that is what these functions
do, with the engine's model, data, optimizers (`scalelab.train.optim`, LARS/LAMB from pytorch-optimizer) and its
warm-up schedule. Every run sees the same number of samples (`samples`): a larger batch means fewer steps.

    rows = train_runs(spec, [{"batch": 32, "lr": 0.05}, {"batch": 512, "lr": 0.8, "warmup_steps": 3}], samples=8192)
    norms = gradient_norms(spec, small=16, big=256)
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ..data import build_dataset
from ..data.loader import build_eval_set
from ..train.optim import build_optimizer, lr_at
from ._common import build_workload


@contextlib.contextmanager
def one_thread():
    """Run tiny models on one intra-op thread (restored afterwards): for a 64-unit MLP, splitting each small
    matrix product over threads costs more in synchronisation than it gains, badly so on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _batches(dataset, batch: int, seed: int):
    """Shuffled batches forever (a seeded permutation per epoch), whole batches only."""
    n = len(dataset)
    g = torch.Generator().manual_seed(seed)
    x, y = dataset.tensors
    while True:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - batch + 1, batch):
            idx = perm[i:i + batch]
            yield x[idx], y[idx]


@torch.no_grad()
def evaluate(model, spec) -> tuple[float, float]:
    """(loss, accuracy) on the held-out set."""
    x, y = build_eval_set(spec.data, spec.seed)
    out = model(x)
    return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def train_run(spec, batch: int, lr: float, samples: int, optimizer: str = "sgd", warmup_steps: int = 0,
              dataset=None) -> dict:
    """Train from the spec's start on `samples` samples in batches of `batch` at peak `lr`; returns the result."""
    spec = spec.with_overrides({"optim.name": optimizer, "optim.batch_per_worker": batch, "optim.lr": float(lr),
                                "optim.lr_scaling": "none", "optim.warmup_steps": 0, "world.workers_per_node": 1})
    wl = build_workload(spec, device=torch.device("cpu"), dataset=dataset)
    opt = build_optimizer(spec.optim, wl.model, lr)
    steps = max(1, samples // batch)
    curve, batches = [], _batches(wl.dataset, batch, spec.seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, warmup_steps)
        x, y = next(batches)
        loss = F.cross_entropy(wl.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        curve.append(float(loss.detach()))
    eval_loss, accuracy = evaluate(wl.model, spec)
    if not math.isfinite(eval_loss):
        eval_loss = float("inf")  # diverged: a huge learning rate is a legitimate (bad) result
    return {"batch": batch, "lr": lr, "optimizer": optimizer, "warmup_steps": warmup_steps, "steps": steps,
            "eval_loss": eval_loss, "accuracy": accuracy, "train_loss_curve": curve[:: max(1, steps // 50)]}


def train_runs(spec, runs: list[dict], samples: int) -> list[dict]:
    """`train_run` for each dict of its keyword arguments (batch, lr, optimizer, warmup_steps) plus any labels
    (keys that are not arguments, e.g. "rule", are copied into the result); one dataset for all, and runs with
    the same arguments are trained once."""
    dataset = build_dataset(spec.data, spec.seed)
    args = ("batch", "lr", "optimizer", "warmup_steps")
    out, done = [], {}
    with one_thread():
        for run in runs:
            kwargs = {k: v for k, v in run.items() if k in args}
            key = tuple(sorted(kwargs.items()))
            if key not in done:  # e.g. every scaling rule gives the same lr at the base batch: train it once
                done[key] = train_run(spec, samples=samples, dataset=dataset, **kwargs)
            out.append({**{k: v for k, v in run.items() if k not in args}, **done[key]})
    return out


def gradient_norms(spec, small: int, big: int, batches: int = 8, warm_steps: int = 20) -> dict:
    """Mean squared gradient norm |g_B|^2 over `batches` batches of size `small` and of size `big`.

    Measured after `warm_steps` SGD steps (the noise scale of a freshly initialised model is not the one that
    matters). Same parameters for both sizes, so E|g_B|^2 = |G|^2 + tr(Sigma)/B holds between them.
    """
    with one_thread():
        return _gradient_norms(spec, small, big, batches, warm_steps)


def _gradient_norms(spec, small: int, big: int, batches: int, warm_steps: int) -> dict:
    """The measurement behind gradient_norms."""
    dataset = build_dataset(spec.data, spec.seed)
    wl = build_workload(spec.with_overrides({"world.workers_per_node": 1}), device=torch.device("cpu"),
                        dataset=dataset)
    it = _batches(wl.dataset, spec.optim.batch_per_worker, spec.seed)
    for _ in range(warm_steps):
        x, y = next(it)
        F.cross_entropy(wl.model(x), y).backward()
        wl.optimizer.step()
        wl.optimizer.zero_grad()
    out = {"b_small": small, "b_big": big, "batches": batches}
    for key, size in (("g2_small", small), ("g2_big", big)):
        it = _batches(wl.dataset, size, spec.seed + size)
        total = 0.0
        for _ in range(batches):
            x, y = next(it)
            wl.model.zero_grad()
            F.cross_entropy(wl.model(x), y).backward()
            total += sum(float(p.grad.pow(2).sum()) for p in wl.model.parameters())
        out[key] = total / batches
    wl.model.zero_grad()
    return out
