"""The engine's on-disk data path: a run with `data.format` files | shards | hdf5 writes its (generated or
loaded) training set once in that layout, then trains from it through a store that may be throttled like a
parallel file system (`data.open_latency_ms`, `data.read_mb_per_s`).

The stored Dataset returns exactly the tensors the in-memory one does, so a run's loss curve does not depend
on the format, only its speed does.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch.utils.data import Dataset

from .formats import open_dataset, write_dataset
from .store import LocalStore, ThrottledStore


def data_key(data, seed: int) -> str:
    """A short name for this data set in this layout (what decides its bytes, and nothing else)."""
    what = {"source": data.source, "path": data.path, "samples": data.samples, "size": data.size,
            "classes": data.classes, "seed": seed, "format": data.format, "compress": data.compress,
            "samples_per_shard": data.samples_per_shard}
    return f"{data.format}-{hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]}"


def store_for(directory, data) -> LocalStore:
    """The store a run reads through: a storage server's (data.server), or throttled when the spec asks for latency
    or a bandwidth cap."""
    if data.server:  # shared with every other job reading from that server (data/storage_server.py)
        from .server_store import ServerStore
        return ServerStore(data.server, directory)
    if data.open_latency_ms or data.read_mb_per_s:
        return ThrottledStore(directory, data.open_latency_ms / 1000.0, data.read_mb_per_s * 1e6)
    return LocalStore(directory)


def training_dataset(dataset, data, root, seed: int) -> Dataset:
    """`dataset` itself for data.format 'memory'; else the same samples written under `root` and read back."""
    if data.format == "memory":
        return dataset
    x, y = dataset.tensors
    directory = Path(root) / data_key(data, seed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    write_dataset(x.numpy(), y.numpy(), directory, data.format, data.samples_per_shard, data.compress)
    return open_dataset(directory, store_for(directory, data))


__all__ = ["training_dataset", "store_for", "data_key"]
