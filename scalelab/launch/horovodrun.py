"""horovodrun: Horovod's launcher with its Gloo controller (no MPI needed).

A plain run starts spec.world.workers_per_node ranks on this node, and a failed rank ends the run. With strategy
horovod and world.max_restarts > 0 it is Horovod elastic (train/hvd_elastic.py):

    horovodrun -np 3 --min-np 1 --max-np 3 --host-discovery-script <run dir>/elastic/discover_hosts.sh \\
        --reset-limit 2 --elastic-timeout 60 --gloo-timeout-seconds 10 --gloo --network-interfaces lo python -m ...

The discovery script, written into the run directory, prints one `host:slots` line per host that may run workers;
horovodrun runs it every second, so a host added there gets workers and one that disappears loses them (a host
named in <run dir>/elastic/exclude_hosts is left out: take a host out by hand, or put it back). Horovod blacklists
the whole host of a failed worker, so on one node every slot is a host of its own, each spelled as another form of
127.0.0.1 (127.0.0.01, 127.0.0.001, ...): a single `localhost:3` line would lose all three slots at the first
failure (`blacklisted slots count == 3 -> stop running`). A run over several nodes (world.nodes > 1, inside a Slurm
allocation) lists the allocation's hosts with world.workers_per_node slots each; horovodrun reaches them by ssh.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import time
from pathlib import Path

from ..cluster.slurm import allocation, slurm_command, slurm_env
from ..run.procs import scrub_env
from ..run.combinations import horovod_elastic
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command
from .commands import horovodrun_local_args
from ..errors import LaunchError
from ..paths import require_tool

# horovodrun's gloo driver: "Process 1 exit with status code 1."
_FAILED_RANK = re.compile(r"Process (\d+) exit with status code")

ELASTIC_TIMEOUT_S = 60
"""How long the elastic driver waits for at least world.min_workers slots before it gives the run up."""


class HorovodrunRun(ProcessRun):
    """A horovodrun process and the ranks it started."""

    launcher = "horovodrun"

    def _rank_from_log(self):
        m = _FAILED_RANK.search(self.logs())
        return int(m.group(1)) if m else None


def loopback_hosts(n: int) -> list[str]:
    """`n` distinct names for this machine, as Horovod's driver needs them to tell slots apart: 127.0.0.1,
    127.0.0.01, 127.0.0.001, ... (inet_aton reads each as 127.0.0.1, so no ssh and no /etc/hosts entry)."""
    return [f"127.0.0.{'0' * k}1" for k in range(n)]


def allocation_hosts(env: dict) -> list[str]:
    """The host names of the Slurm allocation this process is inside (`scontrol show hostnames`)."""
    alloc = allocation(env)
    if alloc is None:
        raise LaunchError("world.nodes > 1 with Horovod elastic lists the hosts of a Slurm allocation, but this "
                          "process is not inside one (no SLURM_JOB_ID): run it under salloc/sbatch, or set "
                          "world.nodes=1")
    r = slurm_command(["scontrol", "show", "hostnames", alloc["nodelist"]], slurm_env(env))
    if r.returncode or not r.stdout.split():
        raise LaunchError(f"cannot expand the allocation's node list {alloc['nodelist']!r}: "
                          f"{(r.stderr or r.stdout).strip()}")
    return r.stdout.split()


def discovery_lines(spec, env: dict | None = None) -> list[str]:
    """`host:slots` per host the run may use: one loopback name per slot on one node; the allocation's hosts
    (world.nodes of them, world.workers_per_node slots each) across nodes."""
    w = spec.world
    if w.nodes == 1:
        return [f"{host}:1" for host in loopback_hosts(w.workers_per_node)]
    hosts = allocation_hosts(dict(os.environ if env is None else env))
    if len(hosts) < w.nodes:
        raise LaunchError(f"world.nodes={w.nodes}, but the allocation has {len(hosts)} node(s) ({', '.join(hosts)}): "
                          "lower world.nodes or allocate more nodes")
    return [f"{host}:{w.workers_per_node}" for host in hosts[:w.nodes]]


def discovery_script(lines: list[str], exclude: Path) -> str:
    """The host discovery script's text: print `lines`, less the hosts named (one per line) in `exclude`."""
    return "\n".join([
        "#!/bin/sh",
        "# Horovod elastic host discovery (written by scalelab.launch.horovodrun): one host:slots line per host that",
        "# may run workers; horovodrun runs this every second. Hosts named in the exclude file are left out.",
        f"exclude={shlex.quote(str(exclude))}",
        "while read -r line; do",
        '    if [ -f "$exclude" ] && grep -qxF "${line%%:*}" "$exclude"; then continue; fi',
        '    echo "$line"',
        "done <<'HOSTS'",
        *lines,
        "HOSTS",
        ""])


def write_discovery_script(spec, run_dir: Path, env: dict | None = None) -> Path:
    """Write <run dir>/elastic/discover_hosts.sh (executable) for `spec`; returns its path."""
    folder = run_dir / "elastic"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "discover_hosts.sh"
    script.write_text(discovery_script(discovery_lines(spec, env), folder / "exclude_hosts"))
    script.chmod(0o755)
    return script


def horovodrun_command(spec, run_dir, script: Path | None = None) -> list[str]:
    """`horovodrun -np N -H localhost:N --gloo python -m scalelab.train.worker ...`, or its elastic form
    (`script`: the host discovery script) when the spec asks for Horovod elastic."""
    if script is None:
        return [*horovodrun_local_args(spec.world.workers_per_node), *worker_command(run_dir)]
    exe = require_tool("horovodrun", LaunchError)
    w = spec.world
    cmd = [exe, "-np", str(spec.world_size), "--min-np", str(w.min_workers or 1), "--max-np", str(spec.world_size),
           "--host-discovery-script", str(script), "--reset-limit", str(w.max_restarts),
           "--elastic-timeout", str(ELASTIC_TIMEOUT_S),
           # a survivor whose peer went silent (not closed) gives up after this: the detection time
           "--gloo-timeout-seconds", str(math.ceil(spec.fault.detect_timeout_s)), "--gloo"]
    if w.rejoin_s:  # the failed worker's host may take a worker again after rejoin_s
        cmd += ["--blacklist-cooldown-range", str(w.rejoin_s), str(w.rejoin_s)]
    if w.nodes == 1:
        cmd += ["--network-interfaces", "lo"]
    return cmd + worker_command(run_dir)


def launch(spec, env: dict | None = None) -> HorovodrunRun:
    """Start horovodrun (elastic when the spec asks for it) over Gloo; returns at once."""
    spec, run_dir, reader = prepare_run_dir(spec)
    script = write_discovery_script(spec, run_dir, env) if horovod_elastic(spec) else None
    env = scrub_env(env)
    env["OMP_NUM_THREADS"] = str(threads_for(spec))
    if script is not None:  # this launch's worker claims and fault markers (train/hvd_elastic.py)
        env["SCALELAB_ELASTIC_DIR"] = str(run_dir / "elastic" / f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    proc = start_process(horovodrun_command(spec, run_dir, script), env, run_dir / "logs" / "launcher.log")
    return HorovodrunRun(spec, run_dir, [proc], reader=reader)
