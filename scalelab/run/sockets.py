"""Which account owns the other end of a TCP connection on this machine (from /proc/net/tcp and tcp6).

The hub believes forwarding headers only from its own proxy's account (hub/addresses.py); lab 05's storage server
serves only its own account's processes on its node (data/storage_server.py). A connection from another node (a
socket this machine's network namespace does not hold) has no owner here: None.
"""
from __future__ import annotations

import ipaddress


def _proc_hex(ip: str, port: int) -> list[tuple[str, str]]:
    """How an address appears in /proc/net/tcp and tcp6 (each 32-bit word in host byte order): (file, text)."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    found = []
    if isinstance(addr, ipaddress.IPv4Address):
        found.append(("tcp", addr.packed[::-1].hex().upper()))
        mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed)
        packed6 = mapped.packed
    else:
        packed6 = addr.packed
    words = "".join(packed6[i:i + 4][::-1].hex().upper() for i in range(0, 16, 4))
    found.append(("tcp6", words))
    return [(f, f"{text}:{port:04X}") for f, text in found]


def socket_owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the socket on this machine whose own end is `local` and whose other end is `remote`
    (None: no such socket here, or no /proc to ask)."""
    for (kind, mine), (_, theirs) in zip(_proc_hex(*local[:2]), _proc_hex(*remote[:2])):
        try:
            with open(f"/proc/net/{kind}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 7 and parts[1] == mine and parts[2] == theirs:
                        return int(parts[7])
        except (OSError, StopIteration):
            continue
    return None
