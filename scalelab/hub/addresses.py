"""Where a request really comes from: forwarding headers believed only from a proxy the course trusts.

JupyterHub runs its HTTP server with Tornado's `xheaders=True`, so `request.remote_ip` is whatever a client writes
in `X-Real-IP` (or on the left of `X-Forwarded-For`), from anywhere: the sign-in throttle keyed on it could be
made to lock out a classroom's or the instructor's address, or dodged by a new made-up address on every try, and
the log named the made-up one. Here the address is derived from the connection itself:

- the peer of the TCP connection, unless that peer is a trusted proxy (`hub.trusted_proxies`);
- from a trusted proxy, `X-Forwarded-For` read from the right: the entry the proxy appended is the address it saw;
  while that is itself a trusted proxy's (a centre's TLS front end, say), the one before it. `X-Real-IP` is never
  read (the hub's proxy does not set it, so any value in it is the client's own).

`own-proxy` (the default) is the hub's own configurable-http-proxy: a connection from a socket on this machine
that belongs to the hub's own account (found in /proc/net/tcp), not merely one from the loopback, where every
student's server in local mode, and any process of a course account, connects from as well. Other entries are
addresses or networks (`10.0.0.5`, `192.168.1.0/24`, `::1`) whose headers are believed whoever runs there.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable

from ..run.sockets import socket_owner  # noqa: F401  (the hub's tests and own-proxy use it here)

OWN_PROXY = "own-proxy"


def _networks(trusted: Iterable[str]) -> list:
    nets = []
    for entry in trusted:
        if entry != OWN_PROXY:
            nets.append(ipaddress.ip_network(entry, strict=False))
    return nets


def _in(ip: str, nets: list) -> bool:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return any(addr.version == n.version and addr in n for n in nets)


def check_trusted_proxies(trusted: Iterable[str]) -> list[str]:
    """Problems with a `hub.trusted_proxies` list (empty: fine)."""
    problems = []
    for entry in trusted:
        if entry == OWN_PROXY:
            continue
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            problems.append(f"hub.trusted_proxies: {entry!r} is neither {OWN_PROXY!r} nor an address or network")
    return problems


def _ends(request) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """(the peer, our end) of the request's TCP connection: the peer as accepted (Tornado's headers never touch
    it); None where there is no TCP peer (a Unix socket) or our end is gone."""
    conn = getattr(request, "connection", None)
    address = getattr(getattr(conn, "context", None), "address", None)
    peer = tuple(address[:2]) if isinstance(address, tuple) and len(address) >= 2 else None
    sock = getattr(getattr(conn, "stream", None), "socket", None)
    try:
        ours = sock.getsockname()[:2] if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) \
            else None
    except OSError:
        ours = None
    return peer, ours


def peer_is_trusted(peer: tuple[str, int], ours: tuple[str, int] | None, trusted: Iterable[str]) -> bool:
    """Whether the connection's peer is a proxy whose forwarding headers are believed."""
    trusted = list(trusted)
    if _in(peer[0], _networks(trusted)):
        return True
    if OWN_PROXY in trusted and ours is not None:
        return socket_owner(peer, ours) == os.geteuid()
    return False


def client_address(request, trusted: Iterable[str] = (OWN_PROXY,)) -> str:
    """The address a request comes from, believing forwarding headers only from a trusted proxy (see above)."""
    trusted = list(trusted)
    peer, ours = _ends(request)
    if peer is None:  # a Unix socket: only this machine's processes; nothing to tell them apart by
        return "local"
    address = peer[0]
    if not peer_is_trusted(peer, ours, trusted):
        return address
    nets = _networks(trusted)
    hops = ",".join(request.headers.get_list("X-Forwarded-For")).split(",") if request.headers else []
    for hop in reversed([h.strip() for h in hops if h.strip()]):
        try:
            address = str(ipaddress.ip_address(hop.split("%")[0]))
        except ValueError:
            break  # not an address: the last trusted hop is as far as we can tell
        if not _in(address, nets):
            break
    return address


def access_log(trusted: Iterable[str]):
    """JupyterHub's request log (`tornado_settings["log_function"]`) naming each request's real address."""
    from jupyterhub.log import log_request
    trusted = list(trusted)

    def log(handler) -> None:
        try:
            handler.request.remote_ip = client_address(handler.request, trusted)
        except Exception:  # the log line must never fail a request
            pass
        log_request(handler)
    return log


__all__ = ["access_log", "OWN_PROXY", "check_trusted_proxies", "client_address", "peer_is_trusted", "socket_owner"]
