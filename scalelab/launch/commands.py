"""The launchers' command lines, written once: mpirun's (the mpirun launcher, Horovod inside a Slurm allocation
or batch script, the SPMD pool) and horovodrun's fixed-size local form (the horovodrun launcher, the SPMD pool).

    mpirun_args(4, forward=("MASTER_ADDR", "OMP_NUM_THREADS"), interface="lo", shared_cores=True)
    -> [".../mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none", "--mca", "btl_tcp_if_include", "lo",
        "--mca", "mpi_yield_when_idle", "1", "-x", "MASTER_ADDR", "-x", "OMP_NUM_THREADS"]
"""
from __future__ import annotations

import os

from ..errors import LaunchError
from ..paths import require_tool

RANK_VARS = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PATH", "PYTHONPATH")
"""What an engine rank needs from the launching shell; mpirun passes on only the variables it is told (-x)."""


def mpirun_args(ranks: int, forward=(), *, exe: str | None = None, interface: str | None = None,
                per_node: int | None = None, shared_cores: bool = False, hostfile: str | None = None) -> list[str]:
    """`mpirun -np <ranks> ...` up to the program: never bound to cores (the engine sets its threads itself), root
    allowed when we are root (a container, the CI machine), `forward` passed on with -x.

    exe: the mpirun to run (default: found beside this Python or on PATH; a batch script names plain "mpirun").
    interface: Open MPI's TCP interfaces (btl_tcp_if_include: "lo" on one machine). per_node: --npernode.
    shared_cores: ranks share cores (more ranks than cores on a laptop or CI machine): oversubscribe, and a rank
    waiting in MPI yields the CPU instead of busy-polling (polling slowed its peers' start-up and steps 1.3-2x on
    a 2-core machine). hostfile: --hostfile."""
    cmd = [exe or require_tool("mpirun", LaunchError), "-np", str(ranks)]
    if per_node:
        cmd += ["--npernode", str(per_node)]
    if shared_cores:
        cmd.append("--oversubscribe")
    cmd += ["--bind-to", "none"]
    if interface:
        cmd += ["--mca", "btl_tcp_if_include", interface]
    if shared_cores:
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hostfile:
        cmd += ["--hostfile", hostfile]
    for var in forward:
        cmd += ["-x", var]
    return cmd


def horovodrun_local_args(ranks: int) -> list[str]:
    """`horovodrun -np <ranks> -H localhost:<ranks> --gloo` on this machine's loopback, up to the program."""
    return [require_tool("horovodrun", LaunchError), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
            "--network-interfaces", "lo"]


__all__ = ["RANK_VARS", "horovodrun_local_args", "mpirun_args"]
