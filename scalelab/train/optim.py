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


def build_optimizer(optim, model: torch.nn.Module, peak_lr: float) -> torch.optim.Optimizer:
    """The optimizer the spec names for `model`'s parameters; LARS and LAMB come from pytorch-optimizer, K-FAC
    from scalelab.train.kfac (it hooks the model's layers, so it takes the model, not a parameter list)."""
    if optim.name == "kfac":
        from .kfac import KFAC
        if not isinstance(model, torch.nn.Module):
            raise TypeError("optim.name=kfac needs the model (it hooks its layers), not a list of parameters")
        return KFAC(model, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay,
                    damping=optim.kfac_damping, factor_every=optim.kfac_factor_every, inv_every=optim.kfac_inv_every,
                    kl_clip=optim.kfac_kl_clip, grad_worker_fraction=optim.kfac_grad_worker_fraction)
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    if optim.name == "adamw":
        return torch.optim.AdamW(params, lr=peak_lr, betas=(optim.momentum, 0.999), weight_decay=optim.weight_decay)
    import pytorch_optimizer as po
    if optim.name == "lars":
        return po.LARS(params, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    return po.Lamb(params, lr=peak_lr, betas=(optim.momentum, 0.999), weight_decay=optim.weight_decay)
