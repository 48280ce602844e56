"""The plumbing of the multi-node local cluster: one Linux bridge, and per node a network namespace joined to it.

    host namespace                node namespaces (one per Slurm node)
    slbr0 10.213.0.1/24  ──veth──  eth0 10.213.0.11/24  (scalelab-node1, hostname node1)
    (slurmctld, munged)  ──veth──  eth0 10.213.0.12/24  (scalelab-node2, hostname node2)

Why it is safe: the addresses are a private range that exists only on links inside this machine; the bridge has no
physical port, the namespaces have no default route and nothing forwards or NATs them, so no packet of a node can
leave the machine. Why `nsenter` and not `ip netns exec`: the latter remounts /sys, and slurmd then fails with "No
filesystem mounted on /sys/fs/cgroup". Each slurmd also gets its own UTS namespace (its hostname) and mount
namespace (a private /etc/hosts naming every node); the mount namespace dies with its last process, so it leaves
no mount behind on the host.

`--link-rate` shapes each node's egress with a token bucket (tc tbf); netem (delay, loss) is not available on every
kernel, so the course only shapes bandwidth. Everything here needs root; `unavailable()` says why it cannot run.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ..errors import ClusterError

BRIDGE = "slbr0"
SUBNET = "10.213.0"  # /24: .1 is the host (slurmctld), node i is .(10 + i)
NS_PREFIX = "scalelab-"
NODE_DEV = "eth0"  # the link's name inside every node, as on a real compute node
NETNS_DIR = Path("/var/run/netns")
MAX_NODES = 64
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$", re.I)
_RATE_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3, "mbps": 8e6,
              "gbps": 8e9}


def host_addr() -> str:
    """The host's (slurmctld's) address on the bridge."""
    return f"{SUBNET}.1"


def node_addr(index: int) -> str:
    """The address of node `index` (1-based)."""
    return f"{SUBNET}.{10 + index}"


def ns_name(node: str) -> str:
    """The network namespace of node `node` (as `ip netns list` shows it)."""
    return NS_PREFIX + node


def host_veth(index: int) -> str:
    """The host end of node `index`'s link (on the bridge); at most 15 characters, as Linux requires."""
    return f"{BRIDGE}n{index}"


def rate_bits(rate: str) -> float:
    """`--link-rate` in bits per second ("1gbit", "100mbit", "500kbps" as tc reads them); ClusterError otherwise."""
    m = _RATE.match(rate.strip())
    if not m or float(m.group(1)) <= 0:
        raise ClusterError(f"--link-rate {rate!r} is not a rate tc understands: give a number and a unit such as "
                           "1gbit, 100mbit or 500kbit (bits per second; kbps/mbps/gbps are bytes per second)")
    return float(m.group(1)) * _RATE_BITS[m.group(2).lower()]


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (not root, no `ip`, no `nsenter`/`unshare`), or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root (you are uid {os.geteuid()})"
    missing = [t for t in ("ip", "tc", "nsenter", "unshare") if not _which(t)]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install iproute2 util-linux)"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if r.returncode == 0 else f"`ip netns add` fails here: {r.stderr.strip()}"


def ensure_bridge(owner: str) -> None:
    """The bridge with the host's address, up (created if missing), labelled with its owner (a state directory)."""
    if _ip("link", "show", BRIDGE, check=False).returncode:
        _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "alias", owner)
    _ip("addr", "replace", f"{host_addr()}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")


def owner() -> str | None:
    """The state directory whose cluster made the bridge (its link alias), or None when there is no bridge."""
    try:
        return Path(f"/sys/class/net/{BRIDGE}/ifalias").read_text().strip() or None
    except OSError:
        return None


def add_node(index: int, node: str, link_rate: str | None = None) -> None:
    """Node `index`'s namespace, its link to the bridge and its address (any stale one is removed first)."""
    remove_node(index, node)
    ns, veth = ns_name(node), host_veth(index)
    _ip("netns", "add", ns)
    _ip("link", "add", veth, "type", "veth", "peer", "name", NODE_DEV, "netns", ns)
    _ip("link", "set", veth, "master", BRIDGE)
    _ip("link", "set", veth, "up")
    _ip("-n", ns, "addr", "add", f"{node_addr(index)}/24", "dev", NODE_DEV)
    _ip("-n", ns, "link", "set", NODE_DEV, "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    if link_rate:
        shape(node, link_rate)


def shape(node: str, rate: str) -> None:
    """Limit node's egress to `rate` with a token bucket: every byte between two nodes leaves one node's eth0."""
    bits = rate_bits(rate)
    # tbf needs a bucket of at least rate/HZ; 10 ms of traffic (>= 64 KiB) keeps fast rates exact.
    burst = max(65536, int(bits / 8 / 100))
    _run(["tc", "-n", ns_name(node), "qdisc", "replace", "dev", NODE_DEV, "root", "tbf", "rate", rate,
          "burst", str(burst), "latency", "100ms"])


def unshape(node: str) -> None:
    """Take the token bucket off node's link (the full speed of a veth again)."""
    _run(["tc", "-n", ns_name(node), "qdisc", "del", "dev", NODE_DEV, "root"], check=False)


def link_rate(node: str) -> str | None:
    """The tbf rate on node's link as tc reports it ("1Gbit"), or None when it is not shaped."""
    r = _run(["tc", "-n", ns_name(node), "qdisc", "show", "dev", NODE_DEV], check=False)
    m = re.search(r"tbf .*?rate (\S+)", r.stdout)
    return m.group(1) if m else None


def node_command(node: str, hosts_file: Path, cmd: list[str]) -> list[str]:
    """`cmd` run inside node's network namespace, with its own hostname and its own /etc/hosts."""
    script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
    return ["nsenter", f"--net={NETNS_DIR / ns_name(node)}", "unshare", "--uts", "--mount", "--propagation",
            "private", "sh", "-c", script, "sh", node, str(hosts_file), *cmd]


def pids(node: str) -> list[int]:
    """Every process living in node's network namespace (slurmd, job steps, ranks)."""
    r = _ip("netns", "pids", ns_name(node), check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def kill_node(node: str, timeout: float = 10) -> None:
    """SIGKILL every process in node's namespace and wait until they are gone (what a crashed node looks like)."""
    deadline = time.monotonic() + timeout
    while True:
        found = pids(node)
        if not found or time.monotonic() > deadline:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove_node(index: int, node: str) -> None:
    """Kill what runs in node's namespace, delete the namespace and its link (nothing if they do not exist)."""
    if (NETNS_DIR / ns_name(node)).exists():
        kill_node(node)
        _ip("netns", "del", ns_name(node), check=False)
    _ip("link", "del", host_veth(index), check=False)  # deleting one end of a veth deletes both


def remove_all() -> None:
    """Every node namespace and link of ours (found by name, so stale ones of an earlier crash too) and the bridge."""
    for ns in namespaces():
        node = ns[len(NS_PREFIX):]
        kill_node(node)
        _ip("netns", "del", ns, check=False)
    for dev in links():
        _ip("link", "del", dev, check=False)


def namespaces() -> list[str]:
    """Our node namespaces that exist now."""
    r = _ip("netns", "list", check=False)
    return sorted(line.split()[0] for line in r.stdout.splitlines()
                  if line.startswith(NS_PREFIX) and not line.startswith(NS_PREFIX + "probe"))


def links() -> list[str]:
    """Our bridge and host-side links that exist now."""
    r = _ip("-o", "link", "show", check=False)
    names = [line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines() if ":" in line]
    return sorted(n for n in names if n == BRIDGE or re.fullmatch(rf"{BRIDGE}n\d+", n))


def mounts() -> list[str]:
    """Mount points on the host that belong to our namespaces (`ip netns add` bind-mounts one per namespace)."""
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if f"{NETNS_DIR}/{NS_PREFIX}" in line.split()[1]
                or f"/run/netns/{NS_PREFIX}" in line.split()[1]]


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run([_which("ip") or "ip", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise ClusterError(f"{cmd[0]} not found; run `apt-get install iproute2`") from None
    if check and r.returncode:
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


__all__ = ["BRIDGE", "SUBNET", "NODE_DEV", "host_addr", "node_addr", "ns_name", "rate_bits", "unavailable",
           "ensure_bridge", "owner", "add_node", "shape", "unshape", "link_rate", "node_command", "pids", "kill_node", "remove_node",
           "remove_all", "namespaces", "links", "mounts"]
