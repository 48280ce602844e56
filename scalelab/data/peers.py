"""The peer servers of a data set spread over nodes (scalelab.data.spread): each node serves the shards of its
partition to the other nodes' ranks over TCP, and counts whom it served.

    server = PeerServer(shards=[1, 3], node=1, node_dir="/dev/shm/me/node1", host="10.213.0.12", secret=s).start()
    client = PeerClient("10.213.0.12", server.port, s, me="node1")
    raw = client.read(shard=3, offset=4096, length=1024)
    server.summary()["clients"]          # {"node1@10.213.0.11": {"reads": 1, "bytes": 1024}}

The wire: the client's hello (a length-prefixed JSON object: the secret in hex, its host name), answered b"OK"; then
requests of (shard, offset, length), each answered with a length and the bytes, or a length of 2**64-1 (refused).

Threat model (the peer server listens on a TCP port that every account of the machine, or of the cluster's network,
can reach): a client must first send the run's secret (compared in constant time) or the connection is closed
unanswered, so other accounts cannot read the run's data through it; a request names a shard by number, and only the
shards of the server's own partition are served, within their size, so no path or range outside the partition can be
asked for. Every payload a reader gets is checked against the crc32 in the global index, so a wrong or forged answer
(from a peer, the cache, or a student's read path) is counted as bad, never used silently. Not protected: the bytes on
the wire are not encrypted (a training set is not a secret, and the secret only gates who may ask), and the secret
travels to the ranks in a file only this account can read (the caller makes it so).
"""
from __future__ import annotations

import hmac
import json
import os
import socket
import socketserver
import struct
import threading
from collections import Counter, defaultdict
from pathlib import Path

from ..errors import ScalelabError
from .formats import shard_name

_REQUEST = struct.Struct("!iQQ")  # shard, offset, length
_LENGTH = struct.Struct("!Q")
_REFUSED = (1 << 64) - 1


class PeerError(ScalelabError):
    """A peer server refused a client or a request, or was built without a secret; the message says which."""


class PeerServer:
    """Serves node `node`'s partition from `node_dir` to the other nodes' ranks over TCP, to clients that know the
    secret. `served` counts per client host (as the client names itself) and address (as the socket sees it)."""

    def __init__(self, shards, node: int, node_dir, host: str = "127.0.0.1", secret: bytes = b""):
        if not secret:
            raise PeerError("a peer server needs the run's secret: without one any account could read through it")
        self.node, self.node_dir, self.secret = node, Path(node_dir), secret
        self.shards = set(shards)
        self.sizes = {k: (self.node_dir / shard_name(k)).stat().st_size for k in self.shards}
        self.served = defaultdict(Counter)  # "host@addr" -> {"reads", "bytes"}
        self.refused = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                owner._serve(self.request, self.client_address[0])

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = None

    def start(self) -> "PeerServer":
        """Serve in a background thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name=f"peer-node{self.node}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock, addr: str) -> None:
        hello = _recv_json(sock)
        if not isinstance(hello, dict) or not _same_secret(hello.get("secret"), self.secret):
            with self._lock:
                self.refused += 1
            return  # closed unanswered: a wrong secret learns nothing
        sock.sendall(b"OK")
        who = f"{hello.get('host', '?')}@{addr}"
        files = {}
        try:
            while (req := _recv_exact(sock, _REQUEST.size)) is not None:
                k, offset, length = _REQUEST.unpack(req)
                if k not in self.shards or offset + length > self.sizes[k]:
                    sock.sendall(_LENGTH.pack(_REFUSED))
                    continue
                if k not in files:
                    files[k] = os.open(self.node_dir / shard_name(k), os.O_RDONLY)
                data = os.pread(files[k], length, offset)
                with self._lock:  # counted before the reply: a client holding its answer finds it in the summary
                    self.served[who]["reads"] += 1
                    self.served[who]["bytes"] += len(data)
                sock.sendall(_LENGTH.pack(len(data)) + data)
        finally:
            for fd in files.values():
                os.close(fd)

    def summary(self) -> dict:
        """{"node", "host", "port", "clients": {"host@addr": {"reads", "bytes"}}, "refused"}."""
        with self._lock:
            return {"node": self.node, "host": self.host, "port": self.port, "refused": self.refused,
                    "clients": {w: dict(c) for w, c in sorted(self.served.items())}}


class PeerClient:
    """One connection to a peer node's server (thread-safe: one request at a time)."""

    def __init__(self, addr: str, port: int, secret: bytes, me: str, timeout: float = 30):
        self.sock = socket.create_connection((addr, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_json(self.sock, {"secret": secret.hex(), "host": me})
        if _recv_exact(self.sock, 2) != b"OK":
            raise PeerError(f"the peer server at {addr}:{port} refused this client (wrong secret?)")
        self._lock = threading.Lock()

    def read(self, shard: int, offset: int, length: int) -> bytes:
        """The bytes of one sample from the peer's partition."""
        with self._lock:
            self.sock.sendall(_REQUEST.pack(shard, offset, length))
            (n,) = _LENGTH.unpack(_recv_exact(self.sock, _LENGTH.size) or b"\0" * 8)
            if n == _REFUSED:
                raise PeerError(f"the peer does not hold shard {shard} (offset {offset}, length {length}): the "
                                  "index and the placement disagree")
            return _recv_exact(self.sock, n) or b""

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()


def _same_secret(sent, secret: bytes) -> bool:
    try:
        return hmac.compare_digest(bytes.fromhex(str(sent)[:256]), secret)
    except ValueError:
        return False


def _recv_exact(sock, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _send_json(sock, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_json(sock, limit: int = 4096):
    head = _recv_exact(sock, _LENGTH.size)
    if head is None or _LENGTH.unpack(head)[0] > limit:
        return None
    body = _recv_exact(sock, _LENGTH.unpack(head)[0])
    try:
        return json.loads(body) if body is not None else None
    except ValueError:
        return None


__all__ = ["PeerError", "PeerServer", "PeerClient"]
