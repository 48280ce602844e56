"""A run's private rendezvous: the store through which its ranks find each other (torch.distributed's process group
exchanges its addresses there), served by rank 0 and open only to processes that hold the run's secret.

Why not torch's own TCPStore (env://, or TCPStore wrapped in a PrefixStore named by a secret): TCPStore serves every
process that connects, and since torch 2.6 any client may ask it for `list_keys()` — every key, prefix included —
so a classmate on the node reads the prefix, then the ranks' addresses, and can set a rank's address key first or
count itself in (measured here with torch 2.13: `TCPStore(...).list_keys()` from a second client returned
['<secret>/k']). Here instead:

- the launcher makes a secret per run (`new_secret`, 256 bits) and hands it to the ranks in their environment
  (`SCALELAB_RDZV_SECRET`; /proc/<pid>/environ is readable by the process's own account and root only);
- the local launcher and the SPMD pool bind the listening socket themselves (`hold_port`) and pass it to rank 0
  (`SCALELAB_RDZV_FD`, subprocess pass_fds): the port is the run's from the pick until the run ends, with no moment
  in which another process could bind it; on other nodes (srun, a batch job) rank 0 binds MASTER_PORT itself;
- every connection starts with a mutual proof of the secret (HMAC-SHA256 over both sides' fresh nonces): a client
  that cannot prove it is closed before it can read, write, list or wait on anything, and a rank refuses a server
  that cannot prove it (a classmate's listener on the port) instead of trusting its answers;
- the ranks then pass a `RunStore` (`run_store_class()`) to `init_process_group(store=...)`; a process without
  the secret (a user starting `python -m scalelab.train.worker` by hand with MASTER_ADDR/PORT) gets None from
  `join_store` and env:// as before.

The traffic after the proof is not encrypted: on one node only root can read loopback, across nodes the centre's
network must be trusted as it is for the gradients themselves (gloo sends them in the clear).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta

SECRET_VAR = "SCALELAB_RDZV_SECRET"
FD_VAR = "SCALELAB_RDZV_FD"
MAGIC = b"SLRDZV1\n"
HANDSHAKE_S = 5.0  # an unproven connection gets this long to prove the secret, then it is closed
MAX_FRAME = 64 << 20


def new_secret() -> str:
    """A fresh per-run secret (64 hex digits)."""
    return secrets.token_hex(32)


def hold_port(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a free port of `host`, for the launcher to hold and hand to rank 0 (pass_fds)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)  # ranks may connect (and queue) before rank 0 runs; the proof waits for its server
    sock.set_inheritable(True)
    return sock


def _mac(secret: bytes, tag: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, tag + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("rendezvous connection closed")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"rendezvous frame of {n} bytes is over the limit")
    return json.loads(_recv_exact(sock, n))


def _b(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _enc(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _dec(text: str) -> bytes:
    return base64.b64decode(text)


class StoreServer:
    """The store's server in rank 0: a thread accepting on `listener`, one thread per proven connection."""

    def __init__(self, listener: socket.socket, secret: str):
        self.listener, self.secret = listener, secret.encode()
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.refused = 0  # connections closed for not proving the secret (read by tests)
        threading.Thread(target=self._accept, name="scalelab-rdzv", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="scalelab-rdzv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(HANDSHAKE_S)
                nonce = secrets.token_bytes(32)
                conn.sendall(MAGIC + nonce)
                reply = _recv_exact(conn, 64)
                theirs, proof = reply[:32], reply[32:]
                if not hmac.compare_digest(proof, _mac(self.secret, b"client", nonce, theirs)):
                    self.refused += 1
                    return
                conn.sendall(_mac(self.secret, b"server", theirs, nonce))
                conn.settimeout(None)
                while True:
                    _send_frame(conn, self._answer(_recv_frame(conn)))
            except (OSError, ConnectionError, ValueError, struct.error):
                if conn.gettimeout() is not None:
                    self.refused += 1
                return

    def _wait_for(self, keys: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def _answer(self, req: dict) -> dict:
        op, data = req["op"], self.data
        if op in ("get", "wait", "multi_get"):
            keys = req["keys"]
            if not self._wait_for(keys, req["timeout"]):
                return {"ok": False, "error": f"Timed out after {req['timeout']:g} s waiting for keys {keys}"}
            with self.cond:
                return {"ok": True, "values": [_enc(data[k]) for k in keys] if op != "wait" else []}
        with self.cond:
            if op == "set":
                data[req["key"]] = _dec(req["value"])
                result = None
            elif op == "multi_set":
                for k, v in zip(req["keys"], req["values"]):
                    data[k] = _dec(v)
                result = None
            elif op == "append":
                data[req["key"]] = data.get(req["key"], b"") + _dec(req["value"])
                result = None
            elif op == "add":
                result = int(data.get(req["key"], b"0")) + int(req["amount"])
                data[req["key"]] = str(result).encode()
            elif op == "compare_set":
                key, expected, desired = req["key"], _dec(req["expected"]), _dec(req["desired"])
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = current = desired
                result = _enc(current if current is not None else expected)
            elif op == "check":
                result = all(k in data for k in req["keys"])
            elif op == "delete_key":
                result = data.pop(req["key"], None) is not None
            elif op == "num_keys":
                result = len(data)
            else:
                return {"ok": False, "error": f"unknown operation {op!r}"}
            self.cond.notify_all()
        return {"ok": True, "result": result}


class _Client:
    """The methods of `RunStore` (a torch.distributed.Store subclass, made when first asked for: importing this
    module costs no torch import, and the launchers only need `new_secret` and `hold_port`)."""

    def __init__(self, host: str, port: int, secret: str, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.set_timeout(timeout)
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._sock = _connect(host, port, secret.encode(), timeout.total_seconds())

    def _call(self, **req):
        import torch.distributed as dist
        with self._lock:
            _send_frame(self._sock, req)
            reply = _recv_frame(self._sock)
        if not reply["ok"]:
            raise dist.DistStoreError(f"rendezvous store {self.host}:{self.port}: {reply['error']}")
        return reply

    def set_timeout(self, timeout: timedelta) -> None:
        # torch calls it through a PrefixStore (dist.new_group): a Python store must define it, or c10d's trampoline
        # fails with "Not implemented" (checkpoint.mode=sharded's gloo group did)
        self._timeout = timeout

    def _timeout_s(self) -> float:
        return self._timeout.total_seconds()

    def set(self, key, value):
        self._call(op="set", key=key, value=_enc(_b(value)))

    def get(self, key):
        return _dec(self._call(op="get", keys=[key], timeout=self._timeout_s())["values"][0])

    def add(self, key, value):
        return self._call(op="add", key=key, amount=int(value))["result"]

    def compare_set(self, key, expected_value, desired_value):
        return _dec(self._call(op="compare_set", key=key, expected=_enc(_b(expected_value)),
                               desired=_enc(_b(desired_value)))["result"])

    def append(self, key, value):
        self._call(op="append", key=key, value=_enc(_b(value)))

    def multi_get(self, keys):
        return [_dec(v) for v in self._call(op="multi_get", keys=list(keys), timeout=self._timeout_s())["values"]]

    def multi_set(self, keys, values):
        self._call(op="multi_set", keys=list(keys), values=[_enc(_b(v)) for v in values])

    def check(self, keys):
        return self._call(op="check", keys=list(keys))["result"]

    def wait(self, keys, timeout=None):
        t = self._timeout_s() if timeout is None else timeout.total_seconds()
        self._call(op="wait", keys=list(keys), timeout=t)

    def delete_key(self, key):
        return self._call(op="delete_key", key=key)["result"]

    def num_keys(self):
        return self._call(op="num_keys")["result"]


def _connect(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    """A proven connection to the run's store; retried while nothing listens yet (rank 0 still starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(1.0, min(30.0, timeout_s)))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        try:
            hello = _recv_exact(sock, len(MAGIC) + 32)
            if hello[:len(MAGIC)] != MAGIC:
                raise ConnectionError("not a scalelab rendezvous")
            nonce, mine = hello[len(MAGIC):], secrets.token_bytes(32)
            sock.sendall(mine + _mac(secret, b"client", nonce, mine))
            proof = _recv_exact(sock, 32)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise RendezvousRefused(host, port, e) from None
        if not hmac.compare_digest(proof, _mac(secret, b"server", mine, nonce)):
            sock.close()
            raise RendezvousRefused(host, port, "it could not prove the run's secret")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class RendezvousRefused(ConnectionError):
    """The process listening at the run's rendezvous address is not the run's rank 0."""

    def __init__(self, host, port, why):
        super().__init__(f"the rendezvous at {host}:{port} is not this run's ({why}): another process holds the "
                         "port, or rank 0 has another secret; nothing was sent to it")


_RUN_STORE = None


def run_store_class():
    """`RunStore`: a client of the run's store, usable as `init_process_group(store=RunStore(host, port, secret))`."""
    global _RUN_STORE
    if _RUN_STORE is None:
        import torch.distributed as dist
        _RUN_STORE = type("RunStore", (_Client, dist.Store), {"__module__": __name__, "__doc__": _Client.__doc__})
    return _RUN_STORE


def join_store(rank: int, world_size: int, timeout: timedelta, env=None):
    """This rank's `RunStore` when the launcher gave the run a secret (rank 0 also serves it), else None (env://).

    Rank 0 serves on the socket its launcher handed it (SCALELAB_RDZV_FD) or binds MASTER_PORT on every address
    (another node's ranks connect to it); every rank then connects to MASTER_ADDR:MASTER_PORT as a client."""
    env = os.environ if env is None else env
    secret = env.get(SECRET_VAR, "")
    if not secret:
        return None
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "0") or 0)
    if rank == 0:
        fd = env.get(FD_VAR)
        if fd:
            listener = socket.socket(fileno=int(fd))
            os.environ.pop(FD_VAR, None)  # one server per process; a later group reuses this one's store
        else:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("", port))
            except OSError as e:
                listener.close()
                raise RendezvousRefused(host, port, f"rank 0 cannot bind it: {e.strerror}") from None
            listener.listen(128)
        port = listener.getsockname()[1]
        StoreServer(listener, secret)
        host = "127.0.0.1"  # rank 0 reaches its own server on the loopback, whatever MASTER_ADDR names
    store = run_store_class()(host, port, secret, timeout)
    # c10d keeps only the C++ half of a Python store: once the Python object is collected its methods are gone, and
    # the next group made on it (dist.new_group: checkpoint.mode=sharded's gloo group) fails with "Not implemented"
    _LIVE_STORES.append(store)
    return store


_LIVE_STORES: list = []
"""Every store this process joined, kept for the life of the process (see join_store)."""


__all__ = ["SECRET_VAR", "FD_VAR", "new_secret", "hold_port", "StoreServer", "run_store_class", "RendezvousRefused",
           "join_store"]
