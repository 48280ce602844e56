"""srun: the run as job steps inside the allocation the caller already holds — no new job.

Where it applies: a JupyterLab that the hub started in a 2-node job, a shell from `salloc -N2`, an sbatch script
that calls `scalelab run`. There SLURM_JOB_ID is set, and `launcher=slurm` comes here by itself (see
`scalelab.launch.slurm.launch`); `launcher=srun` asks for it by name and fails when there is no allocation. To
submit a new job from inside one anyway, hand the launcher an environment without SLURM_JOB_ID
(`launch(spec, env=scrub_env())`).

DDP: one `srun` step starts every rank (`--kill-on-bad-exit`: one failed rank ends the step). Horovod: Open MPI's
`mpirun` reads the allocation and starts its daemons on the nodes through srun. `--overlap` (SLURM_OVERLAP for
mpirun's own steps) lets the steps share CPUs with the step that holds JupyterLab. MASTER_ADDR is the
allocation's first node; each rank finds the interface towards it on its own node (`scalelab.dist`).
"""
from __future__ import annotations

import os
import random
import re
import shlex

from ..cluster.slurm import allocation, slurm_command, unreachable_nodes
from ..errors import LaunchError
from ..paths import require_tool
from ..run.procs import DISTRIBUTED_PREFIXES, DISTRIBUTED_VARS
from ..run.rendezvous import SECRET_VAR, new_secret
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command
from .commands import RANK_VARS, mpirun_args

# srun: "srun: error: node2: task 1: Exited with exit code 1"; Open MPI: "process rank 1 with PID"
_FAILED = re.compile(r"(?:(\S+): )?task (\d+): (?:Exited|Killed|Terminated|Segmentation)|process rank (\d+) with PID")
# What a step of the enclosing job (JupyterLab started with srun) set for itself; the new step gets its own.
_STEP_VARS = re.compile(r"^SLURM_(STEP_\w+|STEPID|PROCID|LOCALID|NODEID|TASK_PID|CPU_BIND\w*|PRIO_PROCESS|"
                        r"UMASK|SRUN_COMM_\w+|LAUNCH_NODE_IPADDR|GTIDS|DISTRIBUTION)$")


def check_fits(spec, alloc: dict) -> None:
    """LaunchError naming what the allocation has when the spec asks for more nodes or ranks than it holds."""
    w = spec.world
    has = (f"the allocation you are in (job {alloc['job_id']}: {alloc['nodes']} node(s) {alloc['nodelist']}, "
           f"CPUs per node {alloc['cpus_per_node']})")
    if w.nodes > alloc["nodes"]:
        raise LaunchError(f"world.nodes={w.nodes} asks for more nodes than {has}: set world.nodes <= "
                          f"{alloc['nodes']}, or ask for a bigger allocation (salloc -N {w.nodes}, or the hub's "
                          "multi-node profile)")
    smallest = min(alloc["cpus_per_node"][:w.nodes])
    if w.workers_per_node > smallest:
        raise LaunchError(f"world.workers_per_node={w.workers_per_node} asks for more ranks per node than {has} "
                          f"can place (one CPU each, {smallest} on its smallest node): set world.workers_per_node "
                          f"<= {smallest}, or ask for more CPUs per node (salloc --ntasks-per-node)")


def step_env(env: dict | None = None) -> dict:
    """The caller's environment for a new step: the job's SLURM_* kept, the enclosing step's and run's dropped."""
    env = dict(os.environ if env is None else env)
    for key in list(env):
        if _STEP_VARS.match(key) or key in DISTRIBUTED_VARS or \
                (key.startswith(DISTRIBUTED_PREFIXES) and not key.startswith("SLURM_")):
            del env[key]
    env["SLURM_OVERLAP"] = "1"  # steps may share CPUs with the step that runs JupyterLab (srun reads this)
    # a job submitted with --export=A,B (the hub's) hands that list to every srun inside it: the ranks would
    # then miss MASTER_ADDR and the rest; the steps get the whole environment given here
    env["SLURM_EXPORT_ENV"] = "ALL"
    return env


def first_node(alloc: dict, env: dict) -> str:
    """The allocation's first host name (`scontrol show hostnames` expands node[1-2])."""
    r = slurm_command(["scontrol", "show", "hostnames", alloc["nodelist"]], env)
    names = r.stdout.split()
    if r.returncode or not names:
        raise LaunchError(f"cannot expand the allocation's node list {alloc['nodelist']!r}: "
                          f"{(r.stderr or r.stdout).strip()}")
    return names[0]


def step_command(spec, run_dir, python: str | None = None) -> list[str]:
    """The command that starts every rank as steps of the allocation."""
    w = spec.world
    worker = worker_command(run_dir, python)
    if spec.strategy == "horovod":
        return mpirun_args(spec.world_size, RANK_VARS, per_node=w.workers_per_node) + worker
    return [require_tool("srun", LaunchError), f"--nodes={w.nodes}", f"--ntasks={spec.world_size}",
            f"--ntasks-per-node={w.workers_per_node}", "--overlap", "--export=ALL", "--kill-on-bad-exit=1",
            "--cpu-bind=none",
            f"--job-name=scalelab-{spec.name}", *worker]


class WatchesNodes:
    """For runs whose ranks live on other nodes, where no process of theirs can be watched from here: once a peer
    reports that a rank went away, ask whether that rank's node is still there, and name the node and rank."""

    env: dict
    lost_nodes: list[str] = []
    """Nodes found gone when a peer reported a vanished rank."""

    def _vanished_rank(self):
        found = super()._vanished_rank()
        if found or not self._first_error_event(primary=False) or self._node_checked:
            return found
        self._node_checked = True  # one look per run: a peer's error is what we wait for, not a poll loop
        ended = {e["rank"] for e in self._reader.all if e["type"] in ("end", "error")}
        hosts = {e["rank"]: e.get("host") for e in self._reader.all if e["type"] == "start" and e["rank"] not in ended}
        lost = unreachable_nodes(sorted({h for h in hosts.values() if h}), self.env)
        self.lost_nodes = sorted(lost)
        for rank, host in sorted(hosts.items()):
            if host in lost:
                return (f"node {host} was lost ({lost[host]}): rank {rank} on it ended without a word; the other "
                        f"ranks saw their peer vanish. `scontrol show node {host}` shows it down once slurmctld "
                        "notices; `scalelab cluster up --nodes N` brings a local node back"), rank
        return None


class SrunRun(WatchesNodes, ProcessRun):
    """Job steps in the caller's allocation, started by one srun (or mpirun) process of ours."""

    launcher = "srun"
    _node_checked = False

    def _rank_from_log(self):
        m = _FAILED.search(self.logs())
        return int(m.group(2) or m.group(3)) if m else None


def launch(spec, env: dict | None = None, python: str | None = None) -> SrunRun:
    """Start the ranks as steps of the allocation in `env` (default: this process's); LaunchError outside one."""
    alloc = allocation(env)
    if alloc is None:
        raise LaunchError("launcher srun runs steps inside a Slurm allocation, but SLURM_JOB_ID is not set: start "
                          "from `salloc`, an sbatch script or the hub's multi-node profile, or use launcher=slurm "
                          "(a new batch job)")
    check_fits(spec, alloc)
    spec, run_dir, reader = prepare_run_dir(spec)
    env = step_env(env)
    env.update(MASTER_ADDR=first_node(alloc, env), MASTER_PORT=str(random.randint(20000, 39999)),
               OMP_NUM_THREADS=str(spec.world.threads_per_worker or threads_for(spec)))
    if spec.strategy != "horovod":  # DDP's ranks meet at rank 0's own store, open only to holders of this secret
        env[SECRET_VAR] = new_secret()
    env.setdefault("PYTHONPATH", "")
    cmd = step_command(spec, run_dir, python)
    (run_dir / "logs" / "launcher.log").write_text(f"# job {alloc['job_id']}: {shlex.join(cmd)}\n")
    proc = start_process(cmd, env, run_dir / "logs" / "launcher.log")
    run = SrunRun(spec, run_dir, [proc], reader=reader)
    run.env = env
    return run


__all__ = ["allocation", "check_fits", "step_env", "step_command", "launch", "SrunRun", "WatchesNodes"]
