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
(a `ThrottledStore`: a round trip per request, like a parallel file system's servers; or a storage server,
`storage=`). The rank side is `spread_rank` (experiments.spread_rank). Each rank writes
`<out>/runs/<tag>/events/rank-<r>.jsonl`: a start event (host, node, peers), one `read` event per read (sample,
source, peer host, bytes), one `epoch` event per epoch (reads and bytes by source, remote reads per peer host,
seconds); each peer server writes `server-node<j>.jsonl` (who it served: client host and address). A grader reads
those files: who read what from which host.

On one machine every "node" is a folder of its own and its server listens on loopback; on the namespace cluster each
node's folders are in its own /dev/shm and its server listens on the node's address, so a remote read crosses the
bridge between two hosts.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path

import numpy as np

from ..data.formats import write_dataset
from ..data.spread import SOURCES, GlobalIndex, SpreadError, write_checksums
from ..data.synthetic import heat_fields
from ..paths import json_lines
from .read_decode import balance_figure, balance_threads, decode_augment  # the lab finds them here too
from .spread_rank import CACHES, default_node_root, node_cache_dir, spread_rank  # the rank side


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


# -- what the lab calls ------------------------------------------------------------------------------------------
TARGET = "scalelab.experiments.spread_rank:spread_rank"


def _prepare(out, tag: str) -> Path:
    out = Path(out).resolve()
    if not (out / "shared" / "data" / "crc32.npy").exists():
        raise SpreadError(f"no data set under {out / 'shared' / 'data'}: call make_dataset({str(out)!r}) first")
    _secret(out)
    shutil.rmtree(out / "runs" / tag, ignore_errors=True)  # a run's barriers and events start empty
    return out


def _tag(name: str, key: str) -> str:
    return f"{name}-{key}" if name else key


def _run_modes(out, world: int, jobs: dict, pool=None, timeout: float = 120, name: str = "") -> dict:
    """Run spread_rank once per job on `world` rank processes (one pool for all), each in its own run folder
    `<out>/runs/<name>-<key>`; {key: the ranks' results}."""
    from ..launch.spmd import SpmdPool
    out = Path(out).resolve()
    own = pool is None
    pool = pool or SpmdPool(world, init="none", run_dir=out / "pool", threads=1)
    try:
        return {key: pool.run(TARGET, timeout=timeout, out=str(_prepare(out, _tag(name, key))), tag=_tag(name, key),
                              **kw) for key, kw in jobs.items()}
    finally:
        if own:
            pool.close()
        for root in {kw.get("node_root") or default_node_root(out) for kw in jobs.values()}:
            shutil.rmtree(root, ignore_errors=True)


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
                  compute_s: float = 0.0, path: str = "", code_dir: str = "", runs=("shared", "spread"),
                  name: str = "", storage: str = "", node_root: str = "", pool=None, timeout: float = 120) -> dict:
    """The data set read from the shared file system only, then spread over the nodes (FanStore): `world` rank
    processes on `world // ranks_per_node` "nodes". Returns {"rows": per run and epoch, "staged": bytes staged per
    node, "run_dirs"}. `path`: a student's read path "module:function" for the spread run, imported from `code_dir`
    (default: this process's working directory, the notebook's folder); `runs`: which of the two runs to run; `name`:
    a prefix that keeps this call's run folders apart from another call's (`<out>/runs/<name>-spread`); `storage`:
    a storage server's "host:port" as the shared file system (see spread_rank); `node_root`: where the "nodes" keep
    partitions and caches (default: a folder of this account's in /dev/shm; removed at the end either way)."""
    common = dict(epochs=epochs, ranks_per_node=ranks_per_node, latency_s=latency_s, compute_s=compute_s,
                  storage=storage, node_root=node_root)
    jobs = {"shared": dict(spread=False, **common),
            "spread": dict(spread=True, path=path, code_dir=code_dir or os.getcwd(), **common)}
    res = _run_modes(out, world, {key: jobs[key] for key in runs}, pool, timeout, name)
    out = Path(out).resolve()
    return {"rows": [row for tag, r in res.items() for row in summarize(tag, r)],
            "staged": {f"node{r['node']}": r["staged"] for r in res.get("spread", []) if r["staged"]["shards"]},
            "run_dirs": {key: str(out / "runs" / _tag(name, key)) for key in res}}


def cache_epochs(out, world: int = 4, epochs: int = 2, caches=CACHES, lookahead: int = 8, latency_s: float = 0.002,
                 compute_s: float = 0.0, path: str = "", code_dir: str = "", name: str = "", storage: str = "",
                 node_root: str = "", pool=None, timeout: float = 120) -> dict:
    """`world` rank processes on one node reading the shared file system through no cache, a cache per rank, and one
    node cache shared by the ranks, prefetched `lookahead` samples ahead along the sampler's known order (Lobster).
    Returns {"rows", "cut": {cache: 1 - shared reads after epoch 1 / samples read after epoch 1 (what no cache
    reads)}, "target": (N-1)/N, "run_dirs"}; `path`: a student's read path for the node-cache run (from `code_dir`);
    `name`: a prefix for this call's run folders; `storage`: a storage server as the shared file system; `node_root`:
    as in spread_epochs."""
    common = dict(spread=False, epochs=epochs, ranks_per_node=world, latency_s=latency_s, compute_s=compute_s,
                  storage=storage, node_root=node_root, lookahead=lookahead)
    jobs = {f"cache-{c}": dict(cache=c, path=path if c == "node" else "", code_dir=code_dir or os.getcwd(), **common)
            for c in caches}
    res = _run_modes(out, world, jobs, pool, timeout, name)
    rows = [row for tag, r in res.items() for row in summarize(tag, r)]
    later = {tag: [r for r in rows if r["run"] == tag and r["epoch"] > 0] for tag in res}
    cut = {tag[len("cache-"):]: 1 - sum(r["shared_reads"] for r in rs) / max(1, sum(r["samples"] for r in rs))
           for tag, rs in later.items()}  # without a cache every read after epoch 1 is a shared read
    out = Path(out).resolve()
    return {"rows": rows, "cut": cut, "target": (world - 1) / world,
            "run_dirs": {key: str(out / "runs" / _tag(name, key)) for key in res}}


def spread_across_nodes(out, env: dict | None = None, nodes: int = 2, epochs: int = 2, latency_s: float = 0.002,
                        path: str = "", timeout: float = 90) -> dict:
    """The spread run on `nodes` nodes of a multi-node Slurm (the namespace cluster), one rank per node (srun): each
    node stages its partition in its own /dev/shm and serves it on its own address. Returns spread_epochs' keys
    plus "hosts" (each rank's host, in rank order) and "served" (each server's clients)."""
    from ..cluster.slurm import slurm_command, slurm_env
    from ..run.procs import scrub_env
    out = _prepare(out, "nodes")
    kwargs = {"out": str(out), "tag": "nodes", "spread": True, "epochs": epochs, "bind": "auto",
              "latency_s": latency_s, "path": path, "code_dir": os.getcwd(), "cleanup": True, "timeout": timeout / 2}
    r = slurm_command(["srun", "-N", str(nodes), "-n", str(nodes), "--ntasks-per-node", "1", sys.executable, "-m",
                       "scalelab.experiments.spread_rank", json.dumps(kwargs)], slurm_env(scrub_env(env)),
                      timeout=timeout)
    run = out / "runs" / "nodes"
    if r.returncode:
        raise SpreadError(f"srun of the spread ranks failed (exit {r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    results = [json.loads((run / f"result-rank-{k}.json").read_text()) for k in range(nodes)]
    served = [json.loads(p.read_text().splitlines()[-1]) for p in sorted((run / "events").glob("server-*.jsonl"))]
    return {"rows": summarize("nodes", results), "hosts": [res["host"] for res in results],
            "served": served, "run_dirs": {"nodes": str(run)}}


# -- what a grader reads ---------------------------------------------------------------------------------------
def spread_verdict(workdir, run_dir, max_bytes: int = 16 << 20) -> dict:
    """A spread or cache run re-derived from its files alone, read beneath `workdir` as a grader reads a submission
    (no symbolic link followed, sizes bounded): the ranks' start, read and epoch events, the peer servers' logs, and
    the data set's shard index. Returns world, nodes, hosts (rank -> host), code (rank -> {file: sha256}), per epoch
    the reads by source counted from the read events ("epochs"), the read paths the epochs ran ("paths": a student's
    "module:function", or the default's fallback note when it raised NotImplementedError), and what a read path can
    get wrong: "misplaced" (local reads of samples another node holds), "misrouted" (remote reads from a host that is
    not the owner's), "unserved" (per node: remote reads of its samples minus what its server logged), "not_once"
    (epochs whose read events, over all ranks, are not the sampler's draw with each sample once), "bad" (payloads
    refused)."""
    import io
    from ..paths import read_beneath
    from .profiling import read_run_file
    run = os.path.relpath(str(run_dir), str(workdir)) if os.path.isabs(str(run_dir)) else str(run_dir)

    def lines(name):
        text = read_run_file(workdir, os.path.join(run, "events", name), max_bytes)
        return json_lines(text)

    first = lines("rank-0.jsonl")
    start0 = next(e for e in first if e["type"] == "start")
    world, nodes = int(start0["world"]), int(start0["nodes"])
    events = {0: first, **{r: lines(f"rank-{r}.jsonl") for r in range(1, world)}}
    starts = {r: next(e for e in ev if e["type"] == "start") for r, ev in events.items()}
    data = os.path.normpath(os.path.join(run, "..", "..", "shared", "data", "shards.npz"))
    with np.load(io.BytesIO(read_beneath(workdir, data, max_bytes))) as f:
        owner = f["shard"] % nodes
    reads = [e for ev in events.values() for e in ev if e["type"] == "read"]
    epochs = sorted({e["epoch"] for e in reads})
    by_epoch = [{s: sum(1 for e in reads if e["epoch"] == k and e["source"] == s) for s in SOURCES} for k in epochs]
    node_of = {r: int(st["node"]) for r, st in starts.items()}
    host_of_node = {int(n): p[0] for st in starts.values() for n, p in st.get("peers", {}).items()}
    misplaced = sum(1 for e in reads if e["source"] == "local" and owner[e["sample"]] != node_of[e["rank"]])
    misrouted = sum(1 for e in reads
                    if e["source"] == "remote" and e["peer"] != host_of_node.get(int(owner[e["sample"]])))
    unserved = {}
    if start0.get("spread") and nodes > 1:
        for n in range(nodes):
            served = lines(f"server-node{n}.jsonl")[-1]
            got = sum(c["reads"] for c in served["clients"].values())
            unserved[n] = sum(1 for e in reads if e["source"] == "remote" and owner[e["sample"]] == n) - got
    drawn = len(owner) // world * world  # the sampler's epoch: n // world samples per rank, none twice
    not_once = [k for k in epochs if len(_consumed(events, k)) != drawn or len(set(_consumed(events, k))) != drawn]
    return {"world": world, "nodes": nodes, "hosts": {r: st["host"] for r, st in starts.items()},
            "code": {r: st.get("code", {}) for r, st in starts.items()}, "epochs": by_epoch, "misplaced": misplaced,
            "paths": sorted({e.get("path", "") for ev in events.values() for e in ev if e["type"] == "epoch"}),
            "misrouted": misrouted, "unserved": unserved, "not_once": not_once,
            "bad": sum(e.get("bad", 0) for ev in events.values() for e in ev if e["type"] == "epoch")}


def _consumed(events, epoch) -> list:
    """The samples the ranks read in `epoch` (each read event is one sample reaching a rank, whatever its source)."""
    return [e["sample"] for ev in events.values() for e in ev if e["type"] == "read" and e["epoch"] == epoch]


# -- figures -----------------------------------------------------------------------------------------------------
def reads_figure(rows, title: str = "Where each epoch's reads came from"):
    """Stacked bars: reads per source (cache, local, remote, shared) for each run and epoch."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(max(4.8, 0.75 * len(rows) + 1.5), 3.2))
    ax = fig.add_subplot()
    labels = [r["run"].replace("cache-", "cache\n") + f"\nepoch {r['epoch'] + 1}" for r in rows]
    bottom = np.zeros(len(rows))
    colors = {"cache": "#55a868", "local": "#4c72b0", "remote": "#dd8452", "shared": "#c44e52"}
    for s in SOURCES:
        values = np.array([r[f"{s}_reads"] for r in rows], dtype=float)
        ax.bar(range(len(rows)), values, bottom=bottom, color=colors[s], label=s)
        bottom += values
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("sample reads")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


__all__ = ["CACHES", "make_dataset", "node_cache_dir", "default_node_root", "spread_rank", "summarize",
           "spread_verdict",
           "spread_epochs", "cache_epochs", "spread_across_nodes", "reads_figure", "decode_augment",
           "balance_threads", "balance_figure"]
