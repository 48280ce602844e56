"""Streaming packed shards: whole shards in one large read each, samples shuffled within a window of shards.

Random access (one positioned read per sample, `ShardDataset[i]`) keeps the exact order of a global shuffle
but pays a call per sample. Streaming reads each shard with one sequential read into a reused buffer and
slices samples out of it, so a loader runs at close to the disk's (or the file system's) sequential
bandwidth. The price is a weaker shuffle: shards are shuffled per epoch and samples only within a window of
`window` shards, which is what WebDataset-style and FanStore-style loaders do at scale.

    stream = ShardStream(open_dataset("data/shards"), batch=256, rank=0, world=2, seed=0)
    stream.set_epoch(1)
    for x, y in stream: ...
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from .formats import ShardDataset, shard_name


class ShardStream:
    """Batches from this rank's shards (shard k goes to rank k % world after the epoch's shuffle)."""

    def __init__(self, dataset: ShardDataset, batch: int, rank: int = 0, world: int = 1, seed: int = 0,
                 window: int = 2, shuffle: bool = True):
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"ShardStream reads packed shards, got a {type(dataset).__name__}")
        self.ds, self.batch, self.rank, self.world = dataset, batch, rank, world
        self.seed, self.window, self.shuffle = seed, max(1, window), shuffle
        self.epoch = 0
        self._buffers: list[bytearray] = [bytearray() for _ in range(self.window)]  # one per shard in a window

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle shards and samples differently in the next iteration (same seed: same order)."""
        self.epoch = epoch

    def my_shards(self) -> list[int]:
        """The shards this rank reads this epoch, in reading order."""
        shards = np.arange(self.ds.shard_count())
        if self.shuffle:
            shards = np.random.default_rng((self.seed, self.epoch)).permutation(shards)
        return [int(k) for k in shards[self.rank::self.world]]

    def read_shard(self, k: int, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """All samples of shard `k` (x, y), from one sequential read into buffer `slot` (reused: the x it
        returns is only valid until that slot is read into again)."""
        members = self.ds.shard_members(k)
        size = int(self.ds.offset[members[-1]] + self.ds.length[members[-1]]) if len(members) else 0
        if len(self._buffers[slot]) < size:
            self._buffers[slot] = bytearray(size)
        view = memoryview(self._buffers[slot])[:size]
        self.ds.store.readinto(shard_name(k), view, 0, keep_open=True)
        if self.ds.compressed:
            x = np.stack([np.frombuffer(zlib.decompress(view[o:o + n]), dtype=self.ds.dtype)
                          for o, n in zip(self.ds.offset[members], self.ds.length[members])])
        else:  # a view on the buffer: the batch gather below is the only copy
            x = np.frombuffer(view, dtype=self.ds.dtype)
        return x.reshape(len(members), *self.ds.shape), self.ds.labels[members]

    def __iter__(self):
        rng = np.random.default_rng((self.seed, self.epoch, self.rank, 1))
        shards = self.my_shards()
        carry_x, carry_y = None, None
        for w in range(0, len(shards), self.window):
            parts = [self.read_shard(k, slot) for slot, k in enumerate(shards[w:w + self.window])]
            xs = [p[0] for p in parts] if len(parts) > 1 or carry_x is not None else None
            x, y = (np.concatenate(xs), np.concatenate([p[1] for p in parts])) if xs else parts[0]
            if carry_x is not None:
                x, y = np.concatenate([carry_x, x]), np.concatenate([carry_y, y])
            idx = rng.permutation(len(x)) if self.shuffle else np.arange(len(x))
            whole = len(idx) - len(idx) % self.batch
            for k in range(0, whole, self.batch):
                take = idx[k:k + self.batch]
                yield torch.from_numpy(x[take]), torch.from_numpy(y[take])
            rest = idx[whole:]
            carry_x, carry_y = (x[rest].copy(), y[rest]) if len(rest) else (None, None)

    def __len__(self) -> int:
        """Whole batches this rank yields per epoch."""
        return sum(len(self.ds.shard_members(k)) for k in self.my_shards()) // self.batch


__all__ = ["ShardStream"]
