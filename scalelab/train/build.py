"""The one builder of what a training run trains: the spec's model (its initial weights from a seed), its optimizer
at the scaled peak learning rate, and the autocast context of its precision. The training loop, Horovod elastic's
loop and the labs' in-process experiments all build with these, so a lab's measurement and an engine run of the
same spec start from the same model."""
from __future__ import annotations

import contextlib

import torch

from .models import build_model
from .optim import build_optimizer, scaled_lr


def build_training(spec, dataset, device: torch.device, seed: int):
    """(model on `device`, optimizer, peak learning rate) for `spec` and its `dataset` (a TensorDataset of fields and
    labels), the model's initial weights from `seed` (the engine passes the grading's nonce mixed in)."""
    x0, _ = dataset[0]
    classes = int(dataset.tensors[1].max()) + 1
    model = build_model(spec.model, x0.shape[0], x0.shape[-1], classes, seed).to(device)
    peak_lr = scaled_lr(spec.optim, spec.global_batch)
    return model, build_optimizer(spec.optim, model, peak_lr), peak_lr


def autocast_for(precision: str, device: torch.device):
    """The autocast context for fp32 (none), bf16 or fp16 on this device."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


__all__ = ["autocast_for", "build_training"]
