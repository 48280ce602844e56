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
        self._buffer = bytearray()  # one window of shards, back to back, reused from window to window

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle shards and samples differently in the next iteration (same seed: same order)."""
        self.epoch = epoch

    def my_shards(self) -> list[int]:
        """The shards this rank reads this epoch, in reading order."""
        shards = np.arange(self.ds.shard_count())
        if self.shuffle:
            shards = np.random.default_rng((self.seed, self.epoch)).permutation(shards)
        return [int(k) for k in shards[self.rank::self.world]]

    def _shard_bytes(self, k: int) -> int:
        members = self.ds.shard_members(k)
        return int(self.ds.offset[members[-1]] + self.ds.length[members[-1]]) if len(members) else 0

    def read_window(self, shards: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """All samples of `shards` (x, y): one sequential read per shard, into one reused buffer. Uncompressed,
        x is a view on that buffer, valid until the next window is read."""
        sizes = [self._shard_bytes(k) for k in shards]
        if len(self._buffer) < sum(sizes):
            self._buffer = bytearray(sum(sizes))
        view = memoryview(self._buffer)[:sum(sizes)]
        pos = 0
        for k, size in zip(shards, sizes):
            self.ds.store.readinto(shard_name(k), view[pos:pos + size], 0, keep_open=True)
            pos += size
        members = np.concatenate([self.ds.shard_members(k) for k in shards])
        if self.ds.compressed:
            starts = np.cumsum([0] + sizes[:-1])
            base = np.repeat(starts, [len(self.ds.shard_members(k)) for k in shards])
            x = np.stack([np.frombuffer(zlib.decompress(view[b + o:b + o + n]), dtype=self.ds.dtype)
                          for b, o, n in zip(base, self.ds.offset[members], self.ds.length[members])])
        else:  # a view: the batch gather below is the only copy of the data
            x = np.frombuffer(view, dtype=self.ds.dtype)
        return x.reshape(len(members), *self.ds.shape), self.ds.labels[members]

    def __iter__(self):
        rng = np.random.default_rng((self.seed, self.epoch, self.rank, 1))
        shards = self.my_shards()
        carry_x, carry_y = np.empty((0, *self.ds.shape), self.ds.dtype), np.empty(0, np.int64)
        for w in range(0, len(shards), self.window):
            x, y = self.read_window(shards[w:w + self.window])
            idx = rng.permutation(len(x)) if self.shuffle else np.arange(len(x))
            # the samples left over from the last window fill the first batch of this one
            first = self.batch - len(carry_x)
            if len(idx) >= first:
                take = idx[:first]
                yield (torch.from_numpy(np.concatenate([carry_x, x[take]])),
                       torch.from_numpy(np.concatenate([carry_y, y[take]])))
                idx = idx[first:]
                carry_x, carry_y = carry_x[:0], carry_y[:0]
            whole = len(idx) - len(idx) % self.batch
            rows = x.reshape(len(x), -1)  # take() on rows of a 2-D array is about twice as fast as on 4-D
            for k in range(0, whole, self.batch):
                take = idx[k:k + self.batch]
                yield torch.from_numpy(rows.take(take, axis=0).reshape(-1, *self.ds.shape)), torch.from_numpy(y[take])
            rest = idx[whole:]  # copied out: the buffer is about to be overwritten
            carry_x, carry_y = np.concatenate([carry_x, x[rest]]), np.concatenate([carry_y, y[rest]])

    def __len__(self) -> int:
        """Whole batches this rank yields per epoch."""
        return sum(len(self.ds.shard_members(k)) for k in self.my_shards()) // self.batch


__all__ = ["ShardStream"]
