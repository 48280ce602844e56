"""Lab 05's data set spread over nodes (TACC's FanStore), the node-shared cache (Argonne's Lobster), and the read /
decode thread balance — measured on real rank processes, every read counted by where its bytes came from.

    data = make_dataset(out)                                   # packed shards on the "shared file system"
    res = spread_epochs(out, world=2, ranks_per_node=1)        # shared FS only, then spread: local + peer reads
    res = cache_epochs(out, world=4)                           # 4 ranks of one node: no cache, private, node cache
    res = balance_threads(out, total=4)                        # read vs decode threads (experiments.read_decode)
    res = spread_across_nodes(out, env={**os.environ, **cluster.env()})   # the same on 2 namespace nodes (srun)

Each rank is a process (an SpmdPool rank on one machine, an srun task on the namespace cluster) that stages its
node's partition, serves it to the other nodes from a peer server, and reads its shard of each epoch in the seeded
sampler's order through one read path: node cache, its node's partition, the owning peer, or the shared file system
(a `ThrottledStore`: a round trip per request, like a parallel file system's servers). Each rank writes
`<out>/runs/<tag>/events/rank-<r>.jsonl`: a start event (host, node, peers), one `read` event per read (sample,
source, peer host, bytes), one `epoch` event per epoch (reads and bytes by source, remote reads per peer host,
seconds); each peer server writes `server-node<j>.jsonl` (who it served: client host and address). A grader reads
those files: who read what from which host.

On one machine every "node" is a folder of its own and its server listens on loopback; on the namespace cluster each
node's folders are in its own /dev/shm and its server listens on the node's address, so a remote read crosses the
bridge between two hosts.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..ckpt.private import private_dir
from ..data.formats import write_dataset
from ..data.order import sampler_order
from ..data.spread import (SOURCES, GlobalIndex, NodeCache, PeerServer, SpreadError, SpreadReader, difference,
                           stage_partition, write_checksums)
from ..data.store import ThrottledStore
from ..data.synthetic import heat_fields
from ..dist import rank_info
from ..errors import ScalelabError
from .read_decode import balance_figure, balance_threads, decode_augment  # the lab finds them here too

CACHES = ("none", "private", "node")
"""Cache modes: none; one folder per rank; one folder per node shared by its ranks."""
POLL_S = 0.005


# -- the data set and the per-run secret ---------------------------------------------------------------------------
def make_dataset(out, samples: int = 512, size: int = 32, channels: int = 1, samples_per_shard: int = 16,
                 seed: int = 0, name: str = "data") -> dict:
    """Heat fields as 8-bit images (like JPEGs: small on disk, decoded to floats), zlib-packed in shards under
    `<out>/shared/<name>` (the shared file system), with the checksums the readers verify. Returns its facts."""
    x = np.concatenate([heat_fields(samples, size, 4, seed + c)[0] for c in range(channels)], axis=1)
    y = heat_fields(samples, size, 4, seed)[1]
    lo, hi = float(x.min()), float(x.max())
    images = np.round((x - lo) / (hi - lo or 1) * 255).astype(np.uint8)
    path = write_dataset(images, y, Path(out) / "shared" / name, "shards", samples_per_shard, compress=True)
    write_checksums(path)
    index = GlobalIndex(path, 1)
    return {"path": str(path), "samples": len(index), "shards": index.shards, "shape": list(images.shape[1:]),
            "stored_bytes": int(index.length.sum()), "decoded_bytes": int(images[0].nbytes * len(images))}


def _secret(out: Path) -> Path:
    """The run's secret for the peer servers, in a file only this account can read (made once)."""
    path = out / "secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path


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
                path: str = "", cleanup: bool = False, timeout: float = 60) -> dict:
    """What each rank runs (an SPMD target, or `python -m scalelab.experiments.spread` under srun): stage, serve,
    read `epochs` epochs in the sampler's order through the read path, write events; returns its epoch rows.
    `cleanup`: the node's first rank removes the staged partition at the end (the caches always go)."""
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
    shared = ThrottledStore(index.shared_dir, open_latency_s=latency_s, bandwidth=bandwidth)
    secret = (out / "secret").read_bytes()
    host = socket.gethostname()
    node_dir = root / f"node{node}" if spread else None
    cache_dir = root / (f"cache-{tag}-node{node}" if cache == "node" else f"cache-{tag}-rank{rank}")
    server, staged = None, {"shards": 0, "bytes": 0, "reads": 0}
    if lead:  # the node's first rank stages its partition, starts its server, clears the node's cache
        node_cache_dir(root)
        if spread:
            staged = stage_partition(index, node, node_cache_dir(node_dir), shared)
            if nodes > 1:
                server = PeerServer(index.shards_of(node), node, node_dir, host=_address(bind),
                                    secret=secret).start()
                _write_json(run / "peers" / f"node{node}.json", {"host": host, "addr": server.host,
                                                                  "port": server.port})
    if cache != "none" and (lead or cache == "private"):
        shutil.rmtree(cache_dir, ignore_errors=True)  # a cache starts empty: epoch 1 must earn its hits
        node_cache_dir(cache_dir)
    peers = _peers(run, nodes, node, timeout) if spread else {}
    _barrier(run, "ready", rank, world, timeout)
    fallback = {"used": False}
    reader = SpreadReader(index, node, shared, node_dir=node_dir, peers=peers, secret=secret, me=host,
                          cache=NodeCache(cache_dir) if cache != "none" else None, path=_load(path, fallback))
    events.write({"type": "start", "rank": rank, "world": world, "host": host, "node": node, "nodes": nodes,
                  "spread": spread, "cache": cache, "lookahead": lookahead, "staged": staged, "path": path or "default",
                  "peers": {str(n): list(p) for n, p in peers.items()}, "t": time.time()})
    order = sampler_order(len(index), rank, world, seed, epochs).reshape(epochs, -1)
    rows = []
    try:
        for epoch, samples in enumerate(order):
            before, t0 = reader.counters.snapshot(), time.perf_counter()
            for i, raw in _reads(reader, samples, lookahead):
                if decode:
                    decode_augment(raw, index.meta, np.random.default_rng([seed, epoch, int(i)]))
                if compute_s:
                    time.sleep(compute_s)
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
        _barrier(run, "done", rank, world, timeout)  # no peer still needs this node's server
        if server is not None:
            server.close()
            _Events(run / "events" / f"server-node{node}.jsonl").write({"type": "served", **server.summary()})
        if lead and cache != "none" or cache == "private":
            shutil.rmtree(cache_dir, ignore_errors=True)
        if lead and cleanup and node_dir is not None:
            shutil.rmtree(node_dir, ignore_errors=True)
            try:
                root.rmdir()  # the last node folder of this run gone: its folder too
            except OSError:
                pass
    return {"rank": rank, "host": host, "node": node, "staged": staged, "epochs": rows}


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


def _load(path: str, fallback: dict):
    """The read path "module:function" a student wrote (imported from the working directory), or None. One that
    raises NotImplementedError (an exercise not done yet) is replaced by the default path, and `fallback["used"]`
    says so: the rest of the lab still runs."""
    if not path:
        return None
    import importlib
    module, _, name = path.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    fn = getattr(importlib.import_module(module), name)

    def read(i, reader):
        if not fallback["used"]:
            try:
                return fn(i, reader)
            except NotImplementedError:
                fallback["used"] = True
        return reader.default_path(i)
    return read


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


# -- what the lab calls ------------------------------------------------------------------------------------------
TARGET = "scalelab.experiments.spread:spread_rank"


def _prepare(out, tag: str) -> Path:
    out = Path(out).resolve()
    if not (out / "shared" / "data" / "crc32.npy").exists():
        raise SpreadError(f"no data set under {out / 'shared' / 'data'}: call make_dataset({str(out)!r}) first")
    _secret(out)
    shutil.rmtree(out / "runs" / tag, ignore_errors=True)  # a run's barriers and events start empty
    return out


def _run_modes(out, world: int, jobs: dict, pool=None, timeout: float = 120) -> dict:
    """Run spread_rank once per tag on `world` rank processes (one pool for all); {tag: the ranks' results}."""
    from ..launch.spmd import SpmdPool
    out = Path(out).resolve()
    own = pool is None
    pool = pool or SpmdPool(world, init="none", run_dir=out / "pool", threads=1)
    try:
        return {tag: pool.run(TARGET, timeout=timeout, out=str(_prepare(out, tag)), tag=tag, **kw)
                for tag, kw in jobs.items()}
    finally:
        if own:
            pool.close()
        shutil.rmtree(default_node_root(out), ignore_errors=True)


def summarize(tag: str, results: list) -> list[dict]:
    """One row per epoch of one run, summed over its ranks: reads and bytes by source, remote reads per (reader
    host -> peer host), bad payloads, the slowest rank's seconds and the run's samples/s."""
    rows = []
    for epoch in range(len(results[0]["epochs"])):
        per_rank = [r["epochs"][epoch] for r in results]
        pairs: dict = {}
        for e in per_rank:
            for peer, c in e["remote_hosts"].items():
                key = f"{e['host']}->{peer}"
                pairs[key] = pairs.get(key, 0) + c["reads"]
        seconds = max(e["seconds"] for e in per_rank)
        samples = sum(e["samples"] for e in per_rank)
        rows.append({"run": tag, "epoch": epoch, "ranks": len(results), "samples": samples,
                     **{f"{s}_reads": sum(e["reads"][s] for e in per_rank) for s in SOURCES},
                     **{f"{s}_bytes": sum(e["bytes"][s] for e in per_rank) for s in SOURCES},
                     "remote_pairs": pairs, "bad": sum(e["bad"] for e in per_rank), "seconds": seconds,
                     "path": sorted({e["path"] for e in per_rank}),
                     "samples_per_s": samples / seconds if seconds else 0.0})
    return rows


def spread_epochs(out, world: int = 2, ranks_per_node: int = 1, epochs: int = 2, latency_s: float = 0.002,
                  compute_s: float = 0.0, path: str = "", pool=None, timeout: float = 120) -> dict:
    """The data set read from the shared file system only, then spread over the nodes (FanStore): `world` rank
    processes on `world // ranks_per_node` "nodes". Returns {"rows": per run and epoch, "staged": bytes staged per
    node, "run_dirs"}; `path`: a student's read path "module:function" for the spread run."""
    common = dict(epochs=epochs, ranks_per_node=ranks_per_node, latency_s=latency_s, compute_s=compute_s)
    res = _run_modes(out, world, {"shared": dict(spread=False, **common),
                                  "spread": dict(spread=True, path=path, **common)}, pool, timeout)
    out = Path(out).resolve()
    return {"rows": [row for tag, r in res.items() for row in summarize(tag, r)],
            "staged": {f"node{r['node']}": r["staged"] for r in res["spread"] if r["staged"]["shards"]},
            "run_dirs": {tag: str(out / "runs" / tag) for tag in res}}


def cache_epochs(out, world: int = 4, epochs: int = 2, caches=CACHES, lookahead: int = 8, latency_s: float = 0.002,
                 compute_s: float = 0.0, path: str = "", pool=None, timeout: float = 120) -> dict:
    """`world` rank processes on one node reading the shared file system through no cache, a cache per rank, and one
    node cache shared by the ranks, prefetched `lookahead` samples ahead along the sampler's known order (Lobster).
    Returns {"rows", "cut": {cache: 1 - shared reads after epoch 1 / samples read after epoch 1 (what no cache
    reads)}, "target": (N-1)/N, "run_dirs"}; `path`: a student's read path for the node-cache run."""
    common = dict(spread=False, epochs=epochs, ranks_per_node=world, latency_s=latency_s, compute_s=compute_s,
                  lookahead=lookahead)
    jobs = {f"cache-{c}": dict(cache=c, path=path if c == "node" else "", **common) for c in caches}
    res = _run_modes(out, world, jobs, pool, timeout)
    rows = [row for tag, r in res.items() for row in summarize(tag, r)]
    later = {tag: [r for r in rows if r["run"] == tag and r["epoch"] > 0] for tag in res}
    cut = {tag[len("cache-"):]: 1 - sum(r["shared_reads"] for r in rs) / max(1, sum(r["samples"] for r in rs))
           for tag, rs in later.items()}  # without a cache every read after epoch 1 is a shared read
    out = Path(out).resolve()
    return {"rows": rows, "cut": cut, "target": (world - 1) / world,
            "run_dirs": {t: str(out / "runs" / t) for t in res}}


def spread_across_nodes(out, env: dict | None = None, nodes: int = 2, epochs: int = 2, latency_s: float = 0.002,
                        path: str = "", timeout: float = 90) -> dict:
    """The spread run on `nodes` nodes of a multi-node Slurm (the namespace cluster), one rank per node (srun): each
    node stages its partition in its own /dev/shm and serves it on its own address. Returns spread_epochs' keys
    plus "hosts" (rank -> host, from the start events) and "served" (each server's clients)."""
    from ..cluster.slurm import slurm_command, slurm_env
    from ..run.procs import scrub_env
    out = _prepare(out, "nodes")
    kwargs = {"out": str(out), "tag": "nodes", "spread": True, "epochs": epochs, "bind": "auto",
              "latency_s": latency_s, "path": path, "cleanup": True, "timeout": timeout / 2}
    r = slurm_command(["srun", "-N", str(nodes), "-n", str(nodes), "--ntasks-per-node", "1", sys.executable, "-m",
                       "scalelab.experiments.spread", json.dumps(kwargs)], slurm_env(scrub_env(env)), timeout=timeout)
    run = out / "runs" / "nodes"
    if r.returncode:
        raise SpreadError(f"srun of the spread ranks failed (exit {r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    results = [json.loads((run / f"result-rank-{k}.json").read_text()) for k in range(nodes)]
    served = [json.loads(p.read_text().splitlines()[-1]) for p in sorted((run / "events").glob("server-*.jsonl"))]
    return {"rows": summarize("nodes", results), "hosts": {res["rank"]: res["host"] for res in results},
            "served": served, "run_dirs": {"nodes": str(run)}}


def main(argv=None) -> int:
    """`python -m scalelab.experiments.spread '<json kwargs>'`: one rank of spread_rank under srun."""
    kwargs = json.loads((argv or sys.argv[1:])[0])
    result = spread_rank(**kwargs)
    _write_json(Path(kwargs["out"]) / "runs" / kwargs["tag"] / f"result-rank-{result['rank']}.json", result)
    return 0


# -- figures -----------------------------------------------------------------------------------------------------
def reads_figure(rows, title: str = "Where each epoch's reads came from"):
    """Stacked bars: reads per source (cache, local, remote, shared) for each run and epoch."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(max(4.8, 0.9 * len(rows)), 3.2))
    ax = fig.add_subplot()
    labels = [f"{r['run']}\nepoch {r['epoch'] + 1}" for r in rows]
    bottom = np.zeros(len(rows))
    colors = {"cache": "#55a868", "local": "#4c72b0", "remote": "#dd8452", "shared": "#c44e52"}
    for s in SOURCES:
        values = np.array([r[f"{s}_reads"] for r in rows], dtype=float)
        ax.bar(range(len(rows)), values, bottom=bottom, color=colors[s], label=s)
        bottom += values
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("sample reads")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


__all__ = ["CACHES", "make_dataset", "node_cache_dir", "default_node_root", "spread_rank", "summarize",
           "spread_epochs", "cache_epochs", "spread_across_nodes", "reads_figure", "decode_augment",
           "balance_threads", "balance_figure"]


if __name__ == "__main__":
    sys.exit(main())
