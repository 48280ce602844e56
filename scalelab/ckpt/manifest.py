"""What makes a checkpoint trustworthy, whoever wrote it: atomic files, and a manifest that lists only
complete checkpoints with their checksums.

A checkpoint is a file `step-<N>.pt` (sync, async) or a directory `step-<N>/` of per-rank files (sharded).
It is written under a temporary name, fsynced, renamed into place, and only then entered in `manifest.json`
(itself replaced atomically). So a process killed at any instant leaves either the old manifest or the new
one; a temp file or `.partial` directory left behind is never listed, and so never loaded. Loading checks
every listed file's checksum: a corrupted checkpoint is an error naming the file, never a silent bad resume.

Why CRC32 and not sha256: the checksum is computed while a sync checkpoint is written, on the training's
critical path. What it must catch is accidental corruption (a torn or truncated file, flipped bits on a disk
or in transit), which CRC32 detects as zip, gzip and parallel file systems rely on; a cryptographic hash would
add protection against deliberate tampering, which is not the threat here, at about twice the cost (measured
with bench/bench_ckpt.py). Manifests written with sha256 entries are still verified.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ScalelabError
from . import retention

MANIFEST = "manifest.json"


class CheckpointError(ScalelabError):
    """A checkpoint is missing, partial or corrupted, or could not be written; the message names the file."""


_CHECKSUMMER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc32")
_OVERLAP_BYTES = 1 << 20


class _ChecksumWriter:
    """A file wrapper that checksums what passes through it, so nothing is read back to checksum it. A large
    piece is checksummed on a helper thread while the same piece is written (zlib releases the GIL), so on a
    machine with a spare core the checksum costs little extra."""

    def __init__(self, f):
        self.f, self.crc, self.bytes = f, 0, 0

    def _update(self, data) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def write(self, data) -> int:
        self.bytes += len(data)
        if len(data) < _OVERLAP_BYTES:
            self._update(data)
            return self.f.write(data)
        summed = _CHECKSUMMER.submit(self._update, data)
        try:
            return self.f.write(data)
        finally:
            summed.result()  # `data` must stay unchanged until it is summed; the order of updates is kept

    def flush(self) -> None:
        self.f.flush()

    def checksum(self) -> str:
        """'crc32:<8 hex digits>'."""
        return f"crc32:{self.crc:08x}"


def atomic_write(path: Path, write) -> tuple[str, int]:
    """Call `write(f)` on a temp file beside `path`, fsync, rename over `path`, fsync the directory.

    Returns (checksum, bytes) of what was written; the checksum is 'crc32:<hex>'.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            summing = _ChecksumWriter(f)
            write(summing)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # ... and the rename itself survives a crash
    return summing.checksum(), summing.bytes


def fsync_dir(directory: Path) -> None:
    """Make a rename or create in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def checksum_file(path: Path, algorithm: str = "crc32") -> str:
    """A file's checksum as the manifest records it: 'crc32:<hex>', or a bare sha256 hex digest (old manifests)."""
    crc, h = 0, hashlib.sha256() if algorithm == "sha256" else None
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            if h is not None:
                h.update(block)
            else:
                crc = zlib.crc32(block, crc)
    return h.hexdigest() if h is not None else f"crc32:{crc:08x}"


def _matches(path: Path, recorded: str) -> bool:
    return checksum_file(path, "crc32" if recorded.startswith("crc32:") else "sha256") == recorded


def read_manifest(directory) -> list[dict]:
    """The manifest's entries, oldest first (empty when there is none)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return []
    try:
        return json.loads(path.read_text())["checkpoints"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path} is not a valid checkpoint manifest ({e}); move it aside to start fresh") from e


def record(directory, entry: dict, keep_last: int, keep_best: int = 0, delete_later: bool = False) -> list[dict]:
    """Enter a complete checkpoint in the manifest, apply retention, delete what it drops (on a background
    thread with delete_later); returns the kept entries."""
    directory = Path(directory)
    entry = {"t": time.time(), **entry}
    entries = [e for e in read_manifest(directory) if e["step"] != entry["step"]] + [entry]
    kept, dropped = retention.select(entries, keep_last, keep_best)
    text = json.dumps({"checkpoints": kept}, indent=1).encode()
    atomic_write(directory / MANIFEST, lambda f: f.write(text))
    # Only now that the manifest no longer lists them; delete_later moves it off the caller's thread: freeing the
    # blocks of a large file takes tens of ms that training need not wait for. Unlisted checkpoints that an
    # earlier process did not get to delete (it was killed) go too.
    listed = {e["file"] for e in kept}
    stale = {directory / e["file"] for e in dropped}
    stale |= {p for p in directory.iterdir() if _CHECKPOINT_NAME.match(p.name) and p.name not in listed}
    for path in stale:
        if delete_later:
            _DELETER.submit(_remove, path)
        else:
            _remove(path)
    return kept


_DELETER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-retention")
_CHECKPOINT_NAME = re.compile(r"^step-\d{8}(\.pt)?$")  # complete checkpoints only: never a temp file or .partial


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
    files = entry.get("files") or {"": entry.get("checksum") or entry["sha256"]}
    for name, digest in files.items():
        target = path / name if name else path
        if not target.exists():
            raise CheckpointError(f"{target} is listed in the manifest but missing; restore it or delete the "
                                  f"entry for step {entry['step']} from {path.parent / MANIFEST}")
        if not _matches(target, digest):
            raise CheckpointError(f"{target} is corrupted (its checksum differs from the manifest); delete it and its "
                                  f"manifest entry (step {entry['step']}) to resume from an older checkpoint")
    return entry


__all__ = ["MANIFEST", "CheckpointError", "atomic_write", "fsync_dir", "checksum_file", "read_manifest", "record",
           "latest", "best", "verify"]
