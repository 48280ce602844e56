"""A shared storage server: one process that every reader (the ranks of a run, several jobs at once) reads files
from over TCP, with one bandwidth budget and one metadata budget for all of them, a policy that picks which
pending request it serves next, and a log of every request.

    python -m scalelab.data.storage_server --root data/ --dir server/ --bandwidth 8e6 --opens 400 --policy job-fair

    srv = ServerProcess.start("data/", "server/", bandwidth=8e6, opens_per_s=400, policy="fifo")
    c = StorageClient(srv.address, job="big", user="bob", rank=1, job_size=3)
    c.open("shard-00000.bin"); chunk = c.read("shard-00000.bin", 4096, 1024)
    srv.stop(); entries = read_log(srv.log_path)

Why a server and not a sleep in each reader: a parallel file system is one machine's budget shared by every client
of the centre, so one job's reads slow every other job's (TACC's ThemisIO measures exactly that). Here the server
serves one request at a time from a queue; each request first takes its cost from a token bucket (bytes from the
bandwidth bucket, one token per open from the metadata bucket), so N busy readers each get about 1/N of it, and
what a reader waits is measured at the server, not slept by the reader. The policy (fifo, size-fair, job-fair,
user-fair, or a student's "module:function") decides which job waits.

The log (`requests.jsonl`, one JSON object a line) is the grader's evidence: a `start` line (budgets, policy, the
SHA-256 of a policy's code), then one line per served request: t (s since start, when it was served), job, user,
rank, host, tag, op (open | read | get), name, offset, bytes, opens, wait (s from arrival to served), queue (requests
waiting then).

Who may read: on its node, only processes of the server's own account (the owner of the connecting socket, from
/proc/net/tcp): a classmate's process on a shared node is refused (its uid logged), so it can neither read the
student's data nor skew the shares. A connection from another node has no owner this node can see and is served,
as a parallel file system serves the cluster's network.

What it does not model: several storage targets, client caches, write traffic. It serves only files beneath
`root` (no path with '..', no absolute path, no symbolic link followed out of it).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scalelab.errors import ScalelabError  # absolute: the server process loads this file alone (no torch)
from scalelab.paths import json_lines
from scalelab.run.sockets import socket_owner

POLICIES = ("fifo", "size-fair", "job-fair", "user-fair")
"""The built-in policies; any other value must be "module:function" (a policy of the student's)."""
LOG_NAME, ADDRESS_NAME, CODE_DIR = "requests.jsonl", "server.json", "code"


class StorageServerError(ScalelabError):
    """The storage server refused a request or could not start; the message says why."""


class TokenBucket:
    """`rate` tokens a second, at most `burst` kept; take(n) blocks until n are there (a bigger n goes into debt,
    paid back before the next take), and returns the seconds it blocked."""

    def __init__(self, rate: float, burst: float):
        if rate <= 0:
            raise ValueError(f"a token bucket needs a rate > 0, got {rate}")
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self, n: float) -> float:
        """Take `n` tokens, sleeping until the bucket has them."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        short = n - self.tokens
        waited = 0.0
        if short > 0:
            waited = short / self.rate
            time.sleep(waited)
            self.at = time.monotonic()
            self.tokens = 0.0  # the sleep earned exactly what was missing (an overshoot is not credited)
        else:
            self.tokens -= n
        return waited


@dataclass
class Request:
    """One pending request, as the policy sees it (as_dict) and as the server serves it."""

    job: str
    user: str
    rank: int
    host: str
    job_size: int
    op: str
    name: str
    offset: int = 0
    length: int = -1
    tag: object = None
    arrived: float = 0.0
    bytes: int = 0
    conn: object = None
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None
    data: bytes = b""

    def as_dict(self) -> dict:
        """What a policy gets for this request (plain values only)."""
        return {"job": self.job, "user": self.user, "rank": self.rank, "host": self.host, "job_size": self.job_size,
                "op": self.op, "name": self.name, "bytes": self.bytes, "arrived": self.arrived}


# -- policies: (queue of requests as dicts, served bytes by job, served bytes by user, job sizes) -> index -----------
def fifo(queue, served, by_user, sizes) -> int:
    """First come, first served: a job with more readers gets more of the server."""
    return 0


def job_fair(queue, served, by_user, sizes) -> int:
    """The request of the job served least so far (ties: the earliest): every busy job gets an equal share."""
    return min(range(len(queue)), key=lambda i: (served.get(queue[i]["job"], 0), i))


def user_fair(queue, served, by_user, sizes) -> int:
    """The request of the user served least so far: every busy user gets an equal share, whatever their jobs."""
    return min(range(len(queue)), key=lambda i: (by_user.get(queue[i]["user"], 0), i))


def size_fair(queue, served, by_user, sizes) -> int:
    """The request of the job served least per reader (rank) it has: shares in proportion to job size."""
    return min(range(len(queue)), key=lambda i: (served.get(queue[i]["job"], 0) / max(1, sizes[queue[i]["job"]]), i))


BUILTIN = {"fifo": fifo, "job-fair": job_fair, "user-fair": user_fair, "size-fair": size_fair}


def load_policy(policy: str, code_dir: Path | None):
    """(a function (queue, served, by_user, sizes) -> index, the {file: sha256} of the code it came from)."""
    if policy in BUILTIN:
        return BUILTIN[policy], {}
    module_name, _, name = policy.partition(":")
    if not name:
        raise StorageServerError(f"policy {policy!r}: use one of {', '.join(POLICIES)} or 'module:function'")
    if code_dir is not None:
        sys.path.insert(0, str(code_dir))
    module = importlib.import_module(module_name)
    fn = getattr(module, name)
    path = Path(module.__file__)
    student = lambda queue, served, by_user, sizes: fn(queue, served)  # noqa: E731 - the student's two arguments
    return student, {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}


class Server:
    """The server's state: the queue, the budgets, the policy, the log; `dispatch` serves one request at a time."""

    def __init__(self, root, log_path, bandwidth: float, opens_per_s: float, policy: str = "fifo",
                 code_dir=None, burst_s: float = 0.002):
        self.root = Path(root).resolve()
        self.policy_name = policy
        self.policy, self.code = load_policy(policy, code_dir)
        self.bandwidth = TokenBucket(bandwidth, bandwidth * burst_s)
        self.metadata = TokenBucket(opens_per_s, max(1.0, opens_per_s * burst_s))
        self.queue: list[Request] = []
        self.cond = threading.Condition()
        self.served: dict[str, int] = {}
        self.by_user: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.policy_errors = 0
        self.t0 = time.monotonic()
        self._log_lock = threading.Lock()
        self.log = open(log_path, "a", buffering=1)
        self._write({"event": "start", "policy": policy, "code": self.code, "bandwidth": bandwidth,
                     "opens_per_s": opens_per_s, "root": str(self.root), "pid": os.getpid(), "time": time.time()})

    def _write(self, entry: dict) -> None:
        with self._log_lock:  # the dispatcher and the connections' threads both write
            self.log.write(json.dumps(entry) + "\n")

    def connected(self, hello: dict) -> None:
        """Log a client's hello: who it says it is, and the code it runs (`code`: {file: sha256}), if it says."""
        with self.cond:
            self._write({"event": "connect", "t": round(time.monotonic() - self.t0, 6),
                         **{k: hello.get(k) for k in ("job", "user", "rank", "host", "job_size", "code")}})

    def path(self, name: str) -> Path:
        """`name` beneath the root; anything that would leave it is refused."""
        p = (self.root / name).resolve()
        if name.startswith("/") or (p != self.root and self.root not in p.parents):
            raise StorageServerError(f"{name!r} is not beneath the server's root")
        return p

    def submit(self, req: Request) -> Request:
        """Queue `req` and wait until the dispatcher has served it."""
        req.arrived = time.monotonic()
        if req.op in ("read", "get"):
            size = self.path(req.name).stat().st_size
            req.bytes = max(0, (size - req.offset) if req.length < 0 else min(req.length, size - req.offset))
        with self.cond:
            self.sizes[req.job] = max(self.sizes.get(req.job, 0), req.job_size)
            self.queue.append(req)
            self.cond.notify()
        req.done.wait()
        return req

    def _pick(self) -> Request:
        view = [r.as_dict() for r in self.queue]
        try:
            i = self.policy(view, dict(self.served), dict(self.by_user), dict(self.sizes))
            if not isinstance(i, int) or not 0 <= i < len(view):
                raise StorageServerError(f"the policy returned {i!r}, not an index into the queue of {len(view)}")
        except Exception as e:  # noqa: BLE001 - a student's policy that fails is logged, the server serves FIFO
            self.policy_errors += 1
            if self.policy_errors <= 3:
                self._write({"event": "policy_error", "error": f"{type(e).__name__}: {e}",
                             "t": time.monotonic() - self.t0})
            i = 0
        return self.queue.pop(i)

    def dispatch_forever(self) -> None:
        """Serve the queue, one request at a time, each after its cost is taken from the budgets."""
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                waiting = len(self.queue) - 1
                req = self._pick()
            try:
                self._serve(req)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                req.reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            else:
                req.reply = {"ok": True, "bytes": len(req.data), "wait": time.monotonic() - req.arrived}
                self._log(req, waiting)
            req.done.set()

    def _serve(self, req: Request) -> None:
        path = self.path(req.name)
        if req.op in ("open", "get"):
            self.metadata.take(1)
            if not path.is_file():
                raise StorageServerError(f"{req.name} does not exist")
            req.conn.opened.add(req.name)
        if req.op == "open":
            req.data = b""
            req.reply_size = path.stat().st_size
            return
        if req.name not in req.conn.opened:
            raise StorageServerError(f"read of {req.name} before it was opened on this connection")
        self.bandwidth.take(req.bytes)
        with open(path, "rb") as f:
            req.data = os.pread(f.fileno(), req.bytes, req.offset)
        self.served[req.job] = self.served.get(req.job, 0) + len(req.data)
        self.by_user[req.user] = self.by_user.get(req.user, 0) + len(req.data)
        if req.op == "get":
            req.conn.opened.discard(req.name)

    def _log(self, req: Request, waiting: int) -> None:
        now = time.monotonic()
        self._write({"t": round(now - self.t0, 6), "job": req.job, "user": req.user, "rank": req.rank,
                     "host": req.host, "tag": req.tag, "op": req.op, "name": req.name, "offset": req.offset,
                     "bytes": len(req.data), "opens": int(req.op in ("open", "get")),
                     "wait": round(now - req.arrived, 6), "queue": waiting})


class _Handler(socketserver.StreamRequestHandler):
    """One client connection: a hello line, then request lines, each answered by a reply line and its bytes."""

    def handle(self):
        server: Server = self.server.state
        owner = socket_owner(self.client_address, self.request.getsockname())  # the client's end: its owner
        if owner is not None and owner != os.geteuid():  # another account's process on this node: not its data
            server._write({"event": "refused", "t": round(time.monotonic() - server.t0, 6), "uid": owner})
            self._reply({"ok": False, "error": f"this storage server serves only its own account's processes "
                                               f"(uid {os.geteuid()}); yours is uid {owner}"})
            return
        self.opened: set[str] = set()
        hello = None
        for line in self.rfile:
            msg = json.loads(line)
            if hello is None:
                hello = msg
                server.connected(hello)
                self._reply({"ok": True, "root": str(server.root)})
                continue
            if msg.get("op") == "stats":
                with server.cond:
                    self._reply({"ok": True, "served": dict(server.served), "queue": len(server.queue)})
                continue
            if msg.get("op") not in ("open", "read", "get"):
                self._reply({"ok": False, "error": f"unknown op {msg.get('op')!r}"})
                continue
            req = Request(job=str(hello.get("job", "")), user=str(hello.get("user", "")),
                          rank=int(hello.get("rank", 0)), host=str(hello.get("host", "")),
                          job_size=int(hello.get("job_size", 1)), op=msg["op"], name=str(msg["name"]),
                          offset=int(msg.get("offset", 0)), length=int(msg.get("length", -1)), tag=msg.get("tag"),
                          conn=self)
            try:
                server.submit(req)
            except Exception as e:  # noqa: BLE001 - a missing file or a path outside the root, before queueing
                req.reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            reply = dict(req.reply)
            if req.op == "open" and reply.get("ok"):
                reply["size"] = req.reply_size
            self._reply(reply, req.data if reply.get("ok") else b"")

    def _reply(self, header: dict, data: bytes = b"") -> None:
        self.wfile.write(json.dumps(header).encode() + b"\n" + data)
        self.wfile.flush()


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(root, directory, bandwidth: float, opens_per_s: float, policy: str = "fifo", host: str = "127.0.0.1",
          port: int = 0) -> None:
    """Run a server until SIGTERM: it writes <directory>/server.json ({host, port, pid}) once it listens."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    code_dir = directory / CODE_DIR
    state = Server(root, directory / LOG_NAME, bandwidth, opens_per_s, policy,
                   code_dir if code_dir.is_dir() else None)
    tcp = _TCPServer((host, port), _Handler)
    tcp.state = state
    threading.Thread(target=state.dispatch_forever, daemon=True, name="dispatch").start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=tcp.shutdown, daemon=True).start())
    tmp = directory / f".{ADDRESS_NAME}.tmp"
    tmp.write_text(json.dumps({"host": host, "port": tcp.server_address[1], "pid": os.getpid()}))
    os.replace(tmp, directory / ADDRESS_NAME)
    try:
        tcp.serve_forever(poll_interval=0.1)
    finally:
        state.log.close()


# The server process runs this file by itself: `-m scalelab.data.storage_server` would import scalelab.data, whose
# loaders import torch (seconds on a busy machine, for a server that needs only the standard library).
_BOOT = ("import importlib.util, sys; path = sys.argv[1]; "
         "spec = importlib.util.spec_from_file_location('scalelab_storage_server', path); "
         "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m); "
         "sys.exit(m.main(sys.argv[2:]))")


class ServerProcess:
    """A storage server in a process of its own (start / stop); `address` is "host:port"."""

    def __init__(self, proc: subprocess.Popen, directory: Path, address: str):
        self.proc, self.dir, self.address = proc, directory, address

    @property
    def log_path(self) -> Path:
        """The server's request log."""
        return self.dir / LOG_NAME

    @classmethod
    def start(cls, root, directory, bandwidth: float, opens_per_s: float, policy: str = "fifo",
              host: str = "127.0.0.1", connect_host: str | None = None, timeout: float = 60) -> "ServerProcess":
        """Start a server process (this file, run alone) and wait until it listens."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ADDRESS_NAME).unlink(missing_ok=True)
        cmd = [sys.executable, "-c", _BOOT, __file__, "--root", str(root), "--dir", str(directory),
               "--bandwidth", str(bandwidth), "--opens", str(opens_per_s), "--policy", policy, "--host", host]
        out = open(directory / "server.log", "ab")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        deadline = time.monotonic() + timeout
        while not (directory / ADDRESS_NAME).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = (directory / "server.log").read_text(errors="replace")[-2000:]
                raise StorageServerError(f"the storage server did not start (exit {proc.poll()}): {tail}")
            time.sleep(0.02)
        info = json.loads((directory / ADDRESS_NAME).read_text())
        return cls(proc, directory, f"{connect_host or info['host']}:{info['port']}")

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL if it has not ended within `timeout`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class StorageClient:
    """One reader's connection: it says who it is once (job, user, rank, host, job size, and the student's code it
    runs as {file: sha256}, all logged), then asks for files.
    `tag` (e.g. the epoch) goes with every request into the server's log."""

    def __init__(self, address: str, job: str, user: str = "", rank: int = 0, host: str | None = None,
                 job_size: int = 1, code: dict | None = None, timeout: float = 120):
        host_name, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host_name, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile = self.sock.makefile("rb")
        self.tag = None
        self.waited = 0.0
        self.root = self._ask({"op": "hello", "job": job, "user": user or job, "rank": rank,
                               "host": host or socket.gethostname(), "job_size": job_size, "code": code})[0]["root"]

    def _ask(self, msg: dict) -> tuple[dict, bytes]:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        header = json.loads(self.rfile.readline())
        if not header.get("ok"):
            raise StorageServerError(f"the storage server refused {msg.get('op')} {msg.get('name', '')}: "
                                     f"{header.get('error')}")
        n = header.get("bytes", 0)
        data = self.rfile.read(n) if n else b""
        self.waited += header.get("wait", 0.0)
        return header, data

    def open(self, name: str) -> int:
        """Open `name` (one metadata operation); returns its size."""
        return self._ask({"op": "open", "name": name, "tag": self.tag})[0]["size"]

    def read(self, name: str, offset: int = 0, length: int = -1) -> bytes:
        """`length` bytes of an opened file from `offset` (-1: to the end)."""
        return self._ask({"op": "read", "name": name, "offset": offset, "length": length, "tag": self.tag})[1]

    def get(self, name: str) -> bytes:
        """A whole file: open, read and close in one request (a file per sample reads this way)."""
        return self._ask({"op": "get", "name": name, "tag": self.tag})[1]

    def stats(self) -> dict:
        """Bytes served so far, by job, and the queue's length (answered at once, not queued)."""
        return self._ask({"op": "stats"})[0]

    def close(self) -> None:
        """Close the connection."""
        self.rfile.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_log(path) -> list[dict]:
    """The server's log entries (start line, request lines, policy errors), in order."""
    return json_lines(Path(path).read_text())


def main(argv=None) -> int:
    """`python -m scalelab.data.storage_server`: run a server until SIGTERM."""
    p = argparse.ArgumentParser(description="A shared storage server with a bandwidth and a metadata budget.")
    p.add_argument("--root", required=True, help="the folder whose files it serves")
    p.add_argument("--dir", required=True, help="where it writes server.json and requests.jsonl")
    p.add_argument("--bandwidth", type=float, required=True, help="bytes/s shared by all clients")
    p.add_argument("--opens", type=float, required=True, help="metadata operations (opens)/s shared by all")
    p.add_argument("--policy", default="fifo", help=f"{', '.join(POLICIES)} or module:function")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    serve(a.root, a.dir, a.bandwidth, a.opens, a.policy, a.host, a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["POLICIES", "BUILTIN", "TokenBucket", "Server", "ServerProcess", "StorageClient", "StorageServerError",
           "read_log", "serve", "fifo", "job_fair", "user_fair", "size_fair"]
