"""The one Slurm client: which cluster a command talks to, running a command, and what a job state means.

Every part that talks to Slurm (the slurm launcher, job chains, the hub's spawner, the test hub) reads job states
through `job_phase`, so they agree on when a job is still queued, running, on its way out, or gone.

    env = slurm_env()                                    # SLURM_CONF as set, /etc/slurm, or the local cluster's
    r = slurm_command(["sbatch", "--parsable", "job.sh"], env)
    job_phase(job_fields("123", env).get("JobState", ""))   # 'pending' | 'running' | 'held' | 'completing' | 'ended'
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

from ..errors import LaunchError
from ..paths import INSTALL_HINTS

# Slurm's JobState values by what they mean for whoever waits on the job (squeue -t all, scontrol show job).
PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
                            "RESIZING"})
RUNNING_STATES = frozenset({"RUNNING"})
# Still there, neither started nor gone: the job's processes may not run (SUSPENDED, STOPPED) or are signalled.
HELD_STATES = frozenset({"SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})
COMPLETING_STATES = frozenset({"COMPLETING"})
# Anything else (COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, BOOT_FAIL,
# DEADLINE, '' once Slurm has forgotten the job) has ended.


def job_phase(state: str) -> str:
    """'pending', 'running', 'held', 'completing' or 'ended' for a JobState ('CANCELLED by 0' counts as CANCELLED)."""
    state = state.split()[0] if state else ""
    for phase, states in (("pending", PENDING_STATES), ("running", RUNNING_STATES), ("held", HELD_STATES),
                          ("completing", COMPLETING_STATES)):
        if state in states:
            return phase
    return "ended"


def job_active(state: str) -> bool:
    """True while a job still holds (or waits for) resources: anything but ended."""
    return job_phase(state) != "ended"


def slurm_env(base: dict | None = None) -> dict:
    """The environment for Slurm client commands: SLURM_CONF as set, /etc/slurm, or the local cluster's."""
    env = dict(os.environ if base is None else base)
    if env.get("SLURM_CONF") or Path("/etc/slurm/slurm.conf").exists():
        return env
    from .local import LocalCluster
    cluster = LocalCluster()
    if cluster.conf_path.exists():
        env.update(cluster.env())
        return env
    raise LaunchError("no Slurm cluster configured: set SLURM_CONF to your cluster's slurm.conf, or start the "
                      "local one with `scalelab cluster up`")


def slurm_command(cmd: list[str], env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a Slurm client command (its exit status is the caller's to judge); LaunchError when it is missing or
    does not answer."""
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LaunchError(f"{cmd[0]} not found; install the Slurm client: {INSTALL_HINTS['sbatch']}") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{' '.join(cmd)}` did not answer within {timeout:g} s: is slurmctld up?") from None


def job_fields(job_id: str, env: dict) -> dict:
    """`scontrol show job` fields (JobState, Reason, ExitCode, NodeList, ...); {} once Slurm has forgotten the job."""
    r = slurm_command(["scontrol", "show", "job", "-o", job_id], env)
    if r.returncode:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def unreachable_nodes(nodes: list[str], env: dict, timeout: float = 2.0) -> dict[str, str]:
    """Those of `nodes` whose slurmd does not answer (crashed, or its host gone): {node: what was seen}.

    A TCP connect to the node's slurmd port (its NodeAddr, SlurmdPort): a dead slurmd refuses at once, a dead host
    times out. slurmctld would say the same only after SlurmdTimeout; a run wants to name the node now.
    """
    if not nodes:
        return {}
    conf = slurm_command(["scontrol", "show", "config"], env).stdout
    m = re.search(r"^SlurmdPort\s*=\s*(\d+)", conf, re.M)
    port = int(m.group(1)) if m else 6818
    found = {}
    for node in nodes:
        r = slurm_command(["scontrol", "show", "node", "-o", node], env)
        addr = (re.search(r"NodeAddr=(\S+)", r.stdout) or [None, node])[1]
        try:
            with socket.create_connection((addr, port), timeout=timeout):
                pass
        except OSError as e:
            found[node] = f"its slurmd at {addr}:{port} does not answer ({e.strerror or e})"
    return found


def allocation(env: dict | None = None) -> dict | None:
    """The allocation this process is inside: {"job_id", "nodes", "nodelist", "cpus_per_node"}; None outside one."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return {"job_id": job, "nodes": nodes, "nodelist": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""),
            "cpus_per_node": _per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""), nodes)}


def _per_node(text: str, nodes: int) -> list[int]:
    """"2(x2),1" -> [2, 2, 1]: Slurm's compressed per-node counts."""
    counts = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts or [1] * nodes


_QUEUE_FORMAT = "%i|%u|%j|%T|%D|%N|%r|%M"  # job id, user, name, state, nodes, node list, reason, time used
_QUEUE_KEYS = ("job_id", "user", "name", "state", "nodes", "nodelist", "reason", "time")


def snapshot(env: dict | None = None, user: str | None = None) -> dict:
    """What a student wants to see of the cluster, from any Slurm: {"conf", "nodes", "partitions", "queue", "mine",
    "allocation", "error"}; `error` says what failed (the rest then stays empty) instead of raising."""
    import getpass

    from .conf import parse_scontrol, summarise
    base = dict(os.environ if env is None else env)
    user = user or getpass.getuser()
    result = {"conf": base.get("SLURM_CONF", "/etc/slurm/slurm.conf"), "nodes": [], "partitions": [], "queue": [],
              "mine": [], "allocation": allocation(base), "error": None}
    try:
        env = slurm_env(base)
        result["conf"] = env.get("SLURM_CONF", result["conf"])
        nodes = slurm_command(["scontrol", "show", "node", "-o"], env, timeout=15)
        parts = slurm_command(["scontrol", "show", "partition", "-o"], env, timeout=15)
        queue = slurm_command(["squeue", "-h", "-o", _QUEUE_FORMAT], env, timeout=15)
    except LaunchError as e:
        return {**result, "error": str(e)}
    failed = next((r for r in (nodes, parts, queue) if r.returncode), None)
    if failed is not None:
        return {**result, "error": f"`{' '.join(failed.args)}` failed: {(failed.stderr or failed.stdout).strip()}"}
    raw_nodes = parse_scontrol(nodes.stdout, "NodeName")
    summary = summarise(raw_nodes, parse_scontrol(parts.stdout, "PartitionName"))
    for node, raw in zip(summary["nodes"], raw_nodes):
        node["addr"] = raw.get("NodeAddr")
    jobs = [dict(zip(_QUEUE_KEYS, line.split("|"))) for line in queue.stdout.splitlines() if line.count("|") == 7]
    return {**result, "nodes": summary["nodes"], "partitions": summary["partitions"], "queue": jobs,
            "mine": [j for j in jobs if j["user"] == user]}


__all__ = ["allocation", "snapshot", "unreachable_nodes", "job_phase", "job_active", "slurm_env", "slurm_command", "job_fields", "PENDING_STATES",
           "RUNNING_STATES", "HELD_STATES", "COMPLETING_STATES"]
