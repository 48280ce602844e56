"""Optimizers and the learning-rate schedule: scaling with the global batch, then linear warm-up."""
from __future__ import annotations

import math

import torch


def scaled_lr(optim, global_batch: int) -> float:
    """The peak learning rate: `lr` tuned at `base_batch`, scaled to `global_batch` by the rule."""
    ratio = global_batch / optim.base_batch
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optim.lr_scaling]
    return optim.lr * factor


def lr_at(step: int, peak: float, warmup_steps: int) -> float:
    """Learning rate for 0-based `step`: linear warm-up over `warmup_steps` (Goyal et al. 2017), then constant."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak


def build_optimizer(optim, params, peak_lr: float) -> torch.optim.Optimizer:
    """The optimizer the spec names; LARS and LAMB come from pytorch-optimizer."""
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    if optim.name == "adamw":
        return torch.optim.AdamW(params, lr=peak_lr, betas=(optim.momentum, 0.999), weight_decay=optim.weight_decay)
    import pytorch_optimizer as po
    if optim.name == "lars":
        return po.LARS(params, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    return po.Lamb(params, lr=peak_lr, betas=(optim.momentum, 0.999), weight_decay=optim.weight_decay)
