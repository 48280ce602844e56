"""Multi-level checkpoints: a fast node-local tier written while training waits, copied in the background to the
shared tier (`checkpoint.mode = "multilevel"`).

A shared parallel file system is slow and contended; a node's own memory or SSD is fast but dies with the node.
So rank 0 writes each checkpoint synchronously to the node-local directory (`checkpoint.local_dir`, by default
a private folder under /dev/shm: memory, see private.py) — the short stall — and a background thread copies the finished file, checksum-verified,
into the shared `checkpoints/` directory with its own manifest entry. A restart reads the node-local tier when the
node survived and holds the newest checkpoint, and the shared tier otherwise (a lost node, a new allocation).
Both tiers are complete checkpoints in the same format, so nothing else cares which one it got.

    ck = MultiLevelCheckpointer("runs/x/checkpoints", default_local_dir("runs/x"), keep_last=2)
    ck.save(step, model, optimizer)      # blocks for the local write only
    ck.completed()                       # copies to the shared tier that finished since the last call
    ck.latest()                          # local if it has the newest step, else shared (ranks agree on the step)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

from .asynchronous import started_pool
from .manifest import atomic_write, read_manifest, record, verify
from .private import private_dir
from .sync import Checkpointer, capture, write_checkpoint


def node_local_base() -> Path:
    """Where node-local tiers go: memory (/dev/shm) when the node has it, else the system's temp directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def default_local_dir(run_dir) -> Path:
    """The node-local tier for a run: `<node_local_base()>/scalelab-ckpt-u<uid>/<hash of the run dir>`.

    The folder per account is made private (0700) and refused when another account made it first
    (`private.private_dir`, when the checkpointer starts): its name is predictable in a place every account can
    write, so it must never be taken as found. Inside it, a run is named by its run directory's path and inode: a
    run directory deleted and made again under the same path is another run, and must not resume from a local tier
    the old one left in a node's memory."""
    run_dir = Path(run_dir).resolve()
    ident = f"{run_dir}:{os.stat(run_dir).st_ino if run_dir.exists() else ''}"
    return node_local_base() / f"scalelab-ckpt-u{os.geteuid()}" / hashlib.sha1(ident.encode()).hexdigest()[:12]


class MultiLevelCheckpointer(Checkpointer):
    """Rank 0 writes to the node-local tier now and copies to the shared tier in the background."""

    mode = "multilevel"
    needs_barrier = True  # the local write is synchronous: nobody runs ahead of it

    def __init__(self, directory, local_dir, keep_last: int = 2, keep_best: int = 0, writer: bool = True):
        # the local tier may lie where every account can write (/dev/shm): only a private folder of our own (the
        # default's folder per account private too)
        if Path(local_dir).parent.name == f"scalelab-ckpt-u{os.geteuid()}":
            private_dir(Path(local_dir).parent)
        self.directory, self.local_dir = Path(directory), private_dir(local_dir)
        self.keep_last, self.keep_best, self.writer = keep_last, keep_best, writer
        self._pool = started_pool("scalelab-flush") if writer else None
        self._pending: list[tuple[int, float, Future]] = []

    def save(self, step: int, model, optimizer, metric: float | None = None, extra: dict | None = None) -> dict:
        """Write to the local tier (training waits for this), then queue the copy to the shared tier."""
        t0 = time.perf_counter()
        if not self.writer:
            return {"step": step, "blocked_s": 0.0, "path": None, "bytes": 0}
        path, size = write_checkpoint(self.local_dir, capture(step, model, optimizer, extra), self.keep_last,
                                      self.keep_best, metric)
        blocked = time.perf_counter() - t0
        self._pending.append((step, time.perf_counter(), self._pool.submit(self._flush, path, size, metric)))
        return {"step": step, "blocked_s": blocked, "path": str(path), "bytes": size, "tier": "local"}

    def _flush(self, local: Path, size: int, metric) -> Path:
        verify(local)  # never spread a torn local file to the shared tier
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / local.name
        with open(local, "rb") as src:
            digest, written = atomic_write(target, lambda f: shutil.copyfileobj(src, f, 4 << 20))
        entry = {"step": int(local.stem.split("-")[1]), "file": target.name, "kind": "file", "checksum": digest,
                 "bytes": written}
        if metric is not None:
            entry["metric"] = float(metric)
        record(self.directory, entry, self.keep_last, self.keep_best)
        return target

    def completed(self) -> list[dict]:
        """Copies to the shared tier finished since the last call (raises a copy's error, naming the file)."""
        done, still = [], []
        for step, started, fut in self._pending:
            if fut.done():
                done.append({"step": step, "path": str(fut.result()), "flush_s": time.perf_counter() - started,
                             "tier": "shared"})
            else:
                still.append((step, started, fut))
        self._pending = still
        return done

    def readable(self) -> dict[int, Path]:
        """Every checkpoint this process can read, by step: the node-local tier's copy where it has the step (it
        is faster), else the shared tier's."""
        found = {int(e["step"]): self.directory / e["file"] for e in read_manifest(self.directory)}
        found.update({int(e["step"]): self.local_dir / e["file"] for e in read_manifest(self.local_dir)})
        return found

    def latest(self) -> Path | None:
        """The newest checkpoint, from the node-local tier when this node holds it, else from the shared one (a
        lost node or a fresh allocation has no local tier).

        In a distributed run every rank must resume from the same step, but each node sees only its own local tier
        (rank 0's node holds the newest; another node may hold a stale one of an earlier run in the same directory):
        the ranks agree on the newest step that every one of them can read (one all_gather of step lists)."""
        found = self.readable()
        steps = set(found)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sorted(steps))
            steps = set.intersection(*(set(s) for s in everyone))
        return found[max(steps)] if steps else None

    def close(self) -> list[dict]:
        """Wait for every copy to the shared tier; report them."""
        for _, _, fut in self._pending:
            fut.result()
        done = self.completed()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return done


__all__ = ["MultiLevelCheckpointer", "default_local_dir", "node_local_base"]
