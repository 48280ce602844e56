"""The shared storage server (scalelab.data.storage_server): N readers share its budget about 1/N each, its policies
pick the request they claim to, a policy of the student's runs inside it, and its log records every request."""
from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from scalelab.data.storage_server import (ServerProcess, StorageClient, StorageServerError, TokenBucket, fifo,
                                          job_fair, read_log, size_fair, user_fair)
from scalelab.experiments.storage import reader_rates, shares

CHUNK = 32768


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "big.bin").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (root / "small.bin").write_bytes(b"x" * 100)
    (tmp_path / "outside.bin").write_bytes(b"secret")
    return root


def _readers(address, who, seconds):
    """Start one thread per (job, user, rank), each reading CHUNK pieces until the deadline; join them."""
    deadline = time.time() + seconds

    def loop(job, user, rank, size):
        with StorageClient(address, job=job, user=user, rank=rank, job_size=size) as c:
            c.open("big.bin")
            k = rank * 5
            while time.time() < deadline:
                c.read("big.bin", (k * CHUNK) % (2**20 - CHUNK), CHUNK)
                k += 1
    threads = [threading.Thread(target=loop, args=w) for w in who]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("n", [1, 3])
def test_n_readers_each_get_about_one_nth_of_the_bandwidth(data, tmp_path, n):
    bandwidth = 4e6  # 32 KiB take ~8 ms: far longer than a reader's turnaround, even on a loaded machine
    with ServerProcess.start(data, tmp_path / f"srv{n}", bandwidth, 1000) as srv:
        _readers(srv.address, [("scan", "u", r, n) for r in range(n)], 1.0)
    rates = reader_rates(read_log(srv.log_path))
    assert len(rates) == n
    for rate in rates.values():
        assert 0.5 * bandwidth / n < rate < 1.15 * bandwidth / n, (n, rates)
    assert sum(rates.values()) < 1.15 * bandwidth


@pytest.mark.parametrize("policy, small_share", [("fifo", 0.25), ("job-fair", 0.5)])
def test_job_fair_gives_a_one_rank_job_half_and_fifo_a_quarter(data, tmp_path, policy, small_share):
    who = [("small", "alice", 0, 1)] + [("big", "bob", r, 3) for r in range(3)]
    with ServerProcess.start(data, tmp_path / policy, 4e6, 1000, policy=policy) as srv:
        _readers(srv.address, who, 1.2)
    got = shares(read_log(srv.log_path))
    assert abs(got["small"] / small_share - 1) < 0.15, got


def test_policies_pick_the_request_they_claim():
    queue = [{"job": "big", "user": "bob", "bytes": 10}, {"job": "small", "user": "alice", "bytes": 10},
             {"job": "mid", "user": "bob", "bytes": 10}]
    served = {"big": 300, "small": 200, "mid": 100}
    by_user = {"bob": 400, "alice": 200}
    sizes = {"big": 4, "small": 1, "mid": 1}
    assert fifo(queue, served, by_user, sizes) == 0
    assert job_fair(queue, served, by_user, sizes) == 2  # least served job
    assert user_fair(queue, served, by_user, sizes) == 1  # least served user
    assert size_fair(queue, served, by_user, sizes) == 0  # 300 / 4 ranks is the least per rank


def test_log_records_every_request_with_opens_and_bytes(data, tmp_path):
    with ServerProcess.start(data, tmp_path / "srv", 50e6, 1000) as srv:
        with StorageClient(srv.address, job="j", user="u", rank=2, host="node7", job_size=3) as c:
            c.tag = {"epoch": 1}
            assert c.open("big.bin") == 2**20
            assert c.read("big.bin", 256, 4) == bytes([0, 1, 2, 3])
            assert c.get("small.bin") == b"x" * 100
            with pytest.raises(StorageServerError, match="before it was opened"):
                c.read("small.bin", 0, 10)  # a get closes what it opened
            with pytest.raises(StorageServerError, match="not beneath"):
                c.get("../outside.bin")
            assert c.stats()["served"] == {"j": 104}
    start, connect, *requests = read_log(srv.log_path)
    assert start["event"] == "start" and start["policy"] == "fifo" and start["bandwidth"] == 50e6
    assert connect["event"] == "connect" and (connect["job"], connect["rank"], connect["host"]) == ("j", 2, "node7")
    assert [(e["op"], e["name"], e["bytes"], e["opens"]) for e in requests] == [
        ("open", "big.bin", 0, 1), ("read", "big.bin", 4, 0), ("get", "small.bin", 100, 1)]
    for e in requests:
        assert (e["job"], e["user"], e["rank"], e["host"], e["tag"]) == ("j", "u", 2, "node7", {"epoch": 1})
        assert e["wait"] >= 0 and e["t"] > 0


def test_opens_share_the_metadata_budget(data, tmp_path):
    with ServerProcess.start(data, tmp_path / "srv", 50e6, 100) as srv:  # 100 opens/s: 30 opens take ~0.3 s
        with StorageClient(srv.address, job="j") as c:
            t0 = time.perf_counter()
            for _ in range(30):
                c.get("small.bin")
            elapsed = time.perf_counter() - t0
    assert 0.25 < elapsed < 3.0


def test_a_students_policy_runs_in_the_server_and_is_named_in_the_log(data, tmp_path):
    d = tmp_path / "srv"
    (d / "code").mkdir(parents=True)
    src = "def pick(queue, served):\n    return len(queue) - 1  # newest first\n"
    (d / "code" / "my_policy.py").write_text(src)
    with ServerProcess.start(data, d, 50e6, 1000, policy="my_policy:pick") as srv:
        with StorageClient(srv.address, job="j") as c:
            c.get("small.bin")
    start = read_log(srv.log_path)[0]
    assert start["policy"] == "my_policy:pick"
    assert start["code"] == {"my_policy.py": hashlib.sha256(src.encode()).hexdigest()}


def test_a_policy_that_fails_is_logged_and_the_server_goes_on_first_come_first_served(data, tmp_path):
    d = tmp_path / "srv"
    (d / "code").mkdir(parents=True)
    (d / "code" / "my_policy.py").write_text("def pick(queue, served):\n    raise NotImplementedError('exercise')\n")
    with ServerProcess.start(data, d, 50e6, 1000, policy="my_policy:pick") as srv:
        with StorageClient(srv.address, job="j") as c:
            assert c.get("small.bin") == b"x" * 100
    errors = [e for e in read_log(srv.log_path) if e.get("event") == "policy_error"]
    assert errors and "NotImplementedError" in errors[0]["error"]


def test_token_bucket_holds_its_rate():
    bucket = TokenBucket(rate=1000.0, burst=10.0)
    t0 = time.perf_counter()
    for _ in range(20):
        bucket.take(10)  # 200 tokens at 1000/s, 10 of them in the bucket at the start: ~0.19 s
    assert 0.17 < time.perf_counter() - t0 < 1.0


def test_an_engine_dataset_read_through_the_server_is_the_same_and_logged_under_the_run(tmp_path):
    import numpy as np
    from scalelab.data.formats import open_dataset, write_dataset
    from scalelab.data.server_store import ServerStore
    from scalelab.data.synthetic import heat_fields

    x, y = heat_fields(40, 8, 4, seed=0)
    directory = tmp_path / "root" / "my-run" / "data" / "shards-key"  # <run dir>/data/<key>, as the engine writes
    write_dataset(x, y, directory, "shards", 16)
    with ServerProcess.start(tmp_path / "root", tmp_path / "srv", 50e6, 1000) as srv:
        served = open_dataset(directory, ServerStore(srv.address, directory))
        local = open_dataset(directory)
        for i in range(40):
            a, b = served[i], local[i]
            assert np.array_equal(a[0].numpy(), b[0].numpy()) and int(a[1]) == int(b[1])
        served.store.close()
    requests = [e for e in read_log(srv.log_path) if "op" in e]
    assert {e["job"] for e in requests} == {"my-run"}
    assert sum(e["opens"] for e in requests) == 1 + 3  # the index (one get), then each of the 3 shards once
    assert sum(e["op"] == "read" for e in requests) == 40


def test_a_data_folder_outside_the_servers_root_is_refused_with_what_to_do(data, tmp_path):
    from scalelab.data.server_store import ServerStore
    with ServerProcess.start(data, tmp_path / "srv", 50e6, 1000) as srv:
        with pytest.raises(StorageServerError, match="not beneath it"):
            ServerStore(srv.address, tmp_path / "elsewhere").read("x.bin")


def test_data_server_needs_a_layout_on_disk_and_an_address():
    from scalelab import preset
    from scalelab.errors import SpecError
    with pytest.raises(SpecError, match="data.server"):
        preset("tiny").with_overrides({"data.server": "127.0.0.1:5000"})  # data.format memory
    with pytest.raises(SpecError, match="data.server"):
        preset("tiny").with_overrides({"data.format": "shards", "data.server": "no port"})
    assert preset("tiny").with_overrides({"data.format": "shards", "data.server": "node1:5000"}).data.server


def _epoch_log(assignments):
    """Log entries as the sampler's readers write them: {rank: {epoch: [samples]}} read from files per sample."""
    from scalelab.experiments.storage import sample_name
    return [{"op": "get", "job": "s", "rank": rank, "name": sample_name(i), "offset": 0, "bytes": 4, "t": 0.0,
             "tag": {"epoch": epoch, "sample": i}}
            for rank, epochs in assignments.items() for epoch, samples in epochs.items() for i in samples]


def test_the_sampler_verdict_finds_overlap_gaps_imbalance_and_a_fixed_order():
    from scalelab.experiments.storage import sampler_verdict
    good = _epoch_log({0: {0: [4, 0, 3], 1: [1, 6, 2]}, 1: {0: [1, 6], 1: [0, 5]}, 2: {0: [2, 5], 1: [3, 4]}})
    v = sampler_verdict(good, 7, 3, 2)
    assert v["disjoint"] and v["complete"] and v["balanced"] and v["reshuffled"] and v["misplaced"] == 0
    overlapping = _epoch_log({0: {0: [0, 1, 2], 1: [3, 4, 5]}, 1: {0: [2, 3], 1: [5, 6]}, 2: {0: [4, 5], 1: [0, 1]}})
    v = sampler_verdict(overlapping, 7, 3, 2)
    assert not v["disjoint"] and not v["complete"] and v["epochs"][0]["overlap"] == 1
    fixed = _epoch_log({0: {0: [0, 3, 6], 1: [0, 3, 6]}, 1: {0: [1, 4], 1: [1, 4]}, 2: {0: [2, 5], 1: [2, 5]}})
    assert not sampler_verdict(fixed, 7, 3, 2)["reshuffled"]
    lopsided = _epoch_log({0: {0: [0, 1, 2, 3, 4]}, 1: {0: [5]}, 2: {0: [6]}})
    assert not sampler_verdict(lopsided, 7, 3, 1)["balanced"]
    moved = [dict(e, name="files/sample-000099.bin") if e["tag"]["sample"] == 3 else e for e in good]
    assert sampler_verdict(moved, 7, 3, 2)["misplaced"] == 2  # the log says sample 3, the read was another file


def test_shares_count_only_the_window_where_every_job_reads():
    from scalelab.experiments.storage import shares, window
    entries = [{"op": "read", "job": "a", "t": t, "bytes": 10} for t in (0.0, 1.0, 2.0, 3.0)] + \
              [{"op": "read", "job": "b", "t": t, "bytes": 30} for t in (1.0, 2.0)]
    assert window(entries) == (1.0, 2.0)
    assert shares(entries) == {"a": 0.25, "b": 0.75}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a reader as another account")
def test_a_classmates_process_on_the_node_is_refused_and_logged(data, tmp_path):
    """ATTACK: while a student's server runs, a classmate's process on the same node connects to its port (any
    port on the loopback can be found) to read the student's data or to skew the shares with requests of its own.
    It is refused before any request, and the refusal is logged with its uid. Control: the server's own account
    reads (every other test here)."""
    import subprocess
    import sys
    code = ("import sys; from scalelab.data.storage_server import StorageClient, StorageServerError\n"
            "try:\n"
            "    c = StorageClient(sys.argv[1], job='snoop'); print('READ', len(c.get('big.bin')))\n"
            "except StorageServerError as e:\n"
            "    print('REFUSED', e)\n")
    with ServerProcess.start(data, tmp_path / "srv", bandwidth=1e8, opens_per_s=1000) as srv:
        out = subprocess.run([sys.executable, "-c", code, srv.address], user=65534, group=65534, extra_groups=[],
                             capture_output=True, text=True, timeout=120, cwd="/")
        with StorageClient(srv.address, job="mine") as c:  # control
            assert len(c.get("small.bin")) == 100
    assert out.stdout.startswith("REFUSED") and "yours is uid 65534" in out.stdout, (out.stdout, out.stderr[-2000:])
    entries = read_log(srv.log_path)
    assert [e["uid"] for e in entries if e.get("event") == "refused"] == [65534]
    assert not [e for e in entries if e.get("job") == "snoop"]
