"""Synchronous, atomic checkpoints written by rank 0: training waits until the bytes are on disk.

    save_checkpoint("runs/x/checkpoints", step, model, optimizer, keep_last=2)   # the functional API
    ck = SyncCheckpointer("runs/x/checkpoints", keep_last=2, writer=is_rank0)   # what the loop holds
    ck.save(step, model, optimizer, metric=loss)  # -> {"blocked_s": ..., "path": ..., "bytes": ...}
    step = ck.restore(model, optimizer)           # 0 when there is nothing to resume from
"""
from __future__ import annotations

import pickle
import time
from pathlib import Path

import torch

from .manifest import CheckpointError, atomic_write, latest, read_manifest, record, verify


def capture(step: int, model, optimizer, extra: dict | None = None) -> dict:
    """What a checkpoint holds: step, model and optimizer state, the CPU RNG state, and `extra`."""
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(), "extra": extra or {}}


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at `step`."""
    return f"step-{step:08d}.pt"


def write_checkpoint(directory, state: dict, keep_last: int = 2, keep_best: int = 0, metric: float | None = None,
                     delete_later: bool = False) -> tuple[Path, int]:
    """Write `state` atomically, then enter it in the manifest (with its checksum) and apply retention
    (deleting what it drops on a background thread with delete_later)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / checkpoint_name(state["step"])
    try:
        digest, size = atomic_write(path, lambda f: _torch_save(state, f))
    except OSError as e:
        raise CheckpointError(f"could not write {path}: {e.strerror or e}; check free space and permissions") from e
    entry = {"step": state["step"], "file": path.name, "kind": "file", "checksum": digest, "bytes": size}
    if metric is not None:
        entry["metric"] = float(metric)
    record(directory, entry, keep_last, keep_best, delete_later)
    return path, size


def _torch_save(state, f) -> None:
    """torch.save without the zip format's own CRC32 per record: the manifest's checksum covers every byte,
    and a second one would be another full pass over the data on the training's critical path."""
    from torch.utils.serialization import config
    with config.patch({"save.compute_crc32": False}):
        torch.save(state, f)


def save_checkpoint(directory, step: int, model, optimizer, keep_last: int = 2, extra: dict | None = None,
                    metric: float | None = None, keep_best: int = 0) -> Path:
    """Atomically save model + optimizer at `step`, record it (with its checksum) in the manifest, keep the newest `keep_last`
    (and the `keep_best` with the lowest `metric`)."""
    path, _ = write_checkpoint(directory, capture(step, model, optimizer, extra), keep_last, keep_best, metric)
    return path


def latest_checkpoint(directory) -> Path | None:
    """The newest checkpoint the manifest lists (only complete ones are ever listed), or None."""
    return latest(directory)


def load_checkpoint(path, model, optimizer=None) -> int:
    """Verify the checksum, load model (+ optimizer) state and the RNG state; return the step to continue from.

    Loaded with weights_only=True: tensors, numbers, strings and containers only, never an object a pickle names
    (a checkpoint of another account's making, if one ever got in, could hold wrong numbers but not run code)."""
    path = Path(path)
    verify(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} holds more than tensors and plain values, so it is not loaded (a checkpoint "
                              f"this engine wrote never does; someone else's file?): {str(e).splitlines()[0]}") from e
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


class Checkpointer:
    """What the training loop asks of every checkpoint mode, with the defaults of a mode whose save is complete when
    it returns. A mode implements `save` and overrides what differs: `completed` and `close` for writes that finish
    later, `latest` and `restore` for checkpoints that are not one file in `directory`'s manifest."""

    mode = ""
    needs_barrier = True
    """Whether the loop holds every rank at a barrier after a save (nobody runs ahead of an incomplete one)."""

    directory: Path

    def save(self, step: int, model, optimizer, metric: float | None = None, extra: dict | None = None) -> dict:
        """Save (or start saving) after `step`; returns at least step, blocked_s, path and bytes."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def completed(self) -> list[dict]:
        """Writes that became complete on disk since the last call (none pending by default)."""
        return []

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest(self.directory)

    def restore(self, model, optimizer, path=None) -> int:
        """Load the newest complete checkpoint (or `path`); the step to continue from, 0 if there is none."""
        path = path or self.latest()
        return load_checkpoint(path, model, optimizer) if path else 0

    def close(self) -> list[dict]:
        """Finish what is in flight; returns the writes not yet reported (nothing is in flight by default)."""
        return []


class SyncCheckpointer(Checkpointer):
    """Rank 0 writes the whole checkpoint while training waits; other ranks do nothing (the loop's barrier
    keeps them from running ahead of a checkpoint that is not complete)."""

    mode = "sync"
    needs_barrier = True

    def __init__(self, directory, keep_last: int = 2, keep_best: int = 0, writer: bool = True):
        self.directory, self.keep_last, self.keep_best, self.writer = Path(directory), keep_last, keep_best, writer

    def save(self, step: int, model, optimizer, metric: float | None = None, extra: dict | None = None) -> dict:
        """Write now; returns blocked_s (all of it is a stall), path and bytes."""
        t0 = time.perf_counter()
        if not self.writer:
            return {"step": step, "blocked_s": 0.0, "path": None, "bytes": 0}
        path, size = write_checkpoint(self.directory, capture(step, model, optimizer, extra), self.keep_last,
                                      self.keep_best, metric, delete_later=True)
        return {"step": step, "blocked_s": time.perf_counter() - t0, "path": str(path), "bytes": size}


__all__ = ["CheckpointError", "Checkpointer", "SyncCheckpointer", "capture", "checkpoint_name", "write_checkpoint",
           "save_checkpoint", "latest_checkpoint", "load_checkpoint", "read_manifest"]
