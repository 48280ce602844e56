"""Lab 05 hidden checks: every measurement is re-derived from what its processes wrote, re-read from the working
copy: the storage servers' request logs (`experiments.storage.run_log`), the training runs' event files (the grader's
evidence) and the spread and cache runs' event files (`experiments.spread.spread_verdict`). The student's code is
identified by the SHA-256 the server (the policy), the readers (the sampler) or the ranks (the read path) logged for
it. Every check needs a real run (`needs_run`)."""
import hashlib
import json
import math

from scalelab.experiments.spread import spread_verdict
from scalelab.experiments.storage import run_log, sample_bytes, sampler_verdict, scaling_row, shares
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import RUNS, WORKDIR
from scalelab.paths import read_beneath

BAND = (0.5, 1.15)
"""A reader's bandwidth with N readers, as a fraction of budget / N."""
FAIR = 0.10
"""How far (relative) a job's share may be from its job-fair third."""


def _log(r, path):
    r[RUNS]  # no grader evidence (outside the grader and SelfCheck), no server log either: the check ends missing
    try:
        return run_log(r[WORKDIR], path)
    except Exception as e:  # noqa: BLE001 - missing, a link, too big: the student's files
        raise AssertionError(f"the server log {path} could not be read ({type(e).__name__}: {e})") from None


def _sha(r, name):
    r[RUNS]  # as _log
    try:
        return hashlib.sha256(read_beneath(r[WORKDIR], name, 1 << 20)).hexdigest()
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{name} could not be read from the submission ({e})") from None


@check(points=0.5, needs_run=True)
def per_reader_bandwidth_falls_as_one_over_n(r):
    """From the scaling server's log: with N readers each gets 0.5 to 1.15 x budget / N (mean per reader), and the
    recorded rows are the log's."""
    s = r["scaling"]
    entries = _log(r, s["log"])
    budget = next(e for e in entries if e.get("event") == "start")["bandwidth"]
    for row in s["rows"]:
        found = scaling_row(entries, row["readers"], budget)
        close(found["per_reader_mb_s"], row["per_reader_mb_s"], what=f"{row['readers']} readers' MB/s")
        fair = budget / row["readers"] / 1e6
        assert BAND[0] * fair <= found["per_reader_mb_s"] <= BAND[1] * fair, \
            f"{row['readers']} readers: {found['per_reader_mb_s']:.2f} MB/s each, budget / N is {fair:.2f}"


def _index(r, path):
    try:
        return json.loads(read_beneath(r[WORKDIR], path, 16 << 20))
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"the shard index {path} could not be read ({type(e).__name__}: {e})") from None


@check(points=5, needs_run=True)
def shards_cut_the_opens(r):
    """Exercise 1, from the two epochs' server logs: the file-per-sample epoch opened one file per sample, the
    shards' epoch at most one per shard file (and at most a fifth of that); both moved every sample's bytes once; every
    read was at an entry of the submitted index, and the shard files hold each sample's bytes there."""
    e, setup = r["epoch_layouts"], r["setup"]
    n, size = setup["samples"], setup["sample_size"]
    assert e["written"]["written"], f"no shards were written: {e['written']['why']}"
    assert e["written"]["code"].get("my_shards.py") == _sha(r, "my_shards.py"), "the shards are not my_shards.py's"
    files = [x for x in _log(r, e["files"]["log"]) if "op" in x]
    shards = [x for x in _log(r, e["shards"]["log"]) if "op" in x]
    assert sum(x["opens"] for x in files) == n, "the file-per-sample epoch did not open one file per sample"
    opens = sum(x["opens"] for x in shards)
    assert opens <= max(1, n // 5) and opens <= e["written"]["files"], \
        f"the shards' epoch opened {opens} files for {n} samples in {e['written']['files']} files"
    assert sum(x["bytes"] for x in shards) == n * size, "the shards' epoch did not move every sample's bytes once"
    folder = str(_parent(setup["root"], "shards"))
    index = _index(r, f"{folder}/index.json")
    assert isinstance(index, list) and len(index) == n, "index.json is not a list with one entry per sample"
    where = {(f"shards/{x['shard']}", x["offset"], x["length"]): i for i, x in enumerate(index)}
    read = [(x["name"], x["offset"], x["bytes"]) for x in shards if x["op"] == "read"]
    assert sorted(where.get(k, -1) for k in read) == list(range(n)), "the reads were not the index's entries, once each"
    blobs = {}
    for i, x in enumerate(index):
        if x["shard"] not in blobs:
            blobs[x["shard"]] = read_beneath(r[WORKDIR], f"{folder}/{x['shard']}", 64 << 20)
        assert blobs[x["shard"]][x["offset"]:x["offset"] + x["length"]] == sample_bytes(i, size), \
            f"sample {i} is not at {x['shard']}:{x['offset']}"


def _parent(root, name):
    return f"{root.rstrip('/')}/{name}"


@check(points=5, needs_run=True)
def sampler_is_disjoint_complete_and_reshuffled(r):
    """Exercise 2, from the sampler server's log: every reader ran the submitted my_sampler.py, and in every epoch
    the ranks read disjoint samples that together are all of them, their counts within one, each read where the
    layout keeps its sample; each rank's samples changed from epoch to epoch."""
    s, n = r["sampler_run"], r["setup"]["samples"]
    entries = _log(r, s["log"])
    sha = _sha(r, "my_sampler.py")
    ranks = {e["rank"] for e in entries if e.get("event") == "connect" and (e.get("code") or {}).get("my_sampler.py")
             == sha}
    assert ranks == set(range(s["world"])), f"readers that ran the submitted my_sampler.py: {sorted(ranks)}"
    index = None
    if s["layout"] == "shards":
        index = [{**x, "shard": f"shards/{x['shard']}"} for x in _index(r, s["index"])]
    v = sampler_verdict(entries, n, s["world"], s["epochs"], index)
    bad = [k for k in ("disjoint", "complete", "balanced", "reshuffled") if not v[k]]
    assert not bad, f"the sampler's epochs were not {', '.join(bad)}: " + "; ".join(
        f"epoch {p['epoch']}: counts {p['counts']}, {p['overlap']} read twice, {p['covered']} of {n} covered"
        for p in v["epochs"])
    assert v["misplaced"] == 0, f"{v['misplaced']} reads were not where their sample is kept"


def _row(r, policy):
    rows = {row["policy"]: row for row in r["fair_share"]["rows"]}
    assert policy in rows, f"the policy {policy} was not run"
    return rows[policy]


@check(points=5, needs_run=True)
def policy_holds_job_fair_shares(r):
    """Exercise 3, from the server that ran my_policy.pick: it ran the submitted my_policy.py without an error, and
    while all three jobs read, each got within 10 % of a third of the bytes."""
    row = _row(r, "my_policy:pick")
    entries = _log(r, row["log"])
    start = next(e for e in entries if e.get("event") == "start")
    assert start["policy"] == "my_policy:pick" and start["code"].get("my_policy.py") == _sha(r, "my_policy.py"), \
        "that server did not run the submitted my_policy.py"
    errors = [e["error"] for e in entries if e.get("event") == "policy_error"]
    assert not errors, f"the policy failed in the server ({errors[0]}): it served first come, first served"
    got = shares(entries)
    third = 1 / len(r["fair_share"]["jobs"])
    off = {job: share for job, share in got.items() if abs(share / third - 1) > FAIR}
    assert not off and len(got) == len(r["fair_share"]["jobs"]), \
        f"shares {', '.join(f'{j} {s:.2f}' for j, s in got.items())}: not each within 10 % of {third:.2f}"


@check(points=0.5, needs_run=True)
def fifo_is_not_fair(r):
    """From the FIFO server's log: some job's share is more than 10 % away from a third (the jobs ask unevenly)."""
    got = shares(_log(r, _row(r, "fifo")["log"]))
    third = 1 / len(got)
    assert max(abs(s / third - 1) for s in got.values()) > FAIR, f"FIFO gave {got}: the jobs did not contend"


@check(points=0.5, needs_run=True)
def recorded_shares_are_the_logs(r):
    """Every policy's recorded shares are what its server's log shows."""
    for row in r["fair_share"]["rows"]:
        got = shares(_log(r, row["log"]))
        for job, x in row["jobs"].items():
            assert math.isclose(got.get(job, 0.0), x["share"], rel_tol=1e-9, abs_tol=1e-12), f"{row['policy']}: {job}'s share"


def _engine_rows(r):
    rows = {row["name"]: row for row in r["engine_runs"]}
    beside = [x for n, x in rows.items() if n.startswith("engine-beside")]
    assert "engine-alone" in rows and beside, f"runs recorded: {sorted(rows)}"
    return rows["engine-alone"], beside[0]


def _run_requests(r, row):
    job = row["run_dir"].rstrip("/").rsplit("/", 1)[-1]
    entries = [e for e in _log(r, row["log"]) if "op" in e]
    return [e for e in entries if e["job"] == job], [e for e in entries if e["job"] != job]


@check(points=0.5, needs_run=True)
def engine_runs_read_through_the_server(r):
    """Each training run is a real run (its event files) whose every rank read its samples from the server (the
    server's log names them under the run's folder name); the recorded numbers are the run's and the log's."""
    for row in _engine_rows(r):
        found = evidence(r, row["run_dir"], total_steps="engine_steps")
        close(found["samples_per_s"], row["samples_per_s"], what=f"{row['name']} samples/s")
        close(found["final_loss"], row["final_loss"], what=f"{row['name']} final loss")
        mine, _ = _run_requests(r, row)
        ranks = sorted({e["rank"] for e in mine})
        assert ranks == list(range(found["world_size"])), f"{row['name']}: the server served ranks {ranks}"
        assert sum(e["bytes"] for e in mine) == row["bytes"] > 0, f"{row['name']}: bytes are not the log's"


@check(points=0.5, needs_run=True)
def contention_slows_the_training_run(r):
    """From the two servers' logs: beside the bulk copy, which read from the same server meanwhile, the run's
    requests waited at least twice as long on average as alone."""
    alone, beside = _engine_rows(r)
    wait = {}
    for row in (alone, beside):
        mine, others = _run_requests(r, row)
        wait[row["name"]] = sum(e["wait"] for e in mine) / max(1, len(mine))
    _, others = _run_requests(r, beside)
    assert sum(e["bytes"] for e in others) > 0, "nothing else read from the server beside the run"
    assert wait[beside["name"]] > 2 * wait["engine-alone"], \
        f"mean wait per request: {1e3 * wait['engine-alone']:.2f} ms alone, {1e3 * wait[beside['name']]:.2f} ms beside"


def _verdict(r, run_dir):
    r[RUNS]  # as _log: outside the grader there are no run files to read
    try:
        return spread_verdict(r[WORKDIR], run_dir)
    except Exception as e:  # noqa: BLE001 - missing, a link, too big: the student's files
        raise AssertionError(f"the spread run {run_dir} could not be read ({type(e).__name__}: {e})") from None


@check(points=5, needs_run=True)
def read_path_uses_the_nodes_not_the_shared_fs(r):
    """Exercise 4, from the spread run's own event files: every rank ran my_reader.py (its SHA-256), no epoch read
    the shared file system, local reads only of the node's own samples, remote reads only from the owner, each
    server's log matching what the other node's ranks read from it, each sample read once per epoch."""
    v = _verdict(r, r["spread"]["run_dirs"]["spread"])
    assert v["paths"] == ["my_reader:read_sample"], f"the ranks ran {v['paths']}"
    sha = _sha(r, "my_reader.py")
    assert all(c == {"my_reader.py": sha} for c in v["code"].values()), "the ranks did not run this my_reader.py"
    assert all(e["shared"] == 0 for e in v["epochs"]), f"shared reads per epoch: {[e['shared'] for e in v['epochs']]}"
    assert all(e["remote"] > 0 and e["local"] > 0 for e in v["epochs"]), f"reads per epoch: {v['epochs']}"
    assert v["misplaced"] == v["misrouted"] == v["bad"] == 0 and not any(v["unserved"].values()) and \
        not v["not_once"], f"misplaced {v['misplaced']}, misrouted {v['misrouted']}, bad {v['bad']}, " \
                           f"unserved {v['unserved']}, epochs not read once {v['not_once']}"


@check(points=4, needs_run=True)
def node_cache_cuts_shared_reads_by_n_minus_1_over_n(r):
    """From the node-cache run's event files: it ran my_reader.py; epoch 1 read the shared file system, and after it
    the shared reads are at most 1/N of the samples read (a cut of at least (N-1)/N)."""
    v = _verdict(r, r["cache"]["run_dirs"]["cache-node"])
    assert v["paths"] == ["my_reader:read_sample"], f"the ranks ran {v['paths']}"
    later = v["epochs"][1:]
    shared, total = sum(e["shared"] for e in later), sum(sum(e.values()) for e in later)
    assert total and shared <= total / v["world"], f"{shared} shared reads of {total} after epoch 1"
    assert v["epochs"][0]["shared"] > 0 and not v["not_once"], f"reads per epoch: {v['epochs']}"
