"""Checkpoints: atomic writes (temp file, fsync, rename), a manifest with checksums, retention, resume.

Three ways to write the same thing, chosen by `checkpoint.mode` in a RunSpec:

    sync     rank 0 writes while every rank waits          (sync.SyncCheckpointer)
    async    rank 0 snapshots to host memory, a background thread writes   (asynchronous.AsyncCheckpointer)
    sharded  every rank writes its part with torch.distributed.checkpoint, its async save on top
             (sharded.ShardedCheckpointer)
    multilevel  rank 0 writes to a node-local tier, copied to the shared one in the background
             (multilevel.MultiLevelCheckpointer)

A checkpoint is `step-<N>.pt` (or the directory `step-<N>/` when sharded) plus an entry in `manifest.json`;
the manifest is rewritten atomically after the checkpoint is complete, so a run killed mid-write leaves at
most a stray temp file or `.partial` directory, which is never loaded. Retention keeps the newest
`keep_last` and the `keep_best` with the lowest training loss.
"""
from __future__ import annotations

from pathlib import Path

from .asynchronous import AsyncCheckpointer
from .manifest import CheckpointError, best, read_manifest, verify
from .multilevel import MultiLevelCheckpointer, default_local_dir
from .sharded import ShardedCheckpointer, load_sharded
from .sync import Checkpointer, SyncCheckpointer, latest_checkpoint, load_checkpoint, save_checkpoint

MODES = ("sync", "async", "sharded", "multilevel")


def build_checkpointer(ckpt, directory, rank: int = 0, world: int = 1):
    """The checkpointer a RunSpec's `checkpoint` section asks for (rank 0 is the writer of single-file modes)."""
    common = dict(keep_last=ckpt.keep_last, keep_best=ckpt.keep_best)
    if ckpt.mode == "sync":
        return SyncCheckpointer(directory, writer=rank == 0, **common)
    if ckpt.mode == "async":
        return AsyncCheckpointer(directory, writer=rank == 0, **common)
    if ckpt.mode == "multilevel":
        local = ckpt.local_dir or default_local_dir(Path(directory).parent)
        return MultiLevelCheckpointer(directory, local, writer=rank == 0, **common)
    if ckpt.mode == "sharded":
        return ShardedCheckpointer(directory, rank=rank, world=world, async_save=True, **common)
    raise CheckpointError(f"unknown checkpoint mode {ckpt.mode!r}; choose one of {', '.join(MODES)}")


def load_any(path, model, optimizer=None) -> int:
    """Load a checkpoint of any mode (a file, or a sharded directory) after verifying it; returns its step."""
    path = Path(path)
    return load_sharded(path, model, optimizer) if path.is_dir() else load_checkpoint(path, model, optimizer)


__all__ = ["CheckpointError", "MODES", "build_checkpointer", "load_any", "latest_checkpoint", "load_checkpoint",
           "save_checkpoint", "read_manifest", "verify", "best", "Checkpointer", "SyncCheckpointer", "AsyncCheckpointer",
           "ShardedCheckpointer", "load_sharded", "MultiLevelCheckpointer", "default_local_dir"]
