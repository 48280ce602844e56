"""Streaming packed shards: whole shards in one large read each, samples shuffled within a window of shards.

Random access (one positioned read per sample, `ShardDataset[i]`) keeps the exact order of a global shuffle
but pays a call per sample. Streaming takes each shard whole — mapped from the page cache when the store can
(`store.view`), else one sequential read into a reused buffer — and copies every sample once, straight to its
shuffled place in a reused batch buffer; batches are views of that buffer. One copy per byte, as a plain
read() makes, so a loader runs at the disk's (or the file system's) sequential bandwidth. The price is a weaker
shuffle: shards are shuffled per epoch and samples only within a window of `window` shards, which is what
WebDataset-style and FanStore-style loaders do at scale.

    stream = ShardStream(open_dataset("data/shards"), batch=256, rank=0, world=2, seed=0)
    stream.set_epoch(1)
    for x, y in stream: ...
"""
from __future__ import annotations

import weakref
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
        self._features = int(np.prod(self.ds.shape))
        self._pool = BatchBuffers()

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
        if self.ds.compressed:  # decoded straight into one array: no list of arrays to stack
            starts = np.repeat(np.cumsum([0] + sizes[:-1]), [len(self.ds.shard_members(k)) for k in shards])
            x = np.empty((len(members), self._features), self.ds.dtype)
            for row, (b, n) in enumerate(zip(starts + self.ds.offset[members], self.ds.length[members])):
                x[row] = np.frombuffer(zlib.decompress(view[b:b + n]), dtype=self.ds.dtype)
        else:  # a view of the buffer
            x = np.frombuffer(view, dtype=self.ds.dtype)
        return x.reshape(len(members), *self.ds.shape), self.ds.labels[members]

    def _sources(self, shards: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """The window's samples as row arrays, one per shard (views of the mapped files when the store can
        map them and the samples are stored raw), and their labels, in window order."""
        members = [self.ds.shard_members(k) for k in shards]
        row_bytes = self._features * self.ds.dtype.itemsize
        if self.ds.compressed or not hasattr(self.ds.store, "view") \
                or any(self._shard_bytes(k) != len(m) * row_bytes for k, m in zip(shards, members)):
            x, y = self.read_window(shards)
            return [x.reshape(len(x), -1)], y
        rows = [np.frombuffer(self.ds.store.view(shard_name(k)), self.ds.dtype, len(m) * self._features)
                .reshape(len(m), -1) for k, m in zip(shards, members)]
        return rows, self.ds.labels[np.concatenate(members)]

    def __iter__(self):
        rng = np.random.default_rng((self.seed, self.epoch, self.rank, 1))
        shards = self.my_shards()
        carry_x, carry_y = np.empty((0, self._features), self.ds.dtype), np.empty(0, np.int64)
        for w in range(0, len(shards), self.window):
            sources, y = self._sources(shards[w:w + self.window])
            size = len(y)
            idx = rng.permutation(size) if self.shuffle else np.arange(size)
            # batch order = the samples left over from the last window, then this window's in the order idx;
            # each source row is copied once, straight to its place in a reused batch buffer (from the page
            # cache when the store maps files), and every batch is a view of a slice of that buffer
            c = len(carry_x)
            out = self._pool.take(c + size, self._features, self.ds.dtype, spare=self.batch)
            out[:c] = carry_x
            place = np.empty_like(idx)
            place[idx] = np.arange(c, c + size)  # where window row r goes: sources are read front to back
            start = 0
            for rows in sources:
                out[place[start:start + len(rows)]] = rows
                start += len(rows)
            labels = np.concatenate([carry_y, y[idx]])
            del sources
            whole = len(out) - len(out) % self.batch
            for k in range(0, whole, self.batch):
                # the tracked array must be the very one the tensor holds
                # (a view of a view names the buffer as its base)
                batch = self._pool.hand_out(out[k:k + self.batch].reshape(-1, *self.ds.shape))
                yield torch.from_numpy(batch), torch.from_numpy(labels[k:k + self.batch])
            carry_x, carry_y = out[whole:].copy(), labels[whole:]  # copied out: the buffer is reused
            del out  # this window is done: only the batches handed out keep its buffer busy

    def __len__(self) -> int:
        """Whole batches this rank yields per epoch."""
        return sum(len(self.ds.shard_members(k)) for k in self.my_shards()) // self.batch


class BatchBuffers:
    """Row buffers for windows of batches, reused once no batch handed out from them is still alive.

    A batch is a view of its window's buffer, so a buffer may be refilled only when nothing refers to it any
    more: every slice handed out is tracked by a weak reference (a tensor made by torch.from_numpy keeps its
    array alive, and so do all views of that tensor). A consumer that keeps batches (list(stream)) therefore
    gets fresh buffers and intact data; one that drops them, as a training loop does, cycles through `keep`.
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._buffers: list[tuple[np.ndarray, list]] = []  # (buffer, weak references to what it handed out)
        self.allocated = 0  # buffers made so far: stays at `keep` or below when batches are dropped in time

    def take(self, rows: int, features: int, dtype, spare: int = 0) -> np.ndarray:
        """A (rows, features) view of a buffer nothing refers to any more (a new one, `spare` rows larger so
        that it fits the next window's carried-over samples too, when all are busy or too small)."""
        for buf, refs in self._buffers:
            if buf.shape[0] >= rows and buf.shape[1] == features and buf.dtype == dtype \
                    and not any(r() is not None for r in refs):
                refs.clear()
                return self._track(refs, buf[:rows])
        largest = max((b.shape[0] for b, _ in self._buffers), default=0)  # windows vary: converge on the largest
        buf, refs = np.empty((max(rows + spare, largest), features), dtype), []
        self.allocated += 1
        # a busy buffer dropped from the pool here lives on in its batches
        self._buffers = (self._buffers + [(buf, refs)])[-self.keep:]
        return self._track(refs, buf[:rows])

    def hand_out(self, view: np.ndarray) -> np.ndarray:
        """A slice of a view `take` returned, tracked: its buffer stays busy while the slice lives."""
        for buf, refs in self._buffers:
            if view.base is buf:
                return self._track(refs, view)
        return view  # its buffer was dropped from the pool: it is never reused, nothing to track

    @staticmethod
    def _track(refs: list, view: np.ndarray) -> np.ndarray:
        refs.append(weakref.ref(view))
        return view


__all__ = ["ShardStream", "BatchBuffers"]
