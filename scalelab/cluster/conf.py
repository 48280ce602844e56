"""What the local Slurm is made of: this machine's shape, the slurm.conf / gres.conf text for it, and the reading of
`scontrol show ... -o` output (pure functions).

`scalelab.cluster.local` runs the daemons; this module only looks at the machine and turns text into text, so every choice
in the configuration, and every reading of Slurm's answers, can be tested as text on any machine.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..machine import count_gpus, gpu_device_files, memory_bytes, usable_cpus
from .accounting import slurm_conf_lines

CTLD_PORT = 6817
SLURMD_PORT = 6818
#: Jobs that may share one core (see OVERSUBSCRIBE comment in slurm_conf_text).
OVERSUBSCRIBE = 8
#: The longest job a partition takes (a centre's partitions have a MaxTime too): the hub's profiles ask for 2 h at
#: most; a student's own sbatch for longer is refused at submission (EnforcePartLimits), not left running for ever.
MAX_TIME = "12:00:00"


@dataclass(frozen=True)
class Machine:
    """The shape of this machine as Slurm will see it."""

    hostname: str
    """Short host name: NodeName and SlurmctldHost."""
    node_addr: str | None
    """Address to reach the node by when `hostname` does not resolve (else None)."""
    cpus: int
    """Logical CPUs (slurmd -C)."""
    sockets: int
    """Sockets per board (slurmd -C)."""
    cores_per_socket: int
    """Cores per socket (slurmd -C)."""
    threads_per_core: int
    """Hardware threads per core (slurmd -C)."""
    memory_mb: int
    """Physical memory in MB, before headroom (slurmd -C)."""
    gpus: int
    """NVIDIA GPUs found (nvidia-smi -L, or /dev/nvidiaN)."""
    gpu_files: tuple[str, ...] = ()
    """The /dev/nvidiaN device files of those GPUs, when they are visible."""


def memory_headroom_mb(memory_mb: int) -> int:
    """Memory kept back from Slurm for the OS, the daemons and the hub: 10 %, at least 512 MB, at most 8 GiB."""
    return max(512, min(8192, memory_mb // 10))


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def _slurmd_shape() -> dict[str, int]:
    """What `slurmd -C` reports (the shape slurmd registers with), or {} when it cannot say."""
    slurmd = shutil.which("slurmd") or "/usr/sbin/slurmd"
    try:
        out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", out.splitlines()[0] if out else "")}


def detect_machine() -> Machine:
    """This machine's host name, CPU topology, memory and GPUs, as slurmd will report them at registration."""
    host = socket.gethostname().split(".")[0]
    shape = _slurmd_shape()
    cpus = shape.get("CPUs") or usable_cpus()
    sockets = shape.get("SocketsPerBoard", 1) * shape.get("Boards", 1)
    memory = shape.get("RealMemory") or memory_bytes() // 2**20
    return Machine(hostname=host, node_addr=None if _resolves(host) else "127.0.0.1", cpus=cpus,
                   sockets=sockets if shape else 1, cores_per_socket=shape.get("CoresPerSocket", cpus),
                   threads_per_core=shape.get("ThreadsPerCore", 1), memory_mb=memory, gpus=count_gpus(),
                   gpu_files=gpu_device_files())


@dataclass(frozen=True)
class StatePaths:
    """Where every file of a local cluster lives: all under one state directory."""

    root: Path

    def __getattr__(self, name: str) -> Path:
        try:
            return self.root / _LAYOUT[name]
        except KeyError:
            raise AttributeError(name) from None


_LAYOUT = {
    "conf": "slurm.conf", "gres_conf": "gres.conf", "lock": "cluster.lock",
    "log_dir": "log", "run_dir": "run", "ctld_state": "ctld", "slurmd_spool": "spool",
    "munge_dir": "munge", "munge_key": "munge/munge.key", "munge_socket": "munge/munge.socket",
    "munge_seed": "munge/munged.seed", "munge_pid": "run/munged.pid", "munge_log": "log/munged.log",
    "ctld_pid": "run/slurmctld.pid", "ctld_log": "log/slurmctld.log",
    "slurmd_pid": "run/slurmd.pid", "slurmd_log": "log/slurmd.log", "jobcomp_log": "log/jobcomp.txt",
    "epilog": "epilog.sh", "task_prolog": "task-prolog.sh",
    # accounting (scalelab.cluster.accounting): slurmdbd.conf beside slurm.conf; the database root's alone (0700)
    "dbd_conf": "slurmdbd.conf", "db_dir": "db", "db_data": "db/data", "db_socket": "db/mysqld.sock",
    "db_pid": "db/mariadbd.pid", "db_log": "db/mariadbd.log", "dbd_pid": "db/slurmdbd.pid", "dbd_log": "db/slurmdbd.log",
}


def slurm_conf_text(*, cluster_name: str, node_name: str, cpus: int, real_memory_mb: int, gpus: int,
                    state_dir: str | os.PathLike, node_addr: str | None = None, sockets: int | None = None,
                    cores_per_socket: int | None = None, threads_per_core: int = 1,
                    oversubscribe: int = OVERSUBSCRIBE, ctld_port: int = CTLD_PORT,
                    slurmd_port: int = SLURMD_PORT, dbd_port: int | None = None) -> str:
    """slurm.conf for a one-node cluster on a machine with `real_memory_mb` of memory; all paths under `state_dir`.
    `dbd_port`: accounting in our slurmdbd on that port (`scalelab.cluster.accounting`); None: no accounting."""
    p = StatePaths(Path(state_dir))
    memory = real_memory_mb - memory_headroom_mb(real_memory_mb)
    if sockets is None or cores_per_socket is None:
        sockets, cores_per_socket, threads_per_core = 1, max(1, cpus // threads_per_core), threads_per_core
    # Memory is scheduled (CR_Core_Memory), so a job that asks for none gets DefMemPerCPU: the node's memory shared
    # evenly over every core *and* every oversubscription slot, so the slots never run out of memory first.
    cores = sockets * cores_per_socket
    def_mem = max(100, memory // (cores * oversubscribe))
    node = (f"NodeName={node_name}" + (f" NodeAddr={node_addr}" if node_addr else "")
            + f" CPUs={cpus} Sockets={sockets} CoresPerSocket={cores_per_socket} ThreadsPerCore={threads_per_core}"
            + f" RealMemory={memory}" + (f" Gres=gpu:{gpus}" if gpus else "") + " State=UNKNOWN")
    lines = ["# Written by scalelab for a single-node development cluster; regenerated by `scalelab cluster up`.",
             f"ClusterName={cluster_name}",
             f"SlurmctldHost={node_name}" + (f"({node_addr})" if node_addr else ""),
             *_daemon_lines(p, ctld_port=ctld_port, slurmd_port=slurmd_port, slurmd_pid=p.slurmd_pid,
                            slurmd_log=p.slurmd_log, slurmd_spool=p.slurmd_spool, def_mem=def_mem,
                            slurmd_timeout=60, dbd_port=dbd_port, gpus=gpus)]
    return "\n".join(lines + _node_and_partition_lines([node], node_name, gpus, oversubscribe)
                     + [grading_partition_line(node_name, oversubscribe)]) + "\n"


GRADING_PARTITION = "grading"
"""Where `scalelab grade --slurm` sends its jobs on the 1-node local cluster."""


def grading_partition_line(nodes: str, oversubscribe: int = OVERSUBSCRIBE) -> str:
    """The grading partition: on the same node as the hub's, never the default, open to root only (grading jobs run
    as root, which the sandbox needs to switch to its throwaway uid; a student's sbatch there is refused)."""
    return (f"PartitionName={GRADING_PARTITION} Nodes={nodes} Default=NO MaxTime={MAX_TIME} State=UP"
            f" OverSubscribe=FORCE:{oversubscribe} AllowGroups=root")


def multinode_conf_text(*, cluster_name: str, ctld_host: str, ctld_addr: str, nodes: list[tuple[str, str]],
                        cpus: int, real_memory_mb: int, gpus: int, state_dir: str | os.PathLike,
                        sockets: int | None = None, cores_per_socket: int | None = None, threads_per_core: int = 1,
                        oversubscribe: int = OVERSUBSCRIBE, ctld_port: int = CTLD_PORT,
                        slurmd_port: int = SLURMD_PORT) -> str:
    """slurm.conf for N nodes on this one machine: `nodes` are (name, address) pairs, each node a network
    namespace (see `scalelab.cluster.netns`) that sees the machine's `cpus` and an equal share of its memory."""
    p = StatePaths(Path(state_dir))
    memory = (real_memory_mb - memory_headroom_mb(real_memory_mb)) // max(1, len(nodes))
    if sockets is None or cores_per_socket is None:
        sockets, cores_per_socket, threads_per_core = 1, max(1, cpus // threads_per_core), threads_per_core
    def_mem = max(100, memory // (sockets * cores_per_socket * oversubscribe))
    shape = (f"CPUs={cpus} Sockets={sockets} CoresPerSocket={cores_per_socket} ThreadsPerCore={threads_per_core}"
             f" RealMemory={memory}" + (f" Gres=gpu:{gpus}" if gpus else "") + " State=UNKNOWN")
    # NodeAddr: slurmctld and srun on the host reach each node by its bridge address; NodeHostname is what the
    # node calls itself (its own UTS namespace), so slurmd -N finds its line.
    node_lines = [f"NodeName={name} NodeAddr={addr} NodeHostname={name} {shape}" for name, addr in nodes]
    names = ",".join(name for name, _ in nodes)
    lines = [f"# Written by scalelab for a {len(nodes)}-node cluster in network namespaces on this machine; "
             "regenerated by `scalelab cluster up --nodes N`.",
             f"ClusterName={cluster_name}",
             f"SlurmctldHost={ctld_host}({ctld_addr})",
             # %n: every slurmd is the same program on the same file system, so each keeps its own files.
             *_daemon_lines(p, ctld_port=ctld_port, slurmd_port=slurmd_port,
                            slurmd_pid=p.run_dir / "slurmd-%n.pid", slurmd_log=p.log_dir / "slurmd-%n.log",
                            slurmd_spool=p.slurmd_spool / "%n", def_mem=def_mem,
                            # a lost node (its slurmd killed) shows DOWN within ~20 s, not the usual minutes
                            slurmd_timeout=15)]
    return "\n".join(lines + _node_and_partition_lines(node_lines, names, gpus, oversubscribe)) + "\n"


def _node_and_partition_lines(node_lines: list[str], names: str, gpus: int, oversubscribe: int) -> list[str]:
    lines = ["GresTypes=gpu"] if gpus else []
    lines += ["", *node_lines, "",
              f"PartitionName=cpu Nodes={names} Default=YES MaxTime={MAX_TIME} State=UP"
              f" OverSubscribe=FORCE:{oversubscribe}"]
    if gpus:
        lines.append(f"PartitionName=gpu Nodes={names} Default=NO MaxTime={MAX_TIME} State=UP"
                     f" OverSubscribe=FORCE:{oversubscribe}")
    return lines


def _daemon_lines(p: StatePaths, *, ctld_port: int, slurmd_port: int, slurmd_pid: Path, slurmd_log: Path,
                  slurmd_spool: Path, def_mem: int, slurmd_timeout: int, dbd_port: int | None = None,
                  gpus: int = 0) -> list[str]:
    """What every local cluster's slurm.conf says about its daemons, scheduling and accounting."""
    return [
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # Our own munged, with its own key and socket: clients read this line, so they need only SLURM_CONF.
        f"AuthInfo=socket={p.munge_socket}",
        f"StateSaveLocation={p.ctld_state}",
        f"SlurmdSpoolDir={slurmd_spool}",
        f"SlurmctldPidFile={p.ctld_pid}",
        f"SlurmdPidFile={slurmd_pid}",
        f"SlurmctldLogFile={p.ctld_log}",
        f"SlurmdLogFile={slurmd_log}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # Students share this cluster: each sees only their own jobs, usage and user (what squeue and scontrol
        # show), not a classmate's job names, nodes and start times to aim at. Root and SlurmUser see everything.
        "PrivateData=jobs,usage,users",
        # No cgroups in containers and laptops: processes are tracked through /proc, tasks are not bound.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        # What cgroups do at a centre, done by two scripts (scalelab/cluster/job_end.py): the Epilog ends what a
        # course account's job left running (a daemonised process survives scancel under linuxproc), the
        # TaskProlog hides the GPUs from a job or step that asked for none.
        f"Epilog={p.epilog}",
        f"TaskProlog={p.task_prolog}",
        "MpiDefault=none",
        "SwitchType=switch/none",
        # Cores and memory are the consumable resources. CPUs are NOT over-reported: the partition oversubscribes
        # each core FORCE:N ways instead (no gang scheduling, PreemptMode=OFF), so jobs really share the cores.
        # With N=8 a 2-core laptop runs 16 one-CPU jobs at once (the hub benchmark's 10 single-user servers, a
        # 2-task training job beside them) while `scontrol show node` still tells the truth about the hardware.
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        f"DefMemPerCPU={def_mem}",
        "PreemptMode=OFF",
        # A job over a partition's limits (MaxTime above all) is refused when it is submitted, with the reason,
        # instead of pending for ever.
        "EnforcePartLimits=ALL",
        # With dbd_port, our slurmdbd holds associations and the student QOS (accounting.slurm_conf_lines); without
        # (the N-node cluster), `sacct` does not work and no per-user limit holds. Either way finished jobs stay in
        # `scontrol show job` for MinJobAge seconds, and every finished job gets one line (with its exit code) in
        # the jobcomp file after that (0600, root's: every classmate's jobs are in it; LocalCluster._seal_accounting).
        *(slurm_conf_lines(dbd_port, gpus, p.munge_socket) if dbd_port else ["AccountingStorageType=accounting_storage/none"]),
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={p.jobcomp_log}",
        "MinJobAge=600",
        # Tests and the hub want jobs to start within a second or two, not at the next 60 s scheduling pass.
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=2,batch_sched_delay=0,sched_min_interval=100000",
        "MessageTimeout=10",
        f"SlurmdTimeout={slurmd_timeout}",
        "SlurmctldTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        # A step whose processes are not gone this long after SIGKILL drains the node ("Kill task failed"): the
        # default 60 s is too short for a 2-core machine under a whole test suite's load, and one drained node
        # holds every later job of the course.
        "UnkillableStepTimeout=180",
        "WaitTime=0",
        # A node that was down when the daemons stopped comes back as soon as its slurmd registers again.
        "ReturnToService=2",
    ]


def hosts_text(ctld_host: str, ctld_addr: str, nodes: list[tuple[str, str]]) -> str:
    """The /etc/hosts every node sees (bind-mounted in its own mount namespace): so node names resolve there."""
    lines = ["# Written by scalelab: the hosts of the local multi-node cluster.", "127.0.0.1 localhost",
             f"{ctld_addr} {ctld_host}"]
    return "\n".join(lines + [f"{addr} {name}" for name, addr in nodes]) + "\n"


def gres_conf_text(*, node_name: str, gpus: int, files: tuple[str, ...] | list[str] = ()) -> str:
    """gres.conf for the node's GPUs: their device files when known (slurmd checks them), else a bare count."""
    if not gpus:
        return ""
    where = f"File={','.join(files)}" if len(files) == gpus else f"Count={gpus}"
    return f"# Written by scalelab.\nNodeName={node_name} Name=gpu {where}\n"


_USABLE = {"IDLE", "MIXED", "ALLOCATED", "COMPLETING", "PLANNED"}
_UNUSABLE_FLAGS = {"DRAIN", "DRAINED", "DRAINING", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "POWERING_DOWN",
                   "POWER_DOWN", "INVALID_REG", "REBOOT_REQUESTED"}


def parse_scontrol(text: str, key: str) -> list[dict[str, str]]:
    """The records of `scontrol show <thing> -o` whose first field is `key` (values may contain spaces)."""
    pattern = re.compile(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)")
    return [dict(pattern.findall(line.strip())) for line in text.splitlines() if line.startswith(f"{key}=")]


def node_usable(state: str) -> bool:
    """Whether a node in scontrol State `state` (e.g. "MIXED", "IDLE+DRAIN", "DOWN*") can start jobs."""
    base, *flags = state.upper().split("+")
    return not base.endswith("*") and base.rstrip("~#!%$@^-") in _USABLE and not _UNUSABLE_FLAGS & set(flags)


def _gpus(tres: str, gres: str = "") -> int:
    """GPUs in a TRES list ("cpu=2,gres/gpu=2"), else in a Gres field ("gpu:2"): without slurmdbd GPUs are no TRES."""
    m = re.search(r"gres/gpu=(\d+)", tres or "") or re.search(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres or "")
    return int(m.group(1)) if m else 0


def summarise(nodes: list[dict[str, str]], partitions: list[dict[str, str]]) -> dict:
    """The "up", "nodes" and "partitions" of `LocalCluster.status()`, from parsed scontrol records."""
    return {
        "up": bool(nodes) and all(node_usable(n.get("State", "")) for n in nodes),
        "nodes": [{"name": n.get("NodeName"), "state": n.get("State", "").lower(), "cpus": int(n.get("CPUTot", 0)),
                   "cpus_alloc": int(n.get("CPUAlloc", 0)), "memory_mb": int(n.get("RealMemory", 0)),
                   "gpus": _gpus(n.get("CfgTRES", ""), n.get("Gres", ""))} for n in nodes],
        "partitions": [{"name": p.get("PartitionName"), "nodes": p.get("Nodes"), "cpus": int(p.get("TotalCPUs", 0)),
                        "gpus": _gpus(p.get("TRES", "")) or sum(  # no GPU TRES without slurmdbd: count the nodes'
                            _gpus("", n.get("Gres", "")) for n in nodes
                            if p.get("PartitionName") in n.get("Partitions", "").strip().split(",")),
                        "default": p.get("Default") == "YES"} for p in partitions],
    }


def status_table(st: dict) -> str:
    """`LocalCluster.status()` as the readable table `scalelab cluster status` prints."""
    lines = [f"local Slurm: {'up' if st['up'] else 'down'}    SLURM_CONF={st['conf']}"]
    if st["partitions"]:
        lines.append(f"{'PARTITION':<12}{'DEFAULT':<9}{'NODES':<16}{'CPUS':>5}{'GPUS':>6}")
        lines += [f"{p['name']:<12}{'yes' if p['default'] else 'no':<9}{p['nodes']:<16}{p['cpus']:>5}{p['gpus']:>6}"
                  for p in st["partitions"]]
    lines += [f"node {n['name']}" + (f" ({n['addr']})" if n.get("addr") else "")
              + f": {n['state']}, {n['cpus_alloc']}/{n['cpus']} CPUs allocated, {n['memory_mb']} MB, {n['gpus']} GPUs"
              for n in st["nodes"]]
    if st.get("kind") == "namespaces":
        lines.append(f"each node a network namespace ({', '.join(st['namespaces']) or 'none now'}); links "
                     + (f"shaped to {st['link_rate']}" if st.get("link_rate") else "not shaped"))
    lines.append(f"jobs in queue: {st['jobs']}" if st["up"] else "start it with `scalelab cluster up`")
    return "\n".join(lines)
