"""Where sample bytes come from: a local directory, a throttled one standing in for a parallel file system,
and a node-local cache in front of a slow one. Every store counts its metadata operations and bytes.

    pfs = ThrottledStore("/scratch/heat", open_latency_s=0.005, bandwidth=200e6)   # like a busy Lustre
    local = CachedStore(pfs, "/tmp/cache")        # first read copies the file to node-local disk
    data = local.read("shard-00003.bin", offset=4096, length=1024)

Why a throttle and not a real parallel file system: the course runs on laptops, and what the lessons need from
a PFS is its shape — every open (a metadata-server round trip) costs milliseconds whatever the file's size, and
bandwidth is shared. `ThrottledStore` sleeps for both, so several readers overlap their latency like real
clients do (the sleeps release the GIL), and the bandwidth budget is shared by the threads of one process.
"""
from __future__ import annotations

import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ScalelabError


class StoreError(ScalelabError):
    """A file the store was asked for is missing or unreadable; the message names it."""


@dataclass
class IOStats:
    """What a store did: metadata operations, bytes read, and the time spent in them."""

    opens: int = 0
    """Files opened (each one a metadata-server round trip on a parallel file system)."""
    stats: int = 0
    """stat() calls (sizes, existence checks)."""
    reads: int = 0
    """read calls."""
    bytes: int = 0
    """Bytes read."""
    hits: int = 0
    """Cache hits (CachedStore only)."""
    misses: int = 0
    """Cache misses (CachedStore only)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts) -> None:
        """Add to the counters (thread-safe: DataLoader threads and prefetchers share a store)."""
        with self._lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)

    def __getstate__(self):  # a lock does not pickle (DataLoader workers started by spawn get a copy)
        state = dict(self.__dict__)
        state.pop("_lock", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def as_dict(self) -> dict:
        """The counters as a plain dict."""
        return {k: getattr(self, k) for k in ("opens", "stats", "reads", "bytes", "hits", "misses")}


class LocalStore:
    """Files under `root` on a local file system (or whatever the OS mounts there), counted."""

    def __init__(self, root):
        self.root = Path(root)
        self.stats = IOStats()
        self._handles: dict[str, object] = {}
        self._maps: dict[str, memoryview] = {}
        self._pid = os.getpid()

    def __getstate__(self):  # DataLoader workers get a copy: open files never cross a fork or a pickle
        state = dict(self.__dict__)
        state["_handles"], state["_maps"] = {}, {}
        return state

    def path(self, name: str) -> Path:
        """Where `name` lives."""
        return self.root / name

    def size(self, name: str) -> int:
        """The file's size in bytes (one stat)."""
        self.stats.add(stats=1)
        try:
            return self.path(name).stat().st_size
        except FileNotFoundError:
            raise StoreError(f"{self.path(name)} does not exist") from None

    def _open(self, name: str):
        self.stats.add(opens=1)
        try:
            return open(self.path(name), "rb", buffering=0)
        except FileNotFoundError:
            raise StoreError(f"{self.path(name)} does not exist") from None

    def read(self, name: str, offset: int = 0, length: int = -1, keep_open: bool = False) -> bytes:
        """`length` bytes of `name` from `offset` (-1: to the end). keep_open reuses one handle per file."""
        f = self._handle(name) if keep_open else self._open(name)
        try:
            data = os.pread(f.fileno(), length if length >= 0 else self._remaining(f, offset), offset)
        finally:
            if not keep_open:
                f.close()
        self.stats.add(reads=1, bytes=len(data))
        return data

    def readinto(self, name: str, buffer, offset: int = 0, keep_open: bool = False) -> int:
        """Fill `buffer` (a writable bytes-like object) from `offset`; returns the bytes read."""
        f = self._handle(name) if keep_open else self._open(name)
        try:
            n = os.preadv(f.fileno(), [buffer], offset)
        finally:
            if not keep_open:
                f.close()
        self.stats.add(reads=1, bytes=n)
        return n

    def view(self, name: str) -> memoryview:
        """All of `name` as a read-only view of the page cache (mapped once, kept): no copy into a buffer.
        Counted like reading the whole file: one read of its size per call, one open per file."""
        self._after_fork()
        view = self._maps.get(name)
        if view is None:
            with self._open(name) as f:
                size = os.fstat(f.fileno()).st_size
                view = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)) if size else memoryview(b"")
            self._maps[name] = view
        self.stats.add(reads=1, bytes=len(view))
        return view

    def _after_fork(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's descriptors are shared state, start over
            self._handles, self._maps, self._pid = {}, {}, os.getpid()

    def _handle(self, name: str):
        self._after_fork()
        f = self._handles.get(name)
        if f is None:
            f = self._handles[name] = self._open(name)
        return f

    @staticmethod
    def _remaining(f, offset: int) -> int:
        return max(os.fstat(f.fileno()).st_size - offset, 0)

    def close(self) -> None:
        """Close the handles kept open."""
        for f in self._handles.values():
            f.close()
        self._handles, self._maps = {}, {}  # a mapping is unmapped once the last array over it is gone


class ThrottledStore(LocalStore):
    """A LocalStore that behaves like a shared parallel file system: each open and stat waits
    `open_latency_s` (concurrent opens overlap, like independent clients), and reads share `bandwidth`
    bytes/s among the threads of this process (0: unlimited)."""

    def __init__(self, root, open_latency_s: float = 0.0, bandwidth: float = 0.0):
        super().__init__(root)
        if open_latency_s < 0 or bandwidth < 0:
            raise ValueError(f"open_latency_s and bandwidth must be >= 0, got {open_latency_s}, {bandwidth}")
        self.open_latency_s, self.bandwidth = open_latency_s, bandwidth
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the shared link is next free (a token bucket of depth zero)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def size(self, name: str) -> int:
        """stat() after the metadata latency."""
        self._metadata_wait()
        return super().size(name)

    def _open(self, name: str):
        self._metadata_wait()
        return super()._open(name)

    def _metadata_wait(self) -> None:
        # time.sleep overshoots by tens of microseconds (more on a busy machine); at thousands of opens that would
        # add up to a latency the store was not given. Each thread carries its overshoot into its next wait, so an
        # epoch's opens cost opens x open_latency_s on average, as the lab's model of a PFS says.
        if not self.open_latency_s:
            return
        want = self.open_latency_s - getattr(_THREAD_STATE, "owed", 0.0)
        t0 = time.perf_counter()
        _sleep(want)
        _THREAD_STATE.owed = min(max(0.0, (time.perf_counter() - t0) - want), 10 * self.open_latency_s)

    def read(self, name: str, offset: int = 0, length: int = -1, keep_open: bool = False) -> bytes:
        """Read, then wait until the shared bandwidth budget has carried the bytes."""
        data = super().read(name, offset, length, keep_open)
        self._transfer(len(data))
        return data

    def readinto(self, name: str, buffer, offset: int = 0, keep_open: bool = False) -> int:
        """readinto, then wait for the shared bandwidth budget."""
        n = super().readinto(name, buffer, offset, keep_open)
        self._transfer(n)
        return n

    def view(self, name: str) -> memoryview:
        """view, after the open's latency (first time), then wait for the shared bandwidth budget."""
        data = super().view(name)
        self._transfer(len(data))
        return data

    def _transfer(self, nbytes: int) -> None:
        if not self.bandwidth or not nbytes:
            return
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + nbytes / self.bandwidth
            done = self._free_at
        _sleep(done - time.perf_counter())


class CachedStore:
    """A node-local cache in front of a slower store: the first read of a file copies all of it into
    `cache_dir` (atomically, so concurrent readers never see half a file); later reads are local."""

    def __init__(self, remote: LocalStore, cache_dir):
        self.remote = remote
        self.local = LocalStore(cache_dir)
        self.local.root.mkdir(parents=True, exist_ok=True)
        self.stats = IOStats()

    @property
    def root(self) -> Path:
        """The cache directory."""
        return self.local.root

    def _ensure(self, name: str) -> None:
        target = self.local.path(name)
        if target.exists():
            self.stats.add(hits=1)
            return
        self.stats.add(misses=1)
        data = self.remote.read(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def size(self, name: str) -> int:
        """Size of the cached copy (fetched first when missing)."""
        self._ensure(name)
        return self.local.size(name)

    def read(self, name: str, offset: int = 0, length: int = -1, keep_open: bool = False) -> bytes:
        """Read from the local copy, fetching the whole file from the remote store on a miss."""
        self._ensure(name)
        data = self.local.read(name, offset, length, keep_open)
        self.stats.add(reads=1, bytes=len(data))
        return data

    def readinto(self, name: str, buffer, offset: int = 0, keep_open: bool = False) -> int:
        """readinto from the local copy."""
        self._ensure(name)
        n = self.local.readinto(name, buffer, offset, keep_open)
        self.stats.add(reads=1, bytes=n)
        return n

    def view(self, name: str) -> memoryview:
        """A view of the local copy (see LocalStore.view)."""
        self._ensure(name)
        data = self.local.view(name)
        self.stats.add(reads=1, bytes=len(data))
        return data

    def path(self, name: str) -> Path:
        """The local copy's path (fetched first when missing): for libraries that open files themselves."""
        self._ensure(name)
        return self.local.path(name)

    def clear(self) -> None:
        """Drop every cached file."""
        shutil.rmtree(self.local.root, ignore_errors=True)
        self.local.root.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Close kept handles."""
        self.local.close()
        self.remote.close()


_THREAD_STATE = threading.local()


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


__all__ = ["IOStats", "LocalStore", "ThrottledStore", "CachedStore", "StoreError"]
