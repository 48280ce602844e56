"""Datasets and distributed loaders built from a RunSpec's `data` section."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from . import pysrc, synthetic


EVAL_SEED_OFFSET = 1_000_003
DIGITS_TRAIN = 1500  # of 1797; the rest is held out


def build_dataset(data, seed: int) -> TensorDataset:
    """The in-memory training set the spec describes (same on every rank: same seed)."""
    if data.source == "heat":
        x, y = synthetic.heat_fields(data.samples, data.size, data.classes, seed)
    elif data.source == "digits":
        x, y = synthetic.digits()
        x, y = x[:DIGITS_TRAIN], y[:DIGITS_TRAIN]
    elif data.source == "pysrc":  # windows of Python source bytes, already tensors (data/pysrc.py)
        return TensorDataset(*pysrc.train_samples(data.samples, data.seq_len, seed))
    else:
        x, y = synthetic.from_npz(data.path)
        x, y = x[: _train_len(len(x))], y[: _train_len(len(y))]
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def build_eval_set(data, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out samples: fresh fields from another seed (heat), the tail of digits / the .npz file, or windows of
    the held-out source files (pysrc)."""
    if data.source == "heat":
        x, y = synthetic.heat_fields(min(512, max(64, data.samples // 4)), data.size, data.classes,
                                     seed + EVAL_SEED_OFFSET)
    elif data.source == "digits":
        x, y = synthetic.digits()
        x, y = x[DIGITS_TRAIN:], y[DIGITS_TRAIN:]
    elif data.source == "pysrc":  # the held-out files' windows, the same whatever the seed
        return pysrc.held_out_samples(pysrc.eval_count(data.samples), data.seq_len)
    else:
        x, y = synthetic.from_npz(data.path)
        x, y = x[_train_len(len(x)):], y[_train_len(len(y)):]
    return torch.from_numpy(x), torch.from_numpy(y)


def _train_len(n: int) -> int:
    return n - max(1, n // 10)


def build_loader(dataset, data, batch: int, rank: int, world: int, seed: int) -> DataLoader:
    """A loader over this rank's shard: a seeded DistributedSampler, whole batches only.

    With the same seed, rank r of W sees indices perm[r::W], so W ranks with batch B together see exactly
    the samples that 1 rank with batch W*B sees: the basis of data-parallel equivalence.
    """
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    kwargs = {}
    if data.loader_workers > 0:
        kwargs = dict(num_workers=data.loader_workers, prefetch_factor=data.prefetch_factor,
                      persistent_workers=True)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True,
                      pin_memory=data.pin_memory and torch.cuda.is_available(), **kwargs)
