"""What every experiment needs: the engine's model, data and optimizer for a RunSpec (and a GPU sync for timers)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data import build_dataset
from ..train.build import autocast_for, build_training  # noqa: F401  (autocast_for: the labs' experiments use it)
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
    model, optimizer, _ = build_training(spec, dataset, device, spec.seed)
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


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so a timer measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
