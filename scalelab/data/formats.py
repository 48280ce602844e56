"""One data set, three ways to lay it out on disk, one Dataset class for each.

    files   one .npy file per sample (like an image folder): N files, N opens per epoch
    shards  samples packed back to back into a few large files, optionally zlib-compressed per sample,
            with an index (shard, offset, length, label) so any sample is one positioned read (FanStore's idea)
    hdf5    one HDF5 file with chunked datasets x and y (h5py), read through the same counted store

    write_dataset(x, y, "data/shards", "shards", samples_per_shard=256, compress=True)
    ds = open_dataset("data/shards", store=ThrottledStore("data/shards", open_latency_s=0.005))
    x0, y0 = ds[0]                     # torch tensors, exactly the arrays that were written

Every Dataset splits a sample's cost into `read(i)` (I/O only: what the store serves) and `decode(raw)`
(CPU: decompress, parse), so a pipeline can time the two apart. A directory holds `index.json` saying which
layout it is; it is written last, so a directory without it is incomplete and is never opened.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ScalelabError
from .store import LocalStore

FORMATS = ("files", "shards", "hdf5")
INDEX = "index.json"
SHARD_INDEX = "shards.npz"
HDF5_FILE = "data.h5"
LABELS = "labels.npy"


class DataFormatError(ScalelabError):
    """A stored data set is missing, incomplete, or not what its index says; the message names the path."""


# -- writing ----------------------------------------------------------------------------------------------
def write_dataset(x: np.ndarray, y: np.ndarray, directory, fmt: str, samples_per_shard: int = 256,
                  compress: bool = False) -> Path:
    """Write x (N,C,H,W) and y (N,) to `directory` in layout `fmt`; atomic: built aside, then renamed.

    An existing complete directory is left as it is (the same data set written twice by two ranks is fine).
    """
    if fmt not in FORMATS:
        raise DataFormatError(f"unknown data format {fmt!r}; choose one of {', '.join(FORMATS)}")
    directory = Path(directory)
    if (directory / INDEX).exists():
        return directory
    x, y = np.ascontiguousarray(x), np.asarray(y, dtype=np.int64)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"format": fmt, "count": int(len(x)), "shape": list(x.shape[1:]), "dtype": str(x.dtype)}
    if fmt == "files":
        _write_files(tmp, x, y)
    elif fmt == "shards":
        meta.update(_write_shards(tmp, x, y, samples_per_shard, compress))
    else:
        _write_hdf5(tmp, x, y)
    (tmp / INDEX).write_text(json.dumps(meta, indent=1))
    try:
        os.rename(tmp, directory)
    except OSError:  # another process finished first (rename onto a non-empty directory fails)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (directory / INDEX).exists():
            raise
    return directory


def sample_name(i: int) -> str:
    """The file of sample `i` in the files layout (1000 per sub-folder, as large image sets do)."""
    return f"samples/{i // 1000:04d}/{i:07d}.npy"


def _write_files(tmp: Path, x, y) -> None:
    for i in range(len(x)):
        path = tmp / sample_name(i)
        if i % 1000 == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, x[i])
    np.save(tmp / LABELS, y)


def shard_name(k: int) -> str:
    """The file of shard `k`."""
    return f"shard-{k:05d}.bin"


def _write_shards(tmp: Path, x, y, per_shard: int, compress: bool) -> dict:
    if per_shard < 1:
        raise DataFormatError(f"samples_per_shard must be >= 1, got {per_shard}")
    n = len(x)
    shard, offset, length = np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64)
    for k, start in enumerate(range(0, n, per_shard)):
        with open(tmp / shard_name(k), "wb") as f:
            pos = 0
            for i in range(start, min(start + per_shard, n)):
                raw = x[i].tobytes()
                payload = zlib.compress(raw, 1) if compress else raw
                f.write(payload)
                shard[i], offset[i], length[i] = k, pos, len(payload)
                pos += len(payload)
    np.savez(tmp / SHARD_INDEX, shard=shard, offset=offset, length=length, label=y)
    return {"compress": bool(compress), "samples_per_shard": int(per_shard), "shards": int(shard.max()) + 1 if n else 0,
            "raw_bytes": int(x.nbytes), "stored_bytes": int(length.sum())}


def _write_hdf5(tmp: Path, x, y) -> None:
    import h5py
    chunk = max(1, min(len(x), (1 << 16) // max(1, x[0].nbytes)))  # ~64 KiB chunks
    with h5py.File(tmp / HDF5_FILE, "w") as f:
        f.create_dataset("x", data=x, chunks=(chunk, *x.shape[1:]))
        f.create_dataset("y", data=y)


# -- reading ----------------------------------------------------------------------------------------------
def read_index(directory) -> dict:
    """The index.json of a stored data set; DataFormatError when it is missing (incomplete) or unreadable."""
    path = Path(directory) / INDEX
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataFormatError(f"{path} is missing: {directory} is not a complete stored data set "
                              "(write it with scalelab.data.formats.write_dataset)") from None
    except ValueError as e:
        raise DataFormatError(f"{path} is not valid JSON ({e}); delete {directory} and write it again") from None


def open_dataset(directory, store=None) -> "StoredDataset":
    """The Dataset for a stored directory, reading through `store` (default: a plain LocalStore)."""
    meta = read_index(directory)
    cls = {"files": FileDataset, "shards": ShardDataset, "hdf5": HDF5Dataset}[meta["format"]]
    return cls(directory, store, meta)


class StoredDataset(Dataset):
    """A map-style Dataset over a stored directory: `read(i)` is I/O, `decode(raw)` is CPU."""

    format = "?"

    def __init__(self, directory, store=None, meta: dict | None = None):
        self.directory = Path(directory)
        self.meta = meta or read_index(directory)
        self.store = store if store is not None else LocalStore(directory)
        self.shape = tuple(self.meta["shape"])
        self.dtype = np.dtype(self.meta["dtype"])
        self.labels = self._labels()

    def _labels(self) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        return int(self.meta["count"])

    def read(self, i: int):
        """The stored bytes of sample `i` (I/O only)."""
        raise NotImplementedError

    def decode(self, raw) -> np.ndarray:
        """Sample array from what `read` returned (CPU only)."""
        raise NotImplementedError

    def __getitem__(self, i: int):
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is out of range for {self.directory} ({len(self)} samples)")
        return torch.from_numpy(self.decode(self.read(i))), torch.tensor(self.labels[i])

    def sample_bytes(self) -> int:
        """Bytes of one decoded sample."""
        return int(np.prod(self.shape)) * self.dtype.itemsize


class FileDataset(StoredDataset):
    """One .npy file per sample: every sample costs an open (a metadata operation) and a small read."""

    format = "files"

    def _labels(self):
        return np.load(io.BytesIO(self.store.read(LABELS)))

    def read(self, i):
        return self.store.read(sample_name(i))

    def decode(self, raw):
        return np.load(io.BytesIO(raw))


class ShardDataset(StoredDataset):
    """Packed shards: sample `i` is one positioned read at the index's offset, in a shard kept open."""

    format = "shards"

    def _labels(self):
        with np.load(io.BytesIO(self.store.read(SHARD_INDEX))) as f:
            self.shard, self.offset, self.length = f["shard"], f["offset"], f["length"]
            return f["label"]

    @property
    def compressed(self) -> bool:
        """True when each sample is zlib-compressed."""
        return bool(self.meta.get("compress"))

    def read(self, i):
        return self.store.read(shard_name(int(self.shard[i])), int(self.offset[i]), int(self.length[i]),
                               keep_open=True)

    def decode(self, raw):
        if self.compressed:
            raw = zlib.decompress(raw)
        return np.frombuffer(bytearray(raw), dtype=self.dtype).reshape(self.shape)

    def shard_count(self) -> int:
        """How many shard files there are."""
        return int(self.meta.get("shards", 0))

    def shard_members(self, k: int) -> np.ndarray:
        """Sample indices stored in shard `k`, in file order."""
        if not hasattr(self, "_members"):  # one pass over the index, not one per shard and call
            order = np.argsort(self.shard, kind="stable")
            bounds = np.searchsorted(self.shard[order], np.arange(self.shard_count() + 1))
            self._members = [order[bounds[j]:bounds[j + 1]] for j in range(self.shard_count())]
        return self._members[k]


class HDF5Dataset(StoredDataset):
    """One HDF5 file: opened once per process (through the store, so opens and bytes are counted)."""

    format = "hdf5"

    def _labels(self):
        self._h5, self._x, self._pid = None, None, None
        return np.asarray(self._file()["y"])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_h5"] = state["_x"] = None
        return state

    def _file(self):
        if self._h5 is None or self._pid != os.getpid():  # h5py handles never cross a fork
            import h5py
            self._h5 = h5py.File(_StoreFile(self.store, HDF5_FILE), "r")
            self._x = self._h5["x"]  # one Dataset object: its chunk cache lives as long as it does
            self._pid = os.getpid()
        return self._h5

    def read(self, i):
        self._file()
        return self._x[i]

    def decode(self, raw):
        return np.asarray(raw)


class _StoreFile(io.RawIOBase):
    """A read-only file object over a store, so h5py's reads pass through its counting and throttling."""

    def __init__(self, store, name: str):
        super().__init__()
        self.store, self.name_in_store = store, name
        self._size = store.size(name)
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self):
        return self._pos

    def readinto(self, buffer):
        n = min(len(buffer), max(self._size - self._pos, 0))
        if n == 0:
            return 0
        got = self.store.readinto(self.name_in_store, memoryview(buffer)[:n], self._pos, keep_open=True)
        self._pos += got
        return got


def stored_bytes(directory) -> int:
    """Bytes on disk under `directory` (all files)."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def file_count(directory) -> int:
    """Files under `directory`."""
    return sum(1 for p in Path(directory).rglob("*") if p.is_file())


__all__ = ["FORMATS", "DataFormatError", "write_dataset", "open_dataset", "read_index", "StoredDataset",
           "FileDataset", "ShardDataset", "HDF5Dataset", "sample_name", "shard_name", "stored_bytes", "file_count"]
