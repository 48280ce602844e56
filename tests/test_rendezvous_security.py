"""A run's rendezvous is its own (issue 39, item 2): a classmate on the same node cannot join, read or stall it.

The attacks run as another account (uid 65534, "the classmate", a child process that setuid()s before it runs)
against real runs of the local launcher, on the port the run listens on (the classmate can see it in
/proc/net/tcp anyway). Before the change the ranks met at a torch TCPStore through env://: any process could
connect, `list_keys()` every key, read the ranks' addresses and set the keys a late rank waits for.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from scalelab.launch import launch
from scalelab.launch import local as local_launcher
from scalelab.launch.base import start_process, worker_command
from scalelab.run.procs import scrub_env
from scalelab.run.rendezvous import (FD_VAR, SECRET_VAR, RendezvousRefused, StoreServer, hold_port, join_store,
                                     new_secret, run_store_class)

from helpers import loss_curve, tiny

ROOT = Path(__file__).resolve().parent.parent
CLASSMATE = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the classmate is another account: needs root to setuid")


def classmate(code: str, timeout: float = 60) -> dict:
    """Run `code` as uid/gid 65534 in a fresh interpreter; it prints one JSON line, returned here."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], user=CLASSMATE, group=CLASSMATE,
                       extra_groups=[], cwd="/", capture_output=True, text=True, timeout=timeout,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _rank_process(run_dir: Path, rank: int, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = p.info["cmdline"] or []
                if "scalelab.train.worker" in cmd and str(run_dir) in " ".join(cmd) and \
                        p.environ().get("RANK") == str(rank):
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of {run_dir} never started")


def _env_rdzv_run(tmp_path) -> dict:
    """The tiny preset on 2 ranks through env:// (MASTER_ADDR/PORT, no secret): what every run did before."""
    spec = tiny(tmp_path, "env")
    from scalelab.launch.base import prepare_run_dir
    from scalelab.run.handle import Run
    spec, run_dir, reader = prepare_run_dir(spec)
    with hold_port() as s:
        port = s.getsockname()[1]
    procs = [start_process(worker_command(run_dir), local_launcher.rank_env(scrub_env(), r, 2, port, 1),
                           run_dir / "logs" / f"launcher-rank-{r}.log") for r in range(2)]
    run = local_launcher.LocalRun(spec, run_dir, procs, rank_of_proc=True, reader=reader)
    assert isinstance(run, Run)
    return run.wait(timeout=180)


@pytest.fixture(scope="module")
def env_reference(tmp_path_factory):
    return _env_rdzv_run(tmp_path_factory.mktemp("envref"))


ATTACK = """
    import json, os, socket, datetime
    import torch.distributed as dist
    from scalelab.run.rendezvous import RendezvousRefused, run_store_class
    port, rank0 = {port}, {rank0}
    out = {{"uid": os.getuid()}}
    t = datetime.timedelta(seconds=5)
    try:  # the secret is in the ranks' environment: another account cannot read it
        open(f"/proc/{{rank0}}/environ").read()
        out["environ"] = "read"
    except OSError as e:
        out["environ"] = type(e).__name__
    try:  # torch's own client: list every key, read and set a rank's address, count itself in
        c = dist.TCPStore("127.0.0.1", port, None, False, t)
        out["tcpstore"] = "connected"
        out["keys"] = c.list_keys()
        c.set("default_pg/0//1", "attacker")
        out["tcpstore"] = "set"
    except Exception as e:
        out.setdefault("keys", None)
        out["tcpstore_error"] = type(e).__name__
    try:  # the run's own protocol with a guessed secret
        run_store_class()("127.0.0.1", port, "0" * 64, t).set("x", "y")
        out["guessed_secret"] = "accepted"
    except RendezvousRefused:
        out["guessed_secret"] = "refused"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # raw bytes: a bogus proof, then a frame
        s.recv(40)
        s.sendall(b"\\0" * 64 + b"\\0\\0\\0\\x10" + b'{{"op": "num_keys"}}')
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
        out["raw_reply"] = got.hex()
    try:  # join the process group as rank 1 through env://, as a worker started by hand would
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=1, world_size=2, timeout=t)
        out["joined"] = True
    except Exception as e:
        out["joined"] = False
        out["join_error"] = type(e).__name__
    print(json.dumps(out))
"""


@as_root
def test_a_classmate_cannot_join_read_or_stall_a_run_waiting_at_rendezvous(tmp_path, monkeypatch, env_reference):
    real_start = local_launcher.start_process

    def rank_1_late(cmd, env, log_path, pass_fds=()):  # the victim's rank 1 arrives 10 s after rank 0
        if env["RANK"] == "1":
            cmd = ["sh", "-c", 'sleep 10; exec "$@"', "sh", *cmd]
        return real_start(cmd, env, log_path, pass_fds=pass_fds)

    monkeypatch.setattr(local_launcher, "start_process", rank_1_late)
    run = launch(tiny(tmp_path, "victim"))
    rank0 = _rank_process(run.run_dir, 0)
    port, secret = int(rank0.environ()["MASTER_PORT"]), rank0.environ()[SECRET_VAR]
    # rank 0 serves (a proven client of ours gets in) and waits for rank 1: the classmate attacks now
    run_store_class()("127.0.0.1", port, secret, timedelta(seconds=30)).num_keys()
    started = time.monotonic()
    seen = classmate(ATTACK.format(port=port, rank0=rank0.pid))
    assert time.monotonic() - started < 10 + 30, "the attack itself must not wait on the run"
    summary = run.wait(timeout=180)

    assert seen["uid"] == CLASSMATE
    assert seen["environ"] == "PermissionError"
    assert seen["keys"] is None and "tcpstore" not in seen, seen  # torch's client got no key and set nothing
    assert seen["guessed_secret"] == "refused"
    assert seen["raw_reply"] == "", "a bogus proof gets no answer, not even an error frame"
    assert seen["joined"] is False, seen
    # the victim trained as if nobody had knocked: both ranks, every step, env://'s losses
    assert summary["status"] == "succeeded" and summary["world_size"] == 2 and summary["steps"] == 20
    assert loss_curve(summary) == pytest.approx(loss_curve(env_reference), rel=1e-6, abs=1e-7)


@as_root
def test_the_port_is_the_runs_from_the_pick_a_classmate_cannot_bind_it(tmp_path):
    listener = hold_port()  # what the launcher does before it starts rank 0
    port = listener.getsockname()[1]
    try:
        seen = classmate(f"""
            import json, socket
            out = {{}}
            for host in ("127.0.0.1", "0.0.0.0"):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                try:
                    s.bind((host, {port}))
                    out[host] = "bound"
                except OSError as e:
                    out[host] = e.errno
            print(json.dumps(out))
        """)
        assert seen == {"127.0.0.1": 98, "0.0.0.0": 98}, seen  # EADDRINUSE, SO_REUSEPORT or not
        # and rank 0, handed the very socket, serves on it: a rank with the secret meets it there
        secret = new_secret()
        rank0 = join_store(0, 2, timedelta(seconds=10), {SECRET_VAR: secret, FD_VAR: str(os.dup(listener.fileno())),
                                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        rank1 = join_store(1, 2, timedelta(seconds=10), {SECRET_VAR: secret, "MASTER_ADDR": "127.0.0.1",
                                                         "MASTER_PORT": str(port)})
        rank1.set("a", b"1")
        assert rank0.get("a") == b"1"
    finally:
        listener.close()
    # where no launcher holds it (srun, a batch job: ranks on other nodes), rank 0 binds MASTER_PORT itself
    with hold_port() as probe:
        free = probe.getsockname()[1]
    env = {SECRET_VAR: new_secret(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free)}
    rank0, rank1 = join_store(0, 2, timedelta(seconds=10), env), join_store(1, 2, timedelta(seconds=10), env)
    rank0.set("b", b"2")
    assert rank1.get("b") == b"2"


@as_root
def test_a_rank_refuses_a_classmates_listener_on_the_port_and_tells_it_nothing():
    """Where no launcher holds the port (ranks on other nodes: srun, a batch job), a classmate may listen on
    MASTER_PORT first; the rank then fails saying so, and the classmate got only a proof it cannot use."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, os, socket, sys
        from scalelab.run.rendezvous import MAGIC
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
        print(s.getsockname()[1], flush=True)
        conn, _ = s.accept()
        conn.sendall(MAGIC + os.urandom(32))      # looks like rank 0's server
        got = conn.recv(64)
        conn.sendall(os.urandom(32))              # a proof it cannot make
        conn.settimeout(5)
        rest = b""
        try:
            while chunk := conn.recv(4096):
                rest += chunk
        except OSError:
            pass
        print(json.dumps({{"uid": os.getuid(), "proof_bytes": len(got), "after": rest.hex()}}))
    """)], user=CLASSMATE, group=CLASSMATE, extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/"})
    try:
        port = int(proc.stdout.readline())
        env = {SECRET_VAR: new_secret(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        # rank 0 first, while the classmate certainly still listens (it leaves 5 s after the rank below hangs up)
        with pytest.raises(RendezvousRefused, match="rank 0 cannot bind it"):  # rank 0 does not share the port
            join_store(0, 2, timedelta(seconds=10), {**env, "MASTER_PORT": str(port)})
        with pytest.raises(RendezvousRefused, match="could not prove the run's secret"):
            join_store(1, 2, timedelta(seconds=10), env)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["uid"] == CLASSMATE and seen["proof_bytes"] == 64 and seen["after"] == ""


def test_the_store_keeps_torchs_semantics_for_proven_clients():
    with hold_port() as listener:
        secret = new_secret()
        server = StoreServer(socket.socket(fileno=os.dup(listener.fileno())), secret)
        a = run_store_class()("127.0.0.1", listener.getsockname()[1], secret, timedelta(seconds=5))
        b = run_store_class()("127.0.0.1", listener.getsockname()[1], secret, timedelta(seconds=5))
        assert a.add("n", 2) == 2 and b.add("n", 3) == 5
        assert a.compare_set("c", "", "first") == b"first" and b.compare_set("c", "x", "y") == b"first"
        assert a.check(["n", "c"]) and not a.check(["missing"])
        b.set("k", b"\x00\xff")
        assert a.get("k") == b"\x00\xff" and a.num_keys() == 3
        import torch.distributed as dist
        with pytest.raises(dist.DistStoreError, match="Timed out"):
            a.wait(["never"], timedelta(seconds=0.2))
        assert a.delete_key("k") and not a.delete_key("k")
        with pytest.raises(RendezvousRefused):
            run_store_class()("127.0.0.1", listener.getsockname()[1], new_secret(), timedelta(seconds=5))
        assert server.refused == 1


POOL_JOB = """
import os
import torch
import torch.distributed as dist

def world_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    # env:// would give a TCPStore; the run's own store comes back through torch as its base class, Store
    return {"sum": t.item(), "store": type(store).__name__, "secret": len(os.environ.get("SCALELAB_RDZV_SECRET", "")),
            "fd": os.environ.get("SCALELAB_RDZV_FD")}
"""


def test_ranks_with_the_secret_train_as_env_did_and_a_pool_still_runs(tmp_path, env_reference, monkeypatch):
    """Controls: the local launcher's run (its own rendezvous) follows env://'s losses step for step, and an
    SPMD pool's ranks meet at the pool's own store and run collectives job after job."""
    summary = launch(tiny(tmp_path)).wait(timeout=180)
    assert summary["status"] == "succeeded" and summary["steps"] == 20
    assert loss_curve(summary) == pytest.approx(loss_curve(env_reference), rel=1e-6, abs=1e-7)
    from scalelab.launch.spmd import SpmdPool
    (tmp_path / "rdzv_jobs.py").write_text(POOL_JOB)
    monkeypatch.chdir(tmp_path)
    with SpmdPool(world=2, threads=1, run_dir=tmp_path / "pool") as pool:
        first = pool.run("rdzv_jobs:world_sum")
        again = pool.run("rdzv_jobs:world_sum")
    assert first == again
    assert all(r["sum"] == 3.0 and r["store"] in ("RunStore", "Store") and r["secret"] == 64 for r in first), first
    assert first[0]["fd"] is None  # rank 0 took the socket; a later group in it makes no second server
