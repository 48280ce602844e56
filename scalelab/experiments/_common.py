"""What every experiment needs: the engine's model, data and optimizer for a RunSpec (and a GPU sync for timers)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data import build_dataset
from ..train.models import build_model
from ..train.optim import build_optimizer, scaled_lr
from ..train.strategies import pick_device


@dataclass
class Workload:
    """A model, its optimizer and training set, built exactly as the engine builds them for `spec`."""

    spec: object
    dataset: torch.utils.data.TensorDataset
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device

    @property
    def sample_shape(self) -> tuple:
        """(C, H, W) of one sample."""
        return tuple(self.dataset.tensors[0].shape[1:])

    @property
    def classes(self) -> int:
        """Number of classes in the training set."""
        return int(self.dataset.tensors[1].max()) + 1


def build_workload(spec, device: torch.device | None = None, dataset=None) -> Workload:
    """Model, optimizer and data for `spec`, with the engine's builders and seed (dataset reused if given)."""
    device = device or pick_device(spec, 0)
    dataset = dataset if dataset is not None else build_dataset(spec.data, spec.seed)
    x0, _ = dataset[0]
    classes = int(dataset.tensors[1].max()) + 1
    model = build_model(spec.model, x0.shape[0], x0.shape[-1], classes, spec.seed).to(device)
    optimizer = build_optimizer(spec.optim, model, scaled_lr(spec.optim, spec.global_batch))
    return Workload(spec, dataset, model, optimizer, device)


def train_step(model, optimizer, x, y, autocast=None) -> float:
    """One forward, backward and optimizer step; returns the loss (a sync point on a GPU)."""
    import contextlib
    with autocast or contextlib.nullcontext():
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach().item()


def autocast_for(precision: str, device: torch.device):
    """The autocast context for fp32 (none), bf16 or fp16 on this device."""
    import contextlib
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so a timer measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
