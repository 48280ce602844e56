"""Rank facts, worked out once, whatever started the process.

torchrun and the local launcher set RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/SLURM_NTASKS/
SLURM_LOCALID; mpirun (Open MPI) sets OMPI_COMM_WORLD_*; horovodrun sets HOROVOD_RANK/HOROVOD_SIZE. Outside a
distributed run everything falls back to rank 0 of 1, so the same code runs in a plain `python` too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .machine import usable_cpus

# (rank, world size, local rank, local size) variable names, in order of precedence.
_SOURCES = (
    ("torch", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the run."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    source: str
    """Which launcher's variables these came from (torch, horovod, mpi, slurm, or none)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, which writes shared files and prints."""
        return self.rank == 0


def _int(env, name, default):
    raw = env.get(name, "")
    head = raw.split("(")[0].split(",")[0]  # SLURM_NTASKS_PER_NODE may read "2(x2)"
    try:
        return int(head)
    except ValueError:
        return default


def rank_info(env=None) -> RankInfo:
    """Rank, world size and local rank from the environment; rank 0 of 1 outside a distributed run."""
    env = os.environ if env is None else env
    for source, r, w, lr, ls in _SOURCES:
        if r in env and w in env:
            world = _int(env, w, 1)
            local_size = _int(env, ls, 0) or world
            return RankInfo(_int(env, r, 0), world, _int(env, lr, 0), local_size, source)
    return RankInfo(0, 1, 0, 1, "none")


def get_rank() -> int:
    """This process's rank (0 outside a distributed run)."""
    return rank_info().rank


def threads_per_rank(spec, ranks_on_node: int) -> int:
    """Intra-op threads per rank: the spec's, or this process's usable CPUs shared among the node's ranks."""
    return spec.world.threads_per_worker or max(1, usable_cpus() // ranks_on_node)


def get_world_size() -> int:
    """Ranks in the run (1 outside a distributed run)."""
    return rank_info().world_size


def interface_towards(addr: str) -> str | None:
    """The name of this host's network interface that reaches `addr` (a host name or IP), or None if unknown.

    Asks the kernel's routing table (a UDP socket's connect sends nothing) and maps the chosen source address to
    its interface, so ranks on different nodes each find their own link, whatever it is called there.
    """
    import socket

    import psutil
    try:
        ip = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def set_socket_interface(env=None) -> str | None:
    """Point gloo and NCCL at the interface towards MASTER_ADDR (unless the user chose one); returns it.

    On a node with several links (a management network beside the fast one, or a namespace's eth0 beside lo)
    gloo would otherwise bind to whatever the host name resolves to. A loopback MASTER_ADDR (one node) needs
    nothing.
    """
    env = os.environ if env is None else env
    master = env.get("MASTER_ADDR", "")
    if not master or master.startswith("127.") or master == "localhost":
        return None
    iface = interface_towards(master)
    if iface and iface != "lo":
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
    return env.get("GLOO_SOCKET_IFNAME")
