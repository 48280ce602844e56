"""Optimizers and the learning-rate schedule: scaling with the global batch, then linear warm-up."""
from __future__ import annotations

import math

import torch


def scaled_lr(optim, global_batch: int) -> float:
    """The peak learning rate: `lr` tuned at `base_batch`, scaled to `global_batch` by the rule."""
    ratio = global_batch / optim.base_batch
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optim.lr_scaling]
    return optim.lr * factor


def lr_at(step: int, peak: float, warmup_steps: int, schedule: str = "constant", total_steps: int = 0,
          min_lr_fraction: float = 0.0, poly_power: float = 2.0) -> float:
    """Learning rate for 0-based `step`: linear warm-up over `warmup_steps` (Goyal et al. 2017), then the schedule:
    constant, cosine (Loshchilov & Hutter 2017) or poly (peak x (1 - progress)^power), both ending at
    min_lr_fraction x peak on the last step (total_steps - 1). A "module:function" schedule is called as
    function(step, total_steps, peak, warmup_steps) -> lr, warm-up included (see `schedule_function`)."""
    if ":" in schedule:
        return float(schedule_function(schedule)(step, total_steps, peak, warmup_steps))
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    span = max(total_steps - 1 - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    low = min_lr_fraction * peak
    if schedule == "cosine":
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "poly":
        return low + (peak - low) * (1 - progress) ** poly_power
    raise ValueError(f"optim.schedule: unknown schedule {schedule!r}")


def schedule_function(ref: str):
    """The schedule a "module:function" reference names (imported from the run's code/ folder or sys.path)."""
    from ..run.user_code import resolve_code
    return resolve_code(ref, "optim.schedule")


def lr_of(optim, step: int, peak: float, total_steps: int) -> float:
    """`lr_at` with the spec's schedule fields."""
    return lr_at(step, peak, optim.warmup_steps, optim.schedule, total_steps, optim.min_lr_fraction, optim.poly_power)


def build_optimizer(optim, model: torch.nn.Module, peak_lr: float) -> torch.optim.Optimizer:
    """The optimizer the spec names for `model`'s parameters; LARS and LAMB come from pytorch-optimizer, K-FAC
    from scalelab.train.kfac (it hooks the model's layers, so it takes the model, not a parameter list)."""
    if optim.name == "kfac":
        from .kfac import KFAC
        if not isinstance(model, torch.nn.Module):
            raise TypeError("optim.name=kfac needs the model (it hooks its layers), not a list of parameters")
        factor_fn = None
        if ":" in optim.kfac_factor:
            from ..run.user_code import resolve_code
            factor_fn = resolve_code(optim.kfac_factor, "optim.kfac_factor")
        return KFAC(model, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay,
                    damping=optim.kfac_damping, factor_every=optim.kfac_factor_every, inv_every=optim.kfac_inv_every,
                    kl_clip=optim.kfac_kl_clip, grad_worker_fraction=optim.kfac_grad_worker_fraction,
                    factor_fn=factor_fn)
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    if optim.name == "adamw":
        return torch.optim.AdamW(params, lr=peak_lr, betas=(optim.momentum, 0.999), weight_decay=optim.weight_decay,
                                 fused=True if optim.fused else None)
    import pytorch_optimizer as po
    if optim.name == "lars":
        return po.LARS(params, lr=peak_lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    return po.Lamb(params, lr=peak_lr, betas=(optim.momentum, 0.999), weight_decay=optim.weight_decay)
