"""Synchronous, atomic checkpoints written by rank 0."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import ScalelabError

MANIFEST = "manifest.json"


class CheckpointError(ScalelabError):
    """A checkpoint is missing, partial or corrupted; the message names the file."""


def _atomic_write(path: Path, write) -> None:
    """Write through a temp file in the same directory, fsync it, rename over `path`, fsync the directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(directory: Path) -> list[dict]:
    """The manifest's entries, oldest first (empty when there is none)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())["checkpoints"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is not a valid checkpoint manifest ({e}); move it aside to start fresh") from e


def save_checkpoint(directory, step: int, model, optimizer, keep_last: int = 2, extra: dict | None = None) -> Path:
    """Atomically save model + optimizer at `step`, record it in the manifest, keep the newest `keep_last`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:08d}.pt"
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": torch.get_rng_state(), "extra": extra or {}}
    _atomic_write(path, lambda f: torch.save(state, f))
    entries = [e for e in read_manifest(directory) if e["step"] != step]
    entries.append({"step": step, "file": path.name, "sha256": _sha256(path), "bytes": path.stat().st_size})
    entries.sort(key=lambda e: e["step"])
    drop, entries = entries[:-keep_last], entries[-keep_last:]
    _atomic_write(directory / MANIFEST, lambda f: f.write(json.dumps({"checkpoints": entries}, indent=1).encode()))
    for e in drop:
        (directory / e["file"]).unlink(missing_ok=True)
    return path


def latest_checkpoint(directory) -> Path | None:
    """The newest checkpoint the manifest lists (only complete ones are ever listed), or None."""
    entries = read_manifest(Path(directory))
    return Path(directory) / entries[-1]["file"] if entries else None


def load_checkpoint(path, model, optimizer=None) -> int:
    """Verify the checksum, load model (+ optimizer) state, and return the step to continue from."""
    path = Path(path)
    entry = next((e for e in read_manifest(path.parent) if e["file"] == path.name), None)
    if entry is None:
        raise CheckpointError(f"{path} is not in {path.parent / MANIFEST}: it may be partial; it will not be loaded")
    if not path.exists():
        raise CheckpointError(f"{path} is listed in the manifest but missing; restore it or edit the manifest")
    if _sha256(path) != entry["sha256"]:
        raise CheckpointError(f"{path} is corrupted (sha256 differs from the manifest); delete it and its manifest "
                              "entry to resume from an older checkpoint")
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])
