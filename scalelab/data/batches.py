"""Batches forever, epoch after epoch, resumable without loading what is skipped.

Resuming at step k must feed exactly the batches an uninterrupted run would have fed from step k on. The
sampler is a pure function of (seed, epoch), so the resumed epoch's index list is recomputed and cut after
the batches already consumed; nothing skipped is read (on a slow store, reading a skipped half-epoch could
cost minutes).
"""
from __future__ import annotations

from torch.utils.data import DataLoader


def resumable_batches(loader: DataLoader, skip: int, device):
    """Batches of `loader` (its sampler reseeded per epoch) from batch number `skip` on, moved to `device`."""
    per_epoch = len(loader)
    epoch, skip_now = divmod(skip, per_epoch)
    while True:
        loader.sampler.set_epoch(epoch)
        source = _tail(loader, skip_now * loader.batch_size) if skip_now else loader
        for x, y in source:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        skip_now = 0
        epoch += 1


def _tail(loader: DataLoader, start: int) -> DataLoader:
    """A one-epoch loader like `loader` over its sampler's indices from position `start` on."""
    indices = list(loader.sampler)[start:]
    kwargs = {}
    if loader.num_workers > 0:
        kwargs = dict(num_workers=loader.num_workers, prefetch_factor=loader.prefetch_factor)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=indices, drop_last=True,
                      pin_memory=loader.pin_memory, **kwargs)


__all__ = ["resumable_batches"]
