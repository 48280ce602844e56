"""A data set spread over the nodes' local storage (TACC's FanStore) and a cache shared by the ranks of one node
(Argonne's Lobster), with every read counted by where its bytes came from.

FanStore's idea: a training set of packed shards is staged once from the shared file system onto the nodes' local
storage, each node holding a partition (shard k on node k mod N); a global index says where every sample lives
(sample -> node, shard, offset, length); a rank reads a sample its node holds from local storage, and one it does
not hold from the peer node that does, over the network — never again from the shared file system.

    index = GlobalIndex("shared/data", nodes=2)          # a shards directory (scalelab.data.formats)
    index.locate(17)                                     # (node, shard, offset, length, crc32)
    stage_partition(index, node=0, node_dir="/dev/shm/me/node0", shared=store)   # node 0's shards, copied once
    server = PeerServer(index.shards_of(0), 0, "/dev/shm/me/node0", host="10.213.0.11", secret=s).start()
    reader = SpreadReader(index, node=0, node_dir=..., peers={1: ("node2", "10.213.0.12", port)}, shared=store,
                          secret=s, cache=NodeCache("/dev/shm/me/cache-node0"))
    raw = reader.read(17)      # cache, local, peer or shared file system: counted in reader.counters

Lobster's idea: the ranks of one node share one cache (here a private folder in /dev/shm), filled ahead of use by
the known sampling order, so after the first epoch a sample one rank read is a hit for every rank of the node.

The peer servers (scalelab.data.peers) answer only clients that know the run's secret; every payload a reader gets
is checked against the crc32 in the global index, so a wrong answer (from a peer, the cache, or a student's read
path) is counted as bad and refused, never used silently.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from ..errors import ScalelabError
from .formats import read_index, shard_name
from .peers import PeerClient, PeerError, PeerServer

SOURCES = ("cache", "local", "remote", "shared")
"""Where a sample's bytes can come from, cheapest first."""
STAGED = "staged.json"
CHECKSUMS = "crc32.npy"


class SpreadError(ScalelabError):
    """A spread data set, its peer server or its node cache is not usable as asked; the message says which."""


# -- the global index ----------------------------------------------------------------------------------------
class GlobalIndex:
    """Where every sample of a shards directory lives once it is spread over `nodes` nodes (shard k on node k % N)."""

    def __init__(self, shared_dir, nodes: int):
        self.shared_dir = Path(shared_dir)
        meta = read_index(self.shared_dir)
        if meta["format"] != "shards":
            raise SpreadError(f"{shared_dir} is a {meta['format']!r} data set; spreading needs packed shards "
                              "(write_dataset(..., 'shards'))")
        if nodes < 1:
            raise SpreadError(f"nodes must be >= 1, got {nodes}")
        self.meta, self.nodes = meta, int(nodes)
        with np.load(self.shared_dir / "shards.npz") as f:
            self.shard, self.offset, self.length = f["shard"], f["offset"], f["length"]
        self.crc = self._checksums()

    def _checksums(self) -> np.ndarray:
        """crc32 of each stored payload: CHECKSUMS, written beside the shards by `write_checksums`."""
        try:
            crc = np.load(self.shared_dir / CHECKSUMS)
        except FileNotFoundError:
            raise SpreadError(f"{self.shared_dir / CHECKSUMS} is missing: run "
                              f"write_checksums({str(self.shared_dir)!r}) once after writing the data set") from None
        if len(crc) != len(self):
            raise SpreadError(f"{self.shared_dir / CHECKSUMS} has {len(crc)} entries for {len(self)} samples: "
                              "write it again")
        return crc

    def __len__(self) -> int:
        return int(self.meta["count"])

    @property
    def shards(self) -> int:
        """How many shard files there are."""
        return int(self.meta.get("shards", 0))

    def node_of_shard(self, k: int) -> int:
        """The node that holds shard `k`: round robin, so partitions differ by at most one shard."""
        return int(k) % self.nodes

    def owner_of(self, i: int) -> int:
        """The node that holds sample `i`."""
        return self.node_of_shard(self.shard[int(i)])

    def locate(self, i: int) -> tuple[int, int, int, int, int]:
        """(node, shard, offset, length, crc32) of sample `i`."""
        i = int(i)
        if not 0 <= i < len(self):
            raise SpreadError(f"sample {i} is out of range ({len(self)} samples in {self.shared_dir})")
        k = int(self.shard[i])
        return self.node_of_shard(k), k, int(self.offset[i]), int(self.length[i]), int(self.crc[i])

    def shards_of(self, node: int) -> list[int]:
        """The shards node `node` holds."""
        return [k for k in range(self.shards) if self.node_of_shard(k) == node]

    def partition(self, node: int) -> np.ndarray:
        """The samples node `node` holds."""
        return np.flatnonzero(np.isin(self.shard, self.shards_of(node)))


def write_checksums(shared_dir) -> Path:
    """Write the crc32 of every stored sample of a shards directory beside it (once, by whoever wrote the data)."""
    shared_dir = Path(shared_dir)
    with np.load(shared_dir / "shards.npz") as f:
        shard, offset, length = f["shard"], f["offset"], f["length"]
    crc = np.zeros(len(shard), np.uint32)
    for k in np.unique(shard):
        blob = (shared_dir / shard_name(int(k))).read_bytes()
        for i in np.flatnonzero(shard == k):
            crc[i] = zlib.crc32(blob[offset[i]:offset[i] + length[i]])
    tmp = shared_dir / f".{CHECKSUMS}.{os.getpid()}.tmp.npy"
    np.save(tmp, crc)
    os.replace(tmp, shared_dir / CHECKSUMS)
    return shared_dir / CHECKSUMS


def stage_partition(index: GlobalIndex, node: int, node_dir, shared) -> dict:
    """Copy node `node`'s shards from the shared store into `node_dir` (once: a staged folder is kept). Returns
    {"shards", "bytes", "reads"}: what staging read from the shared file system (zero when already staged)."""
    node_dir = Path(node_dir)
    marker = node_dir / STAGED
    want = {"source": str(index.shared_dir.resolve()), "nodes": index.nodes, "node": node,
            "shards": index.shards_of(node)}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return {"shards": len(want["shards"]), "bytes": 0, "reads": 0}
    nbytes = 0
    for k in want["shards"]:
        data = shared.read(shard_name(k))
        tmp = node_dir / f".{shard_name(k)}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, node_dir / shard_name(k))
        nbytes += len(data)
    tmp = node_dir / f".{STAGED}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(want))
    os.replace(tmp, marker)  # written last: a folder without it is not staged
    return {"shards": len(want["shards"]), "bytes": nbytes, "reads": len(want["shards"])}


# -- counters ------------------------------------------------------------------------------------------------
class ReadCounters:
    """Reads and bytes by source (cache, local, remote — per peer host —, shared), and bad payloads; thread-safe.
    `log` keeps one (sample, source, peer host, bytes) per read until `drain()` hands it over."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reads, self.bytes = Counter(), Counter()
        self.remote_hosts = defaultdict(Counter)  # peer host -> {"reads", "bytes"}
        self.bad = 0
        self.log: list[tuple[int, str, str, int]] = []

    def add(self, source: str, nbytes: int, peer: str = "", sample: int = -1) -> None:
        """Count one read of `nbytes` from `source` (and the peer's host for a remote read)."""
        with self._lock:
            self.log.append((int(sample), source, peer, int(nbytes)))
            self.reads[source] += 1
            self.bytes[source] += nbytes
            if peer:
                self.remote_hosts[peer]["reads"] += 1
                self.remote_hosts[peer]["bytes"] += nbytes

    def drain(self) -> list[tuple[int, str, str, int]]:
        """The reads logged since the last drain (sample, source, peer host, bytes), oldest first."""
        with self._lock:
            log, self.log = self.log, []
        return log

    def add_bad(self) -> None:
        """Count a payload that did not match its crc32."""
        with self._lock:
            self.bad += 1

    def snapshot(self) -> dict:
        """The counters as plain numbers: {source: reads}, {source: bytes}, remote_hosts, bad."""
        with self._lock:
            return {"reads": {s: self.reads[s] for s in SOURCES}, "bytes": {s: self.bytes[s] for s in SOURCES},
                    "remote_hosts": {h: dict(c) for h, c in sorted(self.remote_hosts.items())}, "bad": self.bad}


def difference(after: dict, before: dict) -> dict:
    """What happened between two snapshots (an epoch's reads)."""
    hosts = {}
    for h, c in after["remote_hosts"].items():
        b = before["remote_hosts"].get(h, {})
        d = {k: v - b.get(k, 0) for k, v in c.items()}
        if d.get("reads"):
            hosts[h] = d
    return {"reads": {s: after["reads"][s] - before["reads"][s] for s in SOURCES},
            "bytes": {s: after["bytes"][s] - before["bytes"][s] for s in SOURCES},
            "remote_hosts": hosts, "bad": after["bad"] - before["bad"]}


# -- the node's shared cache and one rank's read path ---------------------------------------------------------
class NodeCache:
    """Samples kept as files in a folder every rank of the node uses (a private folder in /dev/shm: the caller makes
    it with ckpt.private.private_dir). A sample is written aside and renamed in, so a rank never reads half a file."""

    def __init__(self, directory):
        self.directory = Path(directory)

    def _path(self, i: int) -> Path:
        return self.directory / f"{int(i):08d}.bin"

    def get(self, i: int) -> bytes | None:
        """The cached bytes of sample `i`, or None."""
        try:
            return self._path(i).read_bytes()
        except FileNotFoundError:
            return None

    def __contains__(self, i) -> bool:
        return self._path(i).exists()

    def put(self, i: int, data: bytes) -> None:
        """Keep sample `i` (several ranks may put the same sample: the last rename wins, all hold the same bytes)."""
        tmp = self.directory / f".{int(i):08d}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self._path(i))

    def __len__(self) -> int:
        return sum(1 for p in self.directory.iterdir() if p.suffix == ".bin")


class SpreadReader:
    """One rank's sources: its node's cache, its node's partition, the peers' servers and the shared store — each
    read through a method that counts it. `read(i)` is the default read path (cache, then local or peer when the
    data set is spread, else shared); a student's path can be given as `path(i, reader)` and uses the same methods.

    `peers`: node -> (host, addr, port) of each other node's server (empty: the data set is not spread)."""

    def __init__(self, index: GlobalIndex, node: int, shared, *, node_dir=None, peers: dict | None = None,
                 secret: bytes = b"", cache: NodeCache | None = None, me: str = "", path=None):
        self.index, self.node, self.shared, self.cache = index, node, shared, cache
        self.node_dir = Path(node_dir) if node_dir else None
        self.peers, self.secret = dict(peers or {}), secret
        self.me = me or socket.gethostname()
        self.path = path
        self.counters = ReadCounters()
        self._clients: dict = {}
        self._files: dict = {}
        self._lock = threading.Lock()

    @property
    def spread(self) -> bool:
        """True when the data set is staged on the nodes (reads go local or to peers)."""
        return self.node_dir is not None

    # each source, counted
    def from_cache(self, i: int) -> bytes | None:
        """Sample `i` from the node cache (None on a miss)."""
        data = self.cache.get(i) if self.cache is not None else None
        if data is not None:
            self.counters.add("cache", len(data), sample=i)
        return data

    def from_local(self, i: int) -> bytes:
        """Sample `i` from this node's partition (SpreadError when another node holds it)."""
        node, k, offset, length, _ = self.index.locate(i)
        if not self.spread:
            raise SpreadError(f"sample {i}: this run's data set is not spread over the nodes (reader.spread is "
                              "False): it is only on the shared file system (from_shared)")
        if node != self.node:
            raise SpreadError(f"sample {i} is held by node {node}, not by this node ({self.node}): read it from "
                              "its owner (from_peer)")
        with self._lock:
            if k not in self._files:
                self._files[k] = os.open(self.node_dir / shard_name(k), os.O_RDONLY)
            fd = self._files[k]
        data = os.pread(fd, length, offset)
        self.counters.add("local", len(data), sample=i)
        return data

    def from_peer(self, i: int, node: int | None = None) -> bytes:
        """Sample `i` from the server of `node` (default: the node the index names)."""
        owner, k, offset, length, _ = self.index.locate(i)
        node = owner if node is None else node
        if node not in self.peers:
            raise SpreadError(f"no peer server for node {node} (peers: {sorted(self.peers)})")
        host, addr, port = self.peers[node]
        with self._lock:
            if node not in self._clients:
                self._clients[node] = PeerClient(addr, port, self.secret, self.me)
            client = self._clients[node]
        data = client.read(k, offset, length)
        self.counters.add("remote", len(data), peer=host, sample=i)
        return data

    def from_shared(self, i: int) -> bytes:
        """Sample `i` from the shared file system (one request: a round trip to the file system's servers)."""
        _, k, offset, length, _ = self.index.locate(i)
        data = self.shared.read(shard_name(k), offset, length)
        self.counters.add("shared", len(data), sample=i)
        return data

    def default_path(self, i: int) -> bytes:
        """Cache, then this node's partition or the owner's server when spread, else the shared file system."""
        data = self.from_cache(i)
        if data is not None:
            return data
        if self.spread:
            data = self.from_local(i) if self.index.owner_of(i) == self.node else self.from_peer(i)
        else:
            data = self.from_shared(i)
        if self.cache is not None:
            self.cache.put(i, data)
        return data

    def read(self, i: int) -> bytes:
        """Sample `i`'s stored bytes by the read path; a payload that fails its crc32 is counted bad and refused."""
        data = self.path(int(i), self) if self.path else self.default_path(int(i))
        if not isinstance(data, (bytes, bytearray)) or zlib.crc32(data) != self.index.locate(i)[4]:
            self.counters.add_bad()
            raise SpreadError(f"the read path returned wrong bytes for sample {i}")
        return bytes(data)

    def close(self) -> None:
        """Close peer connections and open partition files."""
        for c in self._clients.values():
            c.close()
        for fd in self._files.values():
            os.close(fd)
        self._clients, self._files = {}, {}


__all__ = ["SOURCES", "SpreadError", "GlobalIndex", "write_checksums", "stage_partition", "ReadCounters",
           "difference", "NodeCache", "SpreadReader", "PeerServer", "PeerClient", "PeerError"]
