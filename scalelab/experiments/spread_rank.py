"""The rank side of Lab 05's spread data set (scalelab.experiments.spread): what each rank process runs.

    python -m scalelab.experiments.spread_rank '<json kwargs of spread_rank>'     # one srun task
    pool.run("scalelab.experiments.spread_rank:spread_rank", out=..., tag=..., ...) # one SpmdPool job

A rank finds its node (rank // ranks_per_node); the node's first rank stages the node's partition from the shared
file system into the node's folder, starts the node's peer server and clears the node's cache; every rank then reads
its share of each epoch in the seeded sampler's order through one read path and writes its events. The ranks meet
in files on the shared file system (peers/, barrier/), so the same code runs under an SpmdPool and under srun.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..ckpt.private import private_dir
from ..data.order import sampler_order
from ..data.spread import GlobalIndex, NodeCache, PeerServer, SpreadError, SpreadReader, difference, stage_partition
from ..data.store import ThrottledStore
from ..dist import rank_info
from ..errors import ScalelabError
from .read_decode import decode_augment

CACHES = ("none", "private", "node")
"""Cache modes: none; one folder per rank; one folder per node shared by its ranks."""
POLL_S = 0.005


def node_cache_dir(path) -> Path:
    """A node-local folder only this account can use (ckpt.private's rules: a symbolic link, a folder of another
    account's, or one under a folder others control is refused); SpreadError naming it otherwise."""
    try:
        return private_dir(path)
    except ScalelabError as e:
        raise SpreadError(f"node folder refused: {e}") from None


def default_node_root(out) -> Path:
    """Where nodes keep their partitions and caches: /dev/shm (node memory; on the namespace cluster each node's
    own), in a folder of this account's named for the run."""
    digest = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]
    return Path("/dev/shm") / f"scalelab-spread-{os.geteuid()}" / digest


# -- one rank ----------------------------------------------------------------------------------------------------
def spread_rank(out: str, tag: str, spread: bool = True, cache: str = "none", epochs: int = 2, seed: int = 0,
                ranks_per_node: int = 1, node_root: str = "", bind: str = "127.0.0.1", latency_s: float = 0.002,
                bandwidth: float = 0.0, compute_s: float = 0.0, lookahead: int = 0, decode: bool = False,
                path: str = "", code_dir: str = "", storage: str = "", cleanup: bool = False,
                timeout: float = 60) -> dict:
    """What each rank runs (an SPMD target, or `python -m scalelab.experiments.spread` under srun): stage, serve,
    read `epochs` epochs in the sampler's order through the read path, write events; returns its epoch rows.
    `storage`: "host:port" of a storage server (scalelab.data.storage_server) to use as the shared file system
    instead of a ThrottledStore (its request log then shows each epoch's shared reads, tagged "epoch-<e>");
    `path`: a read path "module:function" (`fn(i, reader) -> bytes`) imported from `code_dir`; `cleanup`: the node's
    first rank removes the staged partition at the end (the caches always go)."""
    info = rank_info()
    rank, world = info.rank, info.world_size
    if cache not in CACHES:
        raise SpreadError(f"cache {cache!r} is not one of {', '.join(CACHES)}")
    if world % ranks_per_node:
        raise SpreadError(f"{world} ranks do not fill nodes of {ranks_per_node} ranks each")
    nodes, node, lead = world // ranks_per_node, rank // ranks_per_node, rank % ranks_per_node == 0
    out, run = Path(out), Path(out) / "runs" / tag
    events = _Events(run / "events" / f"rank-{rank}.jsonl")
    root = Path(node_root) if node_root else default_node_root(out)
    index = GlobalIndex(out / "shared" / "data", nodes)
    shared = ServerStore(storage, tag, rank) if storage else \
        ThrottledStore(index.shared_dir, open_latency_s=latency_s, bandwidth=bandwidth)
    secret = (out / "secret").read_bytes()
    host = socket.gethostname()
    node_dir = root / f"node{node}" if spread else None
    cache_dir = root / (f"cache-{tag}-node{node}" if cache == "node" else f"cache-{tag}-rank{rank}")
    server, staged = None, {"shards": 0, "bytes": 0, "reads": 0}
    if lead:  # the node's first rank stages its partition, starts its server, clears the node's cache
        server, staged = _stage_and_serve(index, node, nodes, root, node_dir, shared, run, host, bind, secret)
    if cache != "none" and (lead or cache == "private"):
        shutil.rmtree(cache_dir, ignore_errors=True)  # a cache starts empty: epoch 1 must earn its hits
        node_cache_dir(cache_dir)
    peers = _peers(run, nodes, node, timeout) if spread else {}
    _barrier(run, "ready", rank, world, timeout)
    fallback = {"used": False}
    read_path, code = _load(path, fallback, code_dir)
    reader = SpreadReader(index, node, shared, node_dir=node_dir, peers=peers, secret=secret, me=host,
                          cache=NodeCache(cache_dir) if cache != "none" else None, path=read_path)
    events.write({"type": "start", "rank": rank, "world": world, "host": host, "node": node, "nodes": nodes,
                  "spread": spread, "cache": cache, "lookahead": lookahead, "staged": staged, "path": path or "default",
                  "code": code,
                  "peers": {str(n): list(p) for n, p in peers.items()}, "t": time.time()})
    order = sampler_order(len(index), rank, world, seed, epochs).reshape(epochs, -1)
    rows = []
    try:
        for epoch, samples in enumerate(order):
            shared.tag = f"epoch-{epoch}"  # a storage server logs it with each request
            before, t0 = reader.counters.snapshot(), time.perf_counter()
            _read_epoch(reader, index, samples, lookahead, decode, compute_s, seed, epoch)
            seconds = time.perf_counter() - t0
            for i, source, peer, nbytes in reader.counters.drain():
                events.write({"type": "read", "rank": rank, "host": host, "epoch": epoch, "sample": i,
                              "source": source, "peer": peer, "bytes": nbytes})
            row = {"rank": rank, "host": host, "node": node, "epoch": epoch, "samples": len(samples),
                   "path": "default (the given one is not implemented)" if fallback["used"] else path or "default",
                   "seconds": seconds, "samples_per_s": len(samples) / seconds if seconds else 0.0,
                   **difference(reader.counters.snapshot(), before)}
            events.write({"type": "epoch", **row})
            rows.append(row)
            _barrier(run, f"epoch-{epoch}", rank, world, timeout)  # a node's cache sees the whole epoch first
    finally:
        reader.close()
        if storage:
            shared.close()
        _barrier(run, "done", rank, world, timeout)  # no peer still needs this node's server
        if server is not None:
            server.close()
            _Events(run / "events" / f"server-node{node}.jsonl").write({"type": "served", **server.summary()})
        _clean_up(root, node_dir, cache_dir, lead and cache != "none" or cache == "private", lead and cleanup)
    return {"rank": rank, "host": host, "node": node, "staged": staged, "epochs": rows}


def _stage_and_serve(index, node: int, nodes: int, root: Path, node_dir: Path | None, shared, run: Path, host: str,
                     bind: str, secret: bytes):
    """The node's first rank: the node's folder made, and when spreading, its partition staged from the shared
    file system and (with other nodes) a peer server for it started and announced. (the server or None, staged)"""
    server, staged = None, {"shards": 0, "bytes": 0, "reads": 0}
    node_cache_dir(root)
    if node_dir is not None:
        staged = stage_partition(index, node, node_cache_dir(node_dir), shared)
        if nodes > 1:
            server = PeerServer(index.shards_of(node), node, node_dir, host=_address(bind), secret=secret).start()
            _write_json(run / "peers" / f"node{node}.json", {"host": host, "addr": server.host, "port": server.port})
    return server, staged


def _read_epoch(reader, index, samples, lookahead: int, decode: bool, compute_s: float, seed: int,
                epoch: int) -> None:
    """One epoch's samples through the read path, each decoded and augmented and followed by `compute_s` of
    simulated compute when asked."""
    for i, raw in _reads(reader, samples, lookahead):
        if decode:
            decode_augment(raw, index.meta, np.random.default_rng([seed, epoch, int(i)]))
        if compute_s:
            time.sleep(compute_s)


def _clean_up(root: Path, node_dir: Path | None, cache_dir: Path, cache: bool, staged: bool) -> None:
    """The rank's cache (`cache`: its own, or the node's for its first rank), and with `staged` the node's staged
    partition and, once the last node's is gone, the run's folder of them."""
    if cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    if staged and node_dir is not None:
        shutil.rmtree(node_dir, ignore_errors=True)
        try:
            root.rmdir()  # the last node folder of this run gone: its folder too
        except OSError:
            pass


class ServerStore:
    """A storage server (scalelab.data.storage_server) as the shared file system of spread_rank: each shard opened
    once (one metadata operation at the server), then positioned reads; thread-safe (one request at a time)."""

    def __init__(self, address: str, job: str, rank: int):
        from ..data.storage_server import StorageClient
        self.client = StorageClient(address, job=job, rank=rank)
        self.client.tag = "stage"
        self._opened: set = set()
        self._lock = threading.Lock()

    @property
    def tag(self):
        """What the server logs with each request."""
        return self.client.tag

    @tag.setter
    def tag(self, value) -> None:
        self.client.tag = value

    def read(self, name: str, offset: int = 0, length: int = -1) -> bytes:
        """`length` bytes of `name` from `offset` (-1: to the end)."""
        with self._lock:
            if name not in self._opened:
                self.client.open(name)
                self._opened.add(name)
            return self.client.read(name, offset, length)

    def close(self) -> None:
        """Close the connection."""
        self.client.close()


def _reads(reader, samples, lookahead: int):
    """(sample, bytes) in order; with lookahead, a thread reads ahead along the known order (up to `lookahead`
    samples in flight) and hands the bytes over, so reading overlaps the consumer's work."""
    if not lookahead:
        for i in samples:
            yield i, reader.read(i)
        return
    q, stop = queue.Queue(maxsize=lookahead), threading.Event()

    def ahead():
        try:
            for i in samples:
                if stop.is_set():
                    return
                q.put((i, reader.read(i), None))
        except BaseException as e:  # handed to the consumer, which raises it
            q.put((None, None, e))

    t = threading.Thread(target=ahead, name="prefetch", daemon=True)
    t.start()
    try:
        for _ in samples:
            i, raw, error = q.get()
            if error is not None:
                raise error
            yield i, raw
    finally:
        stop.set()
        while t.is_alive():  # unblock a put on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                time.sleep(POLL_S)


def _address(bind: str) -> str:
    """The address a node's server listens on: `bind`, or "auto": the address this host's name resolves to."""
    return socket.gethostbyname(socket.gethostname()) if bind == "auto" else bind


def _load(path: str, fallback: dict, code_dir: str = ""):
    """(read path, {file: sha256}) for "module:function" imported from `code_dir` (a module changed on disk since
    this rank imported it is reloaded), or (None, {}). A path that raises NotImplementedError (an exercise not done
    yet) is replaced by the default path and `fallback["used"]` says so: the rest of the lab still runs."""
    if not path:
        return None, {}
    from ..launch.spmd_rank import resolve
    code_dir = os.path.abspath(code_dir or os.getcwd())
    if code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    fn = resolve(path)
    file = Path(sys.modules[fn.__module__].__file__)
    code = {file.name: hashlib.sha256(file.read_bytes()).hexdigest()}

    def read(i, reader):
        if not fallback["used"]:
            try:
                return fn(i, reader)
            except NotImplementedError:
                fallback["used"] = True
        return reader.default_path(i)
    return read, code


def _peers(run: Path, nodes: int, node: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    peers = {}
    while len(peers) < nodes - 1:
        for n in range(nodes):
            p = run / "peers" / f"node{n}.json"
            if n != node and n not in peers and p.exists():
                d = json.loads(p.read_text())
                peers[n] = (d["host"], d["addr"], d["port"])
        if time.monotonic() > deadline:
            raise SpreadError(f"peer servers of nodes {sorted(set(range(nodes)) - set(peers) - {node})} did not "
                              f"show in {run / 'peers'} within {timeout:g} s")
        time.sleep(POLL_S)
    return peers


def _barrier(run: Path, name: str, rank: int, world: int, timeout: float) -> None:
    """Wait until every rank has reached `name` (files on the shared file system: works under srun as on one host)."""
    d = run / "barrier" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank-{rank}").touch()
    deadline = time.monotonic() + timeout
    while sum(1 for _ in d.iterdir()) < world:
        if time.monotonic() > deadline:
            raise SpreadError(f"not every rank reached {name!r} within {timeout:g} s (see {d})")
        time.sleep(POLL_S)


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class _Events:
    """Appends JSON lines to one file (one writer per file)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, event: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")


def main(argv=None) -> int:
    """`python -m scalelab.experiments.spread '<json kwargs>'`: one rank of spread_rank under srun."""
    kwargs = json.loads((argv or sys.argv[1:])[0])
    result = spread_rank(**kwargs)
    _write_json(Path(kwargs["out"]) / "runs" / kwargs["tag"] / f"result-rank-{result['rank']}.json", result)
    return 0


__all__ = ["CACHES", "node_cache_dir", "default_node_root", "spread_rank", "ServerStore", "main"]


if __name__ == "__main__":
    sys.exit(main())
