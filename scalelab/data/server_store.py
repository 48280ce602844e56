"""A store whose files come from a storage server (`scalelab.data.storage_server`): what an engine run with
`data.server = "host:port"` reads its on-disk layout through, so its ranks contend for the server's budgets with every
other job reading from it, and the server's log names each rank's reads.

The run's data folder must lie beneath the server's root (the server says its root when a client connects; on a
cluster, a folder both see under the same path). The connection is opened lazily in the process that reads, so a
DataLoader worker started by fork or spawn opens its own.
"""
from __future__ import annotations

import getpass
import os
from pathlib import Path

from ..dist import rank_info
from .storage_server import StorageClient, StorageServerError
from .store import IOStats


class ServerStore:
    """The files under `directory`, read through the server at `address`; counted like a LocalStore. `job` names
    the reader in the server's log (default: the run folder's name, two levels above the data folder)."""

    def __init__(self, address: str, directory, job: str | None = None):
        self.address, self.directory = address, Path(directory).resolve()
        self.job = job or self.directory.parent.parent.name
        self.stats = IOStats()
        self._client, self._prefix, self._opened, self._pid = None, "", set(), None

    def __getstate__(self):  # a connection never crosses a fork or a pickle
        state = dict(self.__dict__)
        state["_client"], state["_opened"], state["_pid"] = None, set(), None
        return state

    def _connection(self) -> StorageClient:
        if self._client is None or self._pid != os.getpid():
            info = rank_info()
            self._client = StorageClient(self.address, job=self.job, user=getpass.getuser(), rank=info.rank,
                                         job_size=info.world_size)
            root = Path(self._client.root)
            if root != self.directory and root not in self.directory.parents:
                raise StorageServerError(f"data.server {self.address} serves {root}, and the run's data folder "
                                         f"{self.directory} is not beneath it: start the server with a root above "
                                         "the run's output_dir")
            self._prefix = self.directory.relative_to(root).as_posix()
            self._opened, self._pid = set(), os.getpid()
        return self._client

    def _name(self, name: str) -> str:
        return f"{self._prefix}/{name}" if self._prefix not in ("", ".") else name

    def path(self, name: str) -> Path:
        """Where `name` lives on the server's file system."""
        return self.directory / name

    def size(self, name: str) -> int:
        """The file's size (one open on the server)."""
        c = self._connection()
        self.stats.add(opens=1)
        self._opened.add(name)
        return c.open(self._name(name))

    def read(self, name: str, offset: int = 0, length: int = -1, keep_open: bool = False) -> bytes:
        """`length` bytes from `offset`: with keep_open one open per file and connection, else open and read in one."""
        c = self._connection()
        if not keep_open:
            data = c.get(self._name(name)) if offset == 0 and length < 0 else self._read_once(c, name, offset, length)
            self.stats.add(opens=1, reads=1, bytes=len(data))
            return data
        if name not in self._opened:
            c.open(self._name(name))
            self._opened.add(name)
            self.stats.add(opens=1)
        data = c.read(self._name(name), offset, length)
        self.stats.add(reads=1, bytes=len(data))
        return data

    def _read_once(self, c, name, offset, length):
        c.open(self._name(name))
        return c.read(self._name(name), offset, length)

    def readinto(self, name: str, buffer, offset: int = 0, keep_open: bool = False) -> int:
        """Fill `buffer` from `offset`."""
        view = memoryview(buffer).cast("B")
        data = self.read(name, offset, len(view), keep_open)
        view[:len(data)] = data
        return len(data)

    def view(self, name: str) -> memoryview:
        """All of `name` (one request)."""
        return memoryview(self.read(name))

    def close(self) -> None:
        """Close the connection."""
        if self._client is not None:
            self._client.close()
            self._client = None


__all__ = ["ServerStore"]
