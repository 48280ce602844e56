"""A data set spread over nodes (FanStore) and a node-shared cache (Lobster), issue 31 item 3: the global index and
the staging, the peer server's secret and bounds, the counted read path, the private cache folder, then real rank
processes (4 ranks: 2 "nodes" of 2 on one machine) and 2 namespace nodes, whose events name both hosts."""
from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import numpy as np
import pytest

from scalelab.data.formats import shard_name
from scalelab.data.peers import PeerClient, PeerError, PeerServer
from scalelab.data.spread import GlobalIndex, NodeCache, SpreadError, SpreadReader, stage_partition
from scalelab.data.store import LocalStore
from scalelab.experiments import spread as sx

SECRET = b"s" * 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """64 samples in 8 shards on the 'shared file system'."""
    out = tmp_path_factory.mktemp("spread")
    facts = sx.make_dataset(out, samples=64, size=16, samples_per_shard=8)
    return out, facts


def _index(data, nodes=2):
    return GlobalIndex(Path(data[1]["path"]), nodes)


def test_the_index_puts_every_sample_on_exactly_one_node_and_partitions_differ_by_at_most_a_shard(data):
    index = _index(data, nodes=3)
    parts = [set(index.partition(n)) for n in range(3)]
    assert set().union(*parts) == set(range(64)) and sum(map(len, parts)) == 64
    assert max(map(len, parts)) - min(map(len, parts)) <= 8
    node, shard, offset, length, _ = index.locate(13)
    assert node == index.owner_of(13) == shard % 3 and 13 in parts[node]
    with pytest.raises(SpreadError, match="out of range"):
        index.locate(64)


def test_staging_copies_only_the_nodes_shards_once(data, tmp_path):
    index = _index(data)
    shared = LocalStore(index.shared_dir)
    first = stage_partition(index, 1, tmp_path, shared)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [shard_name(k) for k in index.shards_of(1)]
    assert first["reads"] == len(index.shards_of(1)) and first["bytes"] > 0
    assert stage_partition(index, 1, tmp_path, shared) == {"shards": 4, "bytes": 0, "reads": 0}


@pytest.fixture()
def served(data, tmp_path):
    """Node 1's partition staged and served on loopback; a reader on node 0 that reaches it."""
    index = _index(data)
    stage_partition(index, 1, tmp_path / "n1", _mk(tmp_path / "n1", index))
    server = PeerServer(index.shards_of(1), 1, tmp_path / "n1", secret=SECRET).start()
    stage_partition(index, 0, tmp_path / "n0", _mk(tmp_path / "n0", index))
    reader = SpreadReader(index, 0, LocalStore(index.shared_dir), node_dir=tmp_path / "n0", secret=SECRET,
                          peers={1: ("other", server.host, server.port)}, me="me")
    yield index, server, reader
    reader.close()
    server.close()


def _mk(path, index):
    path.mkdir()
    return LocalStore(index.shared_dir)


def test_a_rank_reads_its_nodes_samples_locally_and_the_others_from_the_owner_counted_by_host(served):
    index, server, reader = served
    expected = {i: LocalStore(index.shared_dir).read(shard_name(index.locate(i)[1]), *index.locate(i)[2:4])
                for i in range(64)}
    assert all(reader.read(i) == expected[i] for i in range(64))
    snap = reader.counters.snapshot()
    assert snap["reads"] == {"cache": 0, "local": 32, "remote": 32, "shared": 0}
    assert snap["remote_hosts"] == {"other": {"reads": 32, "bytes": snap["bytes"]["remote"]}}
    assert server.summary()["clients"] == {"me@127.0.0.1": {"reads": 32, "bytes": snap["bytes"]["remote"]}}
    log = reader.counters.drain()
    assert {i for i, source, _, _ in log if source == "remote"} == set(index.partition(1))


def test_the_peer_server_answers_only_the_secret_and_only_its_partition(served):
    index, server, reader = served
    with pytest.raises(PeerError, match="refused this client"):
        PeerClient(server.host, server.port, b"x" * 32, "intruder")
    assert server.summary()["refused"] == 1
    raw = socket.create_connection((server.host, server.port))  # garbage instead of a hello: closed unanswered
    raw.sendall(b"\x00" * 8 + b"GET /etc/passwd")
    assert raw.recv(16) == b""
    client = PeerClient(server.host, server.port, SECRET, "me")
    with pytest.raises(PeerError, match="does not hold shard 0"):
        client.read(0, 0, 10)  # shard 0 is node 0's
    with pytest.raises(PeerError, match="does not hold shard 1"):
        client.read(1, 0, 1 << 30)  # past the shard's end
    assert len(client.read(1, 0, 10)) == 10
    client.close()


def test_a_read_path_that_returns_wrong_bytes_is_counted_bad_and_refused(served):
    index, _, reader = served
    reader.path = lambda i, r: r.default_path((i + 1) % 64)
    with pytest.raises(SpreadError, match="wrong bytes for sample 3"):
        reader.read(3)
    assert reader.counters.snapshot()["bad"] == 1


def test_the_node_cache_is_a_private_folder_and_a_symlink_or_another_accounts_folder_is_refused(tmp_path):
    made = sx.node_cache_dir(tmp_path / "a" / "cache")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    cache = NodeCache(made)
    cache.put(3, b"abc")
    assert cache.get(3) == b"abc" and cache.get(4) is None and len(cache) == 1
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(SpreadError, match="symbolic link"):
        sx.node_cache_dir(tmp_path / "link")
    if os.geteuid() != 0:
        pytest.skip("making a folder of another account needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(SpreadError, match="uid 65534"):
        sx.node_cache_dir(theirs)


def test_decode_augment_is_real_per_sample_work_seeded_by_its_rng(data):
    index = _index(data, 1)
    raw = SpreadReader(index, 0, LocalStore(index.shared_dir)).read(5)
    a = sx.decode_augment(raw, index.meta, np.random.default_rng(1))
    b = sx.decode_augment(raw, index.meta, np.random.default_rng(1))
    c = sx.decode_augment(raw, index.meta, np.random.default_rng(2))
    assert a.shape == (1, 16, 16) and a.dtype == np.float32 and abs(float(a.mean())) < 1e-4
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# -- real rank processes: 4 ranks, 2 "nodes" of 2 on this machine ------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One pool of 4 rank processes for every run of this file (ranks start once)."""
    from scalelab.launch.spmd import SpmdPool
    with SpmdPool(4, init="none", run_dir=tmp_path_factory.mktemp("pool"), threads=1) as pool:
        yield pool


@pytest.fixture(scope="module")
def runs(data, pool, tmp_path_factory):
    """The spread runs (2 nodes x 2 ranks), the cache runs (1 node x 4 ranks), then the node cache once more with a
    storage server as the shared file system and the nodes' folders under the test's own (its request log returned)."""
    from scalelab.data.storage_server import ServerProcess, read_log
    out = data[0]
    spread = sx.spread_epochs(out, world=4, ranks_per_node=2, latency_s=0.001, pool=pool)
    cache = sx.cache_epochs(out, world=4, latency_s=0.001, lookahead=4, pool=pool)
    with ServerProcess.start(data[1]["path"], tmp_path_factory.mktemp("server"), bandwidth=50e6,
                             opens_per_s=2000) as server:
        sx.cache_epochs(out, world=4, caches=("node",), lookahead=4, name="server", storage=server.address,
                        node_root=str(tmp_path_factory.mktemp("nodes") / "here"), pool=pool)
    return spread, cache, read_log(server.log_path)


def _events(run_dir, kind):
    return [json.loads(line) for p in sorted(Path(run_dir, "events").glob("*.jsonl"))
            for line in p.read_text().splitlines() if json.loads(line)["type"] == kind]


def test_spread_ranks_read_nothing_from_the_shared_fs_and_fetch_other_nodes_samples_from_their_owner(runs, data):
    spread, _, _ = runs
    rows = {(r["run"], r["epoch"]): r for r in spread["rows"]}
    for epoch in (0, 1):
        assert rows["shared", epoch]["shared_reads"] == 64 and rows["shared", epoch]["remote_reads"] == 0
        s = rows["spread", epoch]
        assert s["shared_reads"] == 0 and s["bad"] == 0 and s["local_reads"] + s["remote_reads"] == 64
        assert s["local_reads"] > 0 and s["remote_reads"] > 0
    assert sum(v["reads"] for v in spread["staged"].values()) == 8  # each shard staged once, by its node
    index = _index(data, 2)
    run = spread["run_dirs"]["spread"]
    node_of = {e["rank"]: e["node"] for e in _events(run, "start")}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    reads = _events(run, "read")
    assert all((index.owner_of(e["sample"]) == node_of[e["rank"]]) == (e["source"] == "local") for e in reads)
    served = {e["node"]: sum(c["reads"] for c in e["clients"].values()) for e in _events(run, "served")}
    for node in (0, 1):  # what a node's server logged is what the other node's ranks counted as remote
        assert served[node] == sum(1 for e in reads if e["source"] == "remote" and node_of[e["rank"]] != node)


def test_the_node_cache_cuts_shared_fs_reads_after_epoch_one_by_at_least_n_minus_1_over_n(runs):
    _, cache, _ = runs
    rows = {(r["run"], r["epoch"]): r for r in cache["rows"]}
    assert all(rows[f"cache-{c}", 0]["shared_reads"] == 64 for c in sx.CACHES)  # epoch 1 reads everything once
    assert cache["target"] == 0.75 and cache["cut"]["none"] == 0.0
    assert cache["cut"]["node"] >= cache["target"]
    assert rows["cache-node", 1]["cache_reads"] == 64
    assert cache["cut"]["private"] < 0.5  # a rank's own cache holds what it read, not what its node read
    ax = sx.reads_figure(cache["rows"]).axes[0]
    assert len(ax.patches) == 4 * len(cache["rows"]) and ax.get_ylabel() == "sample reads"


def test_balancing_read_and_decode_threads_measures_each_split_and_predicts_the_balance(data):
    out = data[0]
    sx.make_dataset(out, samples=16, size=32, channels=3, samples_per_shard=8, name="images")
    res = sx.balance_threads(out, total=3, samples=16, latency_s=0.002)
    assert [(r["read_threads"], r["decode_threads"]) for r in res["rows"]] == [(1, 2), (2, 1)]
    assert all(r["samples"] == 16 and r["samples_per_s"] > 0 and r["model_samples_per_s"] > 0 for r in res["rows"])
    assert res["best"] in [(1, 2), (2, 1)] and res["predicted"] in [(1, 2), (2, 1)]
    assert [p.get_height() for p in sx.balance_figure(res).axes[0].patches] == [r["samples_per_s"] for r in res["rows"]]
    assert res["read_ms"] >= 1.5 and res["decode_ms"] > 0  # a read waits about the store's latency (2 ms)


# -- two namespace nodes -----------------------------------------------------------------------------------------

@pytest.mark.slurm
@pytest.mark.netns
def test_on_two_nodes_remote_reads_cross_between_the_hosts_and_both_sides_name_them(nodes_cluster, data):
    out = data[0]
    res = sx.spread_across_nodes(out, env={**os.environ, **nodes_cluster.env()}, epochs=1, latency_s=0.001)
    assert res["hosts"] == ["node1", "node2"]
    row = res["rows"][0]
    assert row["shared_reads"] == 0 and row["bad"] == 0 and row["local_reads"] + row["remote_reads"] == 64
    assert set(row["remote_pairs"]) == {"node1->node2", "node2->node1"}
    clients = {s["host"]: list(s["clients"]) for s in res["served"]}  # servers listen on the nodes' addresses
    assert clients == {"10.213.0.11": ["node2@10.213.0.12"], "10.213.0.12": ["node1@10.213.0.11"]}
    verdict = sx.spread_verdict(out, res["run_dirs"]["nodes"])  # the files alone say the same
    assert verdict["hosts"] == {0: "node1", 1: "node2"} and verdict["unserved"] == {0: 0, 1: 0}
    assert verdict["misplaced"] == verdict["misrouted"] == 0 and verdict["epochs"][0]["shared"] == 0


# -- a read path of the student's (the exercise candidate), run in every rank ---------------------------------------

READ_PATHS = {
    "path_right": """
def read_sample(i, reader):
    data = reader.from_cache(i)
    if data is None:
        data = reader.from_local(i) if reader.index.owner_of(i) == reader.node else reader.from_peer(i)
    return data
""",
    "path_shared": """
def read_sample(i, reader):
    return reader.from_shared(i)      # wrong: the spread data set is never used
""",
    "path_twice": """
def read_sample(i, reader):
    reader.from_shared(i)             # wrong: reads every sample twice, once from the shared file system
    return reader.default_path(i)
""",
    "path_todo": """
def read_sample(i, reader):
    raise NotImplementedError("exercise")
""",
}


@pytest.fixture(scope="module")
def path_runs(data, pool, tmp_path_factory):
    """The spread run once per read path above (2 nodes x 2 ranks, one epoch), the modules in their own folder."""
    code = tmp_path_factory.mktemp("code")
    for name, text in READ_PATHS.items():
        (code / f"{name}.py").write_text(text)
    return {name: sx.spread_epochs(data[0], world=4, ranks_per_node=2, epochs=1, latency_s=0.001,
                                   path=f"{name}:read_sample", code_dir=str(code), runs=("spread",), name=name,
                                   pool=pool)
            for name in READ_PATHS}


def test_a_students_read_path_runs_in_every_rank_and_its_effect_shows_in_the_counters(path_runs):
    right, shared = path_runs["path_right"]["rows"][0], path_runs["path_shared"]["rows"][0]
    assert right["shared_reads"] == 0 and right["remote_reads"] > 0 and right["path"] == ["path_right:read_sample"]
    assert shared["shared_reads"] == 64 and shared["local_reads"] == shared["remote_reads"] == 0
    starts = _events(path_runs["path_right"]["run_dirs"]["spread"], "start")
    assert [list(e["code"]) for e in starts] == [["path_right.py"]] * 4


def test_a_read_path_not_written_yet_falls_back_to_the_default_and_says_so(path_runs):
    row = path_runs["path_todo"]["rows"][0]
    assert row["path"] == ["default (the given one is not implemented)"]
    assert row["shared_reads"] == 0 and row["local_reads"] + row["remote_reads"] == 64


def test_with_a_storage_server_as_the_shared_fs_its_own_log_shows_the_node_cache_cut(runs):
    log = [e for e in runs[2] if e.get("op") in ("open", "read")]
    reads = {tag: sum(1 for e in log if e["op"] == "read" and e["tag"] == tag) for tag in ("epoch-0", "epoch-1")}
    assert reads == {"epoch-0": 64, "epoch-1": 0}  # the server saw every sample once, then nothing
    assert {e["job"] for e in log} == {"server-cache-node"} and {e["rank"] for e in log} == {0, 1, 2, 3}


def test_the_verdict_re_derives_a_run_from_its_files_and_names_each_mistake(path_runs, runs, data):
    out = data[0]
    right = sx.spread_verdict(out, path_runs["path_right"]["run_dirs"]["spread"])
    assert right["world"] == 4 and right["nodes"] == 2 and right["hosts"] == {r: socket.gethostname() for r in range(4)}
    local = right["epochs"][0]["local"]
    assert right["epochs"] == [{"cache": 0, "local": local, "remote": 64 - local, "shared": 0}] and 0 < local < 64
    assert right["misplaced"] == right["misrouted"] == right["bad"] == 0 and right["not_once"] == []
    assert right["unserved"] == {0: 0, 1: 0} and list(right["code"][0]) == ["path_right.py"]
    shared = sx.spread_verdict(out, path_runs["path_shared"]["run_dirs"]["spread"])
    assert shared["epochs"][0]["shared"] == 64 and shared["not_once"] == []
    assert right["paths"] == ["path_right:read_sample"]
    todo = sx.spread_verdict(out, path_runs["path_todo"]["run_dirs"]["spread"])
    assert todo["paths"] == ["default (the given one is not implemented)"]
    twice = sx.spread_verdict(out, path_runs["path_twice"]["run_dirs"]["spread"])
    assert twice["epochs"][0]["shared"] == 64 and twice["not_once"] == [0]
    cache = sx.spread_verdict(out, runs[1]["run_dirs"]["cache-node"])
    assert [e["shared"] for e in cache["epochs"]] == [64, 0] and [e["cache"] for e in cache["epochs"]] == [0, 64]
