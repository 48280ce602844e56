"""The Strategy contract: everything the training loop (train/loop.py) asks of a way of sharing work between ranks.

A strategy is made with (spec, info, device) and the loop calls, in order: setup(); wrap(model, optimizer) (before
a resume's restore when `shards_state`, after it otherwise); checkpointer(...); for each step no_sync(model) or,
when `pipelined`, forward_backward(...); step(optimizer, scaler); take_comm_time(); mean() and barrier() where the
ranks must agree; evaluate(...); full_state_dict(model) at the end; shutdown(). The defaults here are those of a
replica strategy (every rank holds the whole model and reads its own share of each batch); DDP, Horovod, FSDP,
forward recovery and the tp/pp/3d mesh override what differs, so the loop never asks a strategy what it can do.
"""
from __future__ import annotations

import contextlib

import torch

from ..ckpt import build_checkpointer


class Strategy:
    """The hooks of the training loop, with a replica strategy's defaults."""

    name = ""
    backend = "gloo"
    wait = "none"
    """How this rank waits for its last collective: spin, block, or none."""
    pipelined = False
    """True when forward_backward runs each batch's micro-batches (a pipeline schedule) instead of the loop."""
    shards_state = False
    """True when wrap() shards parameters and optimizer state: a resume restores into the wrapped model."""

    def __init__(self, spec, info, device):
        self.spec, self.info, self.device = spec, info, device

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(replica, replicas): which share of each global batch this rank reads."""
        return self.info.rank, self.info.world_size

    def setup(self) -> None:
        """Join the ranks' process group (nothing to join by default)."""

    def wrap(self, model, optimizer):
        """The model and optimizer as this strategy trains them (unchanged by default)."""
        return model, optimizer

    def checkpointer(self, ckpt, directory):
        """The checkpointer of the spec's `checkpoint` section for this rank."""
        return build_checkpointer(ckpt, directory, self.info.rank, self.info.world_size)

    def no_sync(self, model):
        """A context in which a micro-batch's backward does not synchronise gradients (nothing to skip by default)."""
        return contextlib.nullcontext()

    def forward_backward(self, model, x, y, accum: int) -> torch.Tensor:
        """A pipelined strategy's whole step of forwards and backwards; returns the loss (pipelined only)."""
        raise NotImplementedError(f"{type(self).__name__} is not pipelined: the loop runs forward and backward")

    def step(self, optimizer, scaler=None) -> None:
        """Synchronise what must be and apply the optimizer."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def take_comm_time(self) -> float:
        """Seconds spent waiting for communication since the last call (none measured by default)."""
        return 0.0

    def mean(self, value: float) -> float:
        """`value` averaged over the ranks."""
        raise NotImplementedError(f"{type(self).__name__} must implement mean()")

    def barrier(self) -> None:
        """Wait for every rank."""
        raise NotImplementedError(f"{type(self).__name__} must implement barrier()")

    def shutdown(self) -> None:
        """Leave the process group."""
        raise NotImplementedError(f"{type(self).__name__} must implement shutdown()")

    def full_state_dict(self, model) -> dict:
        """The whole model's parameters, as model.pt holds them (every rank holds them all by default)."""
        return model.state_dict()

    @torch.no_grad()
    def evaluate(self, model, x, y, autocast=None) -> float:
        """Accuracy on the evaluation set (x, y): each rank scores every world_size-th sample, averaged over ranks."""
        x, y = x[self.info.rank::self.info.world_size], y[self.info.rank::self.info.world_size]
        model.eval()
        with autocast or contextlib.nullcontext():
            correct = (model(x).argmax(dim=1) == y).float().mean().item() if len(y) else 0.0
        model.train()
        return self.mean(correct)


__all__ = ["Strategy"]
