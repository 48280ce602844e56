"""Lab 05's shared-storage measurements: reader processes contending for one storage server
(`scalelab.data.storage_server`), the student's shard writer and distributed sampler run in every reader, and
fair sharing between concurrent jobs under each policy, all judged from the server's request log.

    data = make_data(root, samples=200, sample_size=1024)        # files/ (one per sample) and stream.bin
    with StorageLab(root, out / "servers", readers=4) as lab:      # 4 reader processes (an SPMD pool)
        rows = lab.scaling([1, 2, 4], bandwidth=8e6, seconds=1.0)   # per-reader bandwidth ~ budget / N
        runs = lab.fair_share(JOBS, ["fifo", "job-fair", "my_policy:pick"], bandwidth=8e6, seconds=1.5)

The readers are the processes of an SPMD pool (`scalelab.launch.spmd`); in the fair-share runs each process plays
one rank of one job (its connection says which job, user and rank), so the server cannot tell them from the ranks
of separate jobs: it sees separate processes, each with one request in flight at a time.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from ..data.storage_server import BUILTIN, CODE_DIR, ServerProcess, StorageClient, read_log
from ..launch.spmd import SpmdPool
from ..paths import json_lines

STREAM = "stream.bin"
"""The large file the scaling and fair-share readers read in chunks."""
FILES = "files"
"""The file-per-sample layout's folder (the small bad example)."""
INDEX = "index.json"
"""The student's shard index: a list, in sample order, of {"shard": file name, "offset": int, "length": int}."""

def make_jobs(chunk: int = 32768) -> list[dict]:
    """Three concurrent jobs of different sizes: alice's 1-rank and bob's 2-rank training jobs read `chunk`-byte
    pieces, bob's 1-rank bulk copy reads pieces 4 times larger."""
    return [{"job": "train-a", "user": "alice", "ranks": 1, "chunk": chunk},
            {"job": "train-b", "user": "bob", "ranks": 2, "chunk": chunk},
            {"job": "bulk-c", "user": "bob", "ranks": 1, "chunk": 4 * chunk}]


JOBS = make_jobs()
"""The three jobs at 32 KiB pieces."""


# -- the data --------------------------------------------------------------------------------------------------
def sample_bytes(i: int, size: int, seed: int = 0) -> bytes:
    """Sample `i` of the data set: `size` seeded bytes (the same on every rank, in the grader too)."""
    return np.random.default_rng([seed, i]).bytes(size)


def sample_name(i: int) -> str:
    """Sample i's file in the file-per-sample layout."""
    return f"{FILES}/sample-{i:06d}.bin"


def make_data(root, samples: int, sample_size: int, stream_mb: float = 4.0, seed: int = 0) -> dict:
    """Write the file-per-sample layout and the stream file under `root` (kept when already there)."""
    root = Path(root)
    (root / FILES).mkdir(parents=True, exist_ok=True)
    for i in range(samples):
        p = root / sample_name(i)
        if not p.exists():
            p.write_bytes(sample_bytes(i, sample_size, seed))
    stream = root / STREAM
    want = int(stream_mb * 2**20)
    if not stream.exists() or stream.stat().st_size != want:
        stream.write_bytes(np.random.default_rng(seed).bytes(want))
    return {"root": str(root), "samples": samples, "sample_size": sample_size, "files": samples,
            "stream_bytes": want, "seed": seed}


def sample_list(samples: int, sample_size: int, seed: int = 0) -> list[bytes]:
    """Every sample's bytes, in order (what the student's shard writer packs)."""
    return [sample_bytes(i, sample_size, seed) for i in range(samples)]


# -- what a reader process runs (SPMD targets) -----------------------------------------------------------------
def _role():
    from ..dist import rank_info
    return rank_info().rank


def reader(roles: list, address: str, seed: int = 0):
    """SPMD target: this process plays roles[rank] (None: it sits this one out) and returns what it measured."""
    role = roles[_role()] if _role() < len(roles) else None
    if role is None:
        return None
    if role["kind"] == "scan":
        return _scan(role, address)
    return _epochs(role, address, seed)


def ready() -> int:
    """SPMD target: the process is up (the pool's start-up is paid before any measurement)."""
    return os.getpid()


def _client(role, address, code=None):
    return StorageClient(address, job=role["job"], user=role.get("user", ""), rank=role.get("rank", 0),
                         job_size=role.get("job_size", 1), code=code)


def _scan(role, address) -> dict:
    """Read `chunk`-byte pieces of the stream file with `depth` requests in flight (a thread and a connection each,
    like a loader's read-ahead): each connection opens the file, says it is ready (a file beside `go_file`) and waits
    for the go; then it reads for `seconds`, or until `stop_file` appears."""
    depth = role.get("depth", 2)
    got, started = [0] * depth, [0.0] * depth

    def loop(k):
        size, chunk = role["stream_bytes"], role["chunk"]
        with _client(role, address) as c:
            c.tag = role["tag"]
            c.open(STREAM)
            deadline = _ready_and_go(role, k) + role["seconds"]
            started[k] = time.time()
            stop = Path(role["stop_file"]) if role.get("stop_file") else None
            piece = (role.get("rank", 0) * depth + k) * 7
            while time.time() < deadline and not (stop and stop.exists()):
                got[k] += len(c.read(STREAM, (piece * chunk) % (size - chunk), chunk))
                piece += 1
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - min(started)
    return {"job": role["job"], "rank": role.get("rank", 0), "bytes": sum(got), "seconds": elapsed,
            "bytes_per_s": sum(got) / elapsed if elapsed else 0.0, "pid": os.getpid()}


def _ready_and_go(role, k: int, timeout: float = 120) -> float:
    """Say this connection is ready, wait for the go (every reader starts within a few ms of the others, however
    late the pool's processes picked up the job); the time it went."""
    go = role.get("go_file")
    if not go:
        return time.time()
    Path(f"{go}.ready.{role['job']}.{role.get('rank', 0)}.{k}").touch()
    end = time.time() + timeout
    while not os.path.exists(go) and time.time() < end:
        time.sleep(0.002)
    return time.time()


def _epochs(role, address, seed) -> dict:
    """Read `epochs` epochs of the samples this rank's sampler gives it, from the shards (index) when there are
    any, else from the file-per-sample layout; every request is tagged {epoch, sample}. A sampler that raises
    NotImplementedError ends the rank's part with `not_implemented` (the other ranks' runs are unaffected)."""
    sampler, sha = _load(role["sampler"])
    index = role.get("index")
    counts = []
    with _client(role, address, code=sha) as c:
        for epoch in range(role["epochs"]):
            try:
                mine = [int(i) for i in sampler(role["samples"], role["rank"], role["world"], epoch, seed)]
            except NotImplementedError as e:
                return {"rank": role["rank"], "not_implemented": str(e) or "exercise", "code": sha}
            opened, bad = set(), 0
            for i in mine:
                c.tag = {"epoch": epoch, "sample": i}
                if index:
                    e = index[i]
                    if e["shard"] not in opened:
                        c.open(e["shard"])
                        opened.add(e["shard"])
                    got = c.read(e["shard"], e["offset"], e["length"])
                else:
                    got = c.get(sample_name(i))
                bad += got != sample_bytes(i, role["sample_size"], seed)
            counts.append({"epoch": epoch, "samples": len(mine), "wrong_bytes": bad})
    return {"rank": role["rank"], "epochs": counts, "code": sha, "pid": os.getpid()}


def _load(ref: str):
    module_name, _, name = ref.partition(":")
    module = importlib.import_module(module_name)
    module = importlib.reload(module)  # the notebook may have rewritten it since this process imported it
    path = Path(module.__file__)
    return getattr(module, name), {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


# -- the experiments -------------------------------------------------------------------------------------------
class StorageLab:
    """A pool of reader processes and a folder of server runs (one server per measurement, each with its log)."""

    def __init__(self, root, runs_dir, readers: int = 4, opens_per_s: float = 400.0):
        self.root, self.runs_dir = Path(root), Path(runs_dir)
        self.readers, self.opens_per_s = readers, opens_per_s
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.pool = SpmdPool(readers, init="none", threads=1, run_dir=self.runs_dir / "pool")
        self.stream_bytes = (self.root / STREAM).stat().st_size
        self.pool.run("scalelab.experiments.storage:ready", timeout=180)  # started before anything is timed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """End the reader processes."""
        self.pool.close()

    def server(self, name: str, bandwidth: float, policy: str = "fifo", code: str | None = None) -> ServerProcess:
        """A fresh server (its folder emptied) for one measurement; `code`: the policy's module file, copied into
        the server's code/ folder, which it imports from there."""
        d = self.runs_dir / name
        shutil.rmtree(d, ignore_errors=True)
        if code:
            (d / CODE_DIR).mkdir(parents=True)
            shutil.copyfile(code, d / CODE_DIR / Path(code).name)
        return ServerProcess.start(self.root, d, bandwidth, self.opens_per_s, policy)

    def _run(self, roles, address, timeout=120) -> list:
        return self.pool.run("scalelab.experiments.storage:reader", timeout=timeout, roles=roles, address=address)

    def _run_together(self, roles, address, timeout=120) -> list:
        """Run scanning roles that all start at one go: once every connection has said it is ready."""
        go = self.runs_dir / f"go-{time.time_ns()}"
        for role in roles:
            if role:
                role["go_file"] = str(go.resolve())
        want = sum(role.get("depth", 2) for role in roles if role)
        result: list = []
        errors: list = []

        def run():
            try:
                result.extend(self._run(roles, address, timeout))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                errors.append(e)
        t = threading.Thread(target=run)
        t.start()
        end = time.time() + timeout
        while t.is_alive() and len(list(self.runs_dir.glob(f"{go.name}.ready.*"))) < want and time.time() < end:
            time.sleep(0.005)
        go.touch()
        t.join()
        for p in self.runs_dir.glob(f"{go.name}*"):
            p.unlink()
        if errors:
            raise errors[0]
        return result

    def scaling(self, counts, bandwidth: float, seconds: float, chunk: int = 32768) -> dict:
        """For each N in `counts`: N readers scan the stream through one server for `seconds`; per-reader and total
        bandwidth from the server's log. Returns {"rows": [...], "log": path relative to runs_dir's parent}."""
        with self.server("scaling", bandwidth) as srv:
            for n in counts:
                roles = [{"kind": "scan", "job": f"scan-{n}", "rank": r, "job_size": n, "tag": f"scale-{n}",
                          "chunk": chunk, "seconds": seconds, "stream_bytes": self.stream_bytes}
                         if r < n else None for r in range(self.readers)]
                self._run_together(roles, srv.address)
        entries = read_log(srv.log_path)
        return {"rows": [scaling_row(entries, n, bandwidth) for n in counts], "log": str(srv.log_path)}

    def fair_share(self, jobs: list[dict], policies: list[str], bandwidth: float, seconds: float,
                   code_dir=".") -> list[dict]:
        """The jobs run together once per policy (a server of its own each) and each alone once (its throughput
        with the whole server); one row per policy with each job's share, target and slowdown, from the logs."""
        with self.server("alone", bandwidth) as srv:  # each job by itself, one after the other
            for job in jobs:
                self._run_together(self._job_roles([job], seconds / 2), srv.address)
        alone = job_rates(read_log(srv.log_path))
        rows = []
        for policy in policies:
            code = None if policy in BUILTIN else str(Path(code_dir) / f"{policy.partition(':')[0]}.py")
            name = "policy-" + policy.replace(":", "-")
            with self.server(name, bandwidth, policy, code) as srv:
                self._run_together(self._job_roles(jobs, seconds), srv.address)
            entries = read_log(srv.log_path)
            rows.append(share_row(entries, jobs, policy, alone) | {"log": str(srv.log_path)})
        return rows

    def _job_roles(self, jobs, seconds):
        roles = []
        for job in jobs:
            for r in range(job["ranks"]):
                roles.append({"kind": "scan", "job": job["job"], "user": job["user"], "rank": r,
                              "job_size": job["ranks"], "tag": job["job"], "chunk": job["chunk"], "seconds": seconds,
                              "stream_bytes": self.stream_bytes})
        if len(roles) > self.readers:
            raise ValueError(f"the jobs need {len(roles)} reader processes; the pool has {self.readers}")
        return roles + [None] * (self.readers - len(roles))

    def engine_beside(self, spec, bandwidth: float, job: dict | None = None, timeout: float = 300) -> dict:
        """An engine run (`spec`, a RunSpec) whose ranks read its shards through a server of its own; with `job`,
        that job's readers read from the same server for as long as the run lasts. The run's row: its summary, and
        from the server's log its ranks' requests, bytes and mean wait per request."""
        from ..launch import launch
        name = "engine-" + ("beside-" + job["job"] if job else "alone")
        with self.server(name, bandwidth) as srv:
            # the run's folder (and the shards it writes there) beneath the server's root; its name is the job's
            spec = spec.with_overrides({"data.server": srv.address, "data.format": "shards",
                                        "output_dir": str((self.root / "runs" / name).resolve())})
            stop = self.runs_dir / name / "stop"
            reading = None
            if job:
                roles = self._job_roles([job], timeout)
                for role in roles:
                    if role:
                        role["stop_file"] = str(stop.resolve())
                reading = threading.Thread(target=self._run, args=(roles, srv.address, timeout + 60))
                reading.start()
            try:
                summary = launch(spec).wait(timeout=timeout)
            finally:
                stop.touch()
                if reading:
                    reading.join()
        entries = read_log(srv.log_path)
        mine = [e for e in _requests(entries) if e["job"] == Path(summary["run_dir"]).name]
        return {"name": name, "run_dir": summary["run_dir"], "log": str(srv.log_path),
                "samples_per_s": summary["samples_per_s"], "data_fraction": summary["time_fraction"]["data"],
                "final_loss": summary["final_loss"], "ranks": sorted({e["rank"] for e in mine}),
                "requests": len(mine), "bytes": sum(e["bytes"] for e in mine),
                "mean_wait_ms": 1e3 * sum(e["wait"] for e in mine) / max(1, len(mine)),
                "other_bytes": sum(e["bytes"] for e in _requests(entries) if e["job"] != Path(summary["run_dir"]).name)}

    def epochs(self, name: str, sampler: str, world: int, samples: int, sample_size: int, epochs: int,
               bandwidth: float, index: list | None = None, seed: int = 0) -> dict:
        """`world` reader processes read `epochs` epochs, each its sampler's share, through one server; the log
        tags every request with its epoch and sample. Returns the readers' results and the log's path."""
        roles = [{"kind": "epochs", "job": name, "rank": r, "job_size": world, "world": world, "samples": samples,
                  "sample_size": sample_size, "epochs": epochs, "sampler": sampler, "index": index}
                 if r < world else None for r in range(self.readers)]
        with self.server(name, bandwidth) as srv:
            results = [x for x in self._run(roles, srv.address) if x is not None]
        missing = [x["not_implemented"] for x in results if "not_implemented" in x]
        return {"readers": results, "log": str(srv.log_path), "not_implemented": missing[0] if missing else "",
                "layout": "shards" if index else "files", "code": results[0]["code"] if results else {},
                "verdict": sampler_verdict(read_log(srv.log_path), samples, world, epochs, index)}

    def epoch_layouts(self, shards_dir: str | None, samples: int, sample_size: int, bandwidth: float,
                      seed: int = 0) -> dict:
        """One epoch of every sample by one reader, file per sample and (if `shards_dir`, relative to root, holds an
        index) from the shards; opens and bytes per epoch from each server's log."""
        out = {}
        for layout in ("files", "shards"):
            index = None
            if layout == "shards":
                index = load_index(self.root, shards_dir) if shards_dir else None
                if index is None:
                    continue
            with self.server(f"epoch-{layout}", bandwidth) as srv:
                roles = [{"kind": "epochs", "job": f"epoch-{layout}", "rank": 0, "world": 1, "samples": samples,
                          "sample_size": sample_size, "epochs": 1, "index": index,
                          "sampler": "scalelab.experiments.storage:in_order"}] + [None] * (self.readers - 1)
                result = self._run(roles, srv.address)[0]
            entries = [e for e in read_log(srv.log_path) if "op" in e]
            out[layout] = {"layout": layout, "opens": sum(e["opens"] for e in entries),
                           "bytes": sum(e["bytes"] for e in entries), "requests": len(entries),
                           "seconds": max(e["t"] for e in entries) - min(e["t"] - e["wait"] for e in entries),
                           "wrong_bytes": result["epochs"][0]["wrong_bytes"], "log": str(srv.log_path)}
        return out


def write_student_shards(ref: str, samples: list[bytes], folder, per_shard: int) -> dict:
    """Run the student's shard writer (`ref` = "module:function", reloaded) on `samples` into an emptied `folder`;
    what it wrote (`shard_info`). Whatever it raises (NotImplementedError while unwritten) reaches the caller."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    fn, sha = _load(ref)
    fn(samples, str(folder), per_shard)
    return shard_info(folder, sha)


def shard_info(folder, code: dict | str | None = None) -> dict:
    """What a shard folder holds: whether it has an index, its files and bytes; `code`: the writer's {file: sha256}
    (or the writer's file, hashed now)."""
    folder = Path(folder)
    if isinstance(code, str):
        code = {Path(code).name: hashlib.sha256(Path(code).read_bytes()).hexdigest()} if Path(code).is_file() else {}
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    written = (folder / INDEX).is_file()
    return {"written": written, "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "code": code or {}, "why": "" if written else f"no {INDEX} in {folder}: write_shards has not run"}


def in_order(n: int, rank: int, world: int, epoch: int, seed: int = 0) -> list[int]:
    """The trivial sampler of one reader: every sample in order."""
    return list(range(rank, n, world))


def load_index(root, shards_dir: str) -> list | None:
    """The student's index.json as a list with shard names relative to the server root; None when missing."""
    path = Path(root) / shards_dir / INDEX
    if not path.is_file():
        return None
    return [{**e, "shard": f"{shards_dir}/{e['shard']}"} for e in json.loads(path.read_text())]


# -- reading the log -------------------------------------------------------------------------------------------
def _requests(entries, tag=None):
    return [e for e in entries if "op" in e and (tag is None or e.get("tag") == tag)]


def reader_rates(entries, tag=None) -> dict:
    """{(job, rank): bytes/s} of each reader: the bytes served after its first request over the time from its first
    request served to its last (so the wait before the first does not count)."""
    by: dict = {}
    for e in _requests(entries, tag):
        if e["op"] == "read":
            by.setdefault((e["job"], e["rank"]), []).append(e)
    rates = {}
    for key, es in by.items():
        span = es[-1]["t"] - es[0]["t"]
        rates[key] = sum(e["bytes"] for e in es[1:]) / span if span > 0 else 0.0
    return rates


def job_rates(entries, tag=None) -> dict:
    """{job: bytes/s}: the sum of its readers' rates."""
    out: dict = {}
    for (job, _), rate in reader_rates(entries, tag).items():
        out[job] = out.get(job, 0.0) + rate
    return out


def scaling_row(entries, n: int, bandwidth: float) -> dict:
    """N readers' per-reader bandwidth (mean, min, max) and their total, and the 1/N prediction."""
    rates = list(reader_rates(entries, f"scale-{n}").values())
    mean = sum(rates) / len(rates) if rates else 0.0
    return {"readers": n, "per_reader_mb_s": mean / 1e6, "min_mb_s": min(rates, default=0) / 1e6,
            "max_mb_s": max(rates, default=0) / 1e6, "total_mb_s": sum(rates) / 1e6,
            "budget_mb_s": bandwidth / 1e6, "fair_mb_s": bandwidth / n / 1e6}


def window(entries) -> tuple[float, float]:
    """The time all jobs were reading: from the last job's first served request to the first job's last one."""
    first, last = {}, {}
    for e in _requests(entries):
        first.setdefault(e["job"], e["t"])
        last[e["job"]] = e["t"]
    return max(first.values()), min(last.values())


def shares(entries) -> dict:
    """{job: its fraction of the bytes served while every job was reading}."""
    lo, hi = window(entries)
    got: dict = {}
    for e in _requests(entries):
        if lo <= e["t"] <= hi:
            got[e["job"]] = got.get(e["job"], 0) + e["bytes"]
    total = sum(got.values()) or 1
    return {job: b / total for job, b in got.items()}


def targets(jobs: list[dict], policy: str) -> dict | None:
    """Each job's share of the server under `policy` (job-fair for a policy of the student's); None for fifo,
    whose shares follow from how fast each job asks."""
    if policy == "fifo":
        return None
    if policy == "size-fair":
        total = sum(j["ranks"] for j in jobs)
        return {j["job"]: j["ranks"] / total for j in jobs}
    if policy == "user-fair":  # each user an equal part; within a user, the jobs ask as FIFO: by bytes per round
        users = {j["user"] for j in jobs}
        out = {}
        for j in jobs:
            mine = [k for k in jobs if k["user"] == j["user"]]
            out[j["job"]] = j["ranks"] * j["chunk"] / sum(k["ranks"] * k["chunk"] for k in mine) / len(users)
        return out
    return {j["job"]: 1 / len(jobs) for j in jobs}


def share_row(entries, jobs, policy, alone) -> dict:
    """One policy's result: each job's share, the job-fair target's error, and its slowdown (rate alone over rate
    shared)."""
    got, shared = shares(entries), job_rates(entries)
    want = targets(jobs, policy)
    fair = {j["job"]: 1 / len(jobs) for j in jobs}
    row = {"policy": policy, "jobs": {}}
    for j in jobs:
        name = j["job"]
        row["jobs"][name] = {"share": got.get(name, 0.0), "target": want[name] if want else None,
                             "error_vs_target": abs(got.get(name, 0.0) / want[name] - 1) if want else None,
                             "error_vs_job_fair": abs(got.get(name, 0.0) / fair[name] - 1),
                             "slowdown": alone[name] / shared[name] if shared.get(name) else None}
    row["worst_error_vs_job_fair"] = max(x["error_vs_job_fair"] for x in row["jobs"].values())
    starts = [e for e in entries if e.get("event") == "start"]
    row["code"] = starts[0]["code"] if starts else {}
    row["policy_errors"] = [e["error"] for e in entries if e.get("event") == "policy_error"]
    return row


def sampler_verdict(entries, samples: int, world: int, epochs: int, index: list | None = None) -> dict:
    """What the log says the sampler did: per epoch, are the ranks' samples disjoint, do they cover all
    `samples`, are the ranks' counts within one of each other, and did each rank's samples change between epochs.
    Each read must be where the layout keeps its tagged sample (the shard index, or the sample's own file)."""
    by: dict = {}
    misplaced = 0
    for e in _requests(entries):
        if e["op"] not in ("read", "get") or not isinstance(e.get("tag"), dict):
            continue
        i = e["tag"].get("sample")
        if index is not None:
            ok = isinstance(i, int) and 0 <= i < len(index) and (index[i]["shard"], index[i]["offset"]) == \
                (e["name"], e["offset"])
        else:
            ok = e["name"] == sample_name(i) if isinstance(i, int) else False
        misplaced += not ok
        by.setdefault(e["tag"].get("epoch"), {}).setdefault(e["rank"], []).append(i)
    per_epoch = []
    for epoch in range(epochs):
        ranks = by.get(epoch, {})
        sets = [set(ranks.get(r, [])) for r in range(world)]
        union = set().union(*sets) if sets else set()
        overlap = sum(len(s) for s in sets) - len(union)
        counts = [len(ranks.get(r, [])) for r in range(world)]
        per_epoch.append({"epoch": epoch, "counts": counts, "overlap": overlap, "covered": len(union),
                          "repeats": sum(len(ranks.get(r, [])) - len(sets[r]) for r in range(world))})
    disjoint = all(p["overlap"] == 0 and p["repeats"] == 0 for p in per_epoch)
    complete = all(p["covered"] == samples for p in per_epoch)
    balanced = all(max(p["counts"]) - min(p["counts"]) <= 1 for p in per_epoch)
    reshuffled = epochs > 1 and all(by.get(e, {}).get(r) != by.get(0, {}).get(r) for e in range(1, epochs)
                                    for r in range(world))
    return {"epochs": per_epoch, "disjoint": disjoint, "complete": complete, "balanced": balanced,
            "reshuffled": reshuffled, "misplaced": misplaced}


def run_log(workdir, path) -> list[dict]:
    """A server log at a recorded path, re-read beneath `workdir` the way a grader reads a submission's files."""
    from .profiling import read_run_file
    return json_lines(read_run_file(workdir, path))


__all__ = ["JOBS", "make_jobs", "STREAM", "FILES", "INDEX", "StorageLab", "make_data", "sample_bytes", "sample_list",
           "sample_name", "reader", "in_order", "write_student_shards", "shard_info", "load_index", "reader_rates", "job_rates", "scaling_row", "window",
           "shares", "targets", "share_row", "sampler_verdict", "run_log"]
