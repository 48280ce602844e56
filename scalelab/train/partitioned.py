"""What strategies whose ranks hold parts of the model share (train/mesh.py): a part is not a replica, so nothing
is averaged between micro-batches, and without data parallelism the optimizer applies this rank's gradients as
they are (a mesh with dp > 1 averages them over the ranks holding the same part first). A subclass sets
`self.base` (the data-parallel strategy whose process group it uses).
"""
from __future__ import annotations

import contextlib

from .strategy import Strategy


class PartitionedModelStrategy(Strategy):
    """The training-loop hooks that are the same when every rank holds a different part of the model."""

    base = None

    def no_sync(self, model):
        """Parts are not replicas: nothing to synchronise between micro-batches."""
        return contextlib.nullcontext()

    def step(self, optimizer, scaler=None) -> None:
        """Apply this rank's gradients (its part's, and those of layers every rank holds alike)."""
        optimizer.step()

    def take_comm_time(self) -> float:
        """The communication runs inside the forward/backward (or the schedule's step): not separated here."""
        return 0.0

    def mean(self, value: float) -> float:
        """Average a scalar over ranks."""
        return self.base.mean(value)

    def barrier(self) -> None:
        """Wait for every rank."""
        self.base.barrier()

    def shutdown(self) -> None:
        """Leave the process group."""
        self.base.shutdown()


__all__ = ["PartitionedModelStrategy"]
