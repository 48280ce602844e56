"""What makes a checkpoint trustworthy, whoever wrote it: atomic files, and a manifest that lists only
complete checkpoints with their checksums.

A checkpoint is a file `step-<N>.pt` (sync, async) or a directory `step-<N>/` of per-rank files (sharded).
It is written under a temporary name, fsynced, renamed into place, and only then entered in `manifest.json`
(itself replaced atomically). So a process killed at any instant leaves either the old manifest or the new
one; a temp file or `.partial` directory left behind is never listed, and so never loaded. Loading checks
every listed file's sha256: a corrupted checkpoint is an error naming the file, never a silent bad resume.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import ScalelabError
from . import retention

MANIFEST = "manifest.json"


class CheckpointError(ScalelabError):
    """A checkpoint is missing, partial or corrupted, or could not be written; the message names the file."""


class _HashingWriter:
    """A file wrapper that hashes what passes through it (so nothing is read back to checksum it)."""

    def __init__(self, f):
        self.f, self.hash, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: Path, write) -> tuple[str, int]:
    """Call `write(f)` on a temp file beside `path`, fsync, rename over `path`, fsync the directory.

    Returns (sha256 hex digest, bytes) of what was written.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # ... and the rename itself survives a crash
    return hashing.hash.hexdigest(), hashing.bytes


def fsync_dir(directory: Path) -> None:
    """Make a rename or create in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(directory) -> list[dict]:
    """The manifest's entries, oldest first (empty when there is none)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())["checkpoints"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is not a valid checkpoint manifest ({e}); move it aside to start fresh") from e


def record(directory, entry: dict, keep_last: int, keep_best: int = 0) -> list[dict]:
    """Enter a complete checkpoint in the manifest, apply retention, delete what it drops; returns the kept."""
    directory = Path(directory)
    entry = {"t": time.time(), **entry}
    entries = [e for e in read_manifest(directory) if e["step"] != entry["step"]] + [entry]
    kept, dropped = retention.select(entries, keep_last, keep_best)
    text = json.dumps({"checkpoints": kept}, indent=1).encode()
    atomic_write(directory / MANIFEST, lambda f: f.write(text))
    for e in dropped:  # only after the manifest no longer lists them
        _remove(directory / e["file"])
    return kept


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def latest(directory) -> Path | None:
    """The newest checkpoint the manifest lists (only complete ones are ever listed), or None."""
    entries = read_manifest(directory)
    return Path(directory) / entries[-1]["file"] if entries else None


def best(directory) -> Path | None:
    """The checkpoint with the lowest metric among those kept, or None when none has a metric."""
    e = retention.best(read_manifest(directory))
    return Path(directory) / e["file"] if e else None


def verify(path) -> dict:
    """The manifest entry of checkpoint `path` after checking every one of its files; CheckpointError naming
    the file when it is not listed (partial), missing, or its bytes differ from the recorded sha256."""
    path = Path(path)
    entry = next((e for e in read_manifest(path.parent) if e["file"] == path.name), None)
    if entry is None:
        raise CheckpointError(f"{path} is not in {path.parent / MANIFEST}: it may be partial; it will not be loaded")
    files = entry.get("files") or {"": entry["sha256"]}
    for name, digest in files.items():
        target = path / name if name else path
        if not target.exists():
            raise CheckpointError(f"{target} is listed in the manifest but missing; restore it or delete the "
                                  f"entry for step {entry['step']} from {path.parent / MANIFEST}")
        if sha256_file(target) != digest:
            raise CheckpointError(f"{target} is corrupted (sha256 differs from the manifest); delete it and its "
                                  f"manifest entry (step {entry['step']}) to resume from an older checkpoint")
    return entry


__all__ = ["MANIFEST", "CheckpointError", "atomic_write", "fsync_dir", "sha256_file", "read_manifest", "record",
           "latest", "best", "verify"]
