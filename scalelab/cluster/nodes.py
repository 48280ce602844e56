"""An N-node Slurm on this one machine: slurmctld on the host, one slurmd per node in its own network namespace.

    sudo scalelab cluster up --nodes 2 [--gpus-per-node 2] [--link-rate 1gbit]
    export SLURM_CONF=/var/lib/scalelab/cluster-nodes/slurm.conf
    srun -N2 -n2 hostname          # node1, node2: two hosts that talk TCP over a bridge inside this machine
    sudo scalelab cluster down --nodes 2

It lives beside the 1-node cluster (`scalelab.cluster.local`): its own state directory (default: the 1-node one's
name + "-nodes") and its own ports (6827/6828), with its own munged. Node i is `node<i>` at 10.213.0.(10+i); the
plumbing is `scalelab.cluster.netns`, the slurm.conf text `conf.multinode_conf_text`. Fake GPUs are GRES backed by
stand-in files under the state directory: Slurm schedules them and sets CUDA_VISIBLE_DEVICES for real; compute
falls back to the CPU. `up()` after a crash (daemons killed -9, namespaces left behind) removes what is left and
starts afresh; `down()` leaves no namespace, link, mount or daemon.

Each node has its own memory file system: slurmd mounts a fresh tmpfs on /dev/shm in its node's mount namespace,
so the job steps on node1 and node2 see different /dev/shm (node-local storage, as on real nodes: the multilevel
checkpoint tier), and it vanishes with the node's last process. `lose_node(name)` plays a crashed node: every
process on it killed with SIGKILL (slurmd, job steps, ranks), its /dev/shm gone with them, and slurmctld told at
once that the node is DOWN (what it would find by itself SlurmdTimeout seconds later): slurmctld requeues a batch
job that ran there ("requeue job due to failure of node", batch jobs are requeueable by default) and kills the rest.
`restore_node(name)` (or `up()`) brings it back: a fresh namespace, slurmd and empty /dev/shm, then RESUME.
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from . import netns
from .conf import detect_machine, hosts_text, multinode_conf_text, parse_scontrol, summarise
from .local import LocalCluster, _described, _zombie, default_state_dir
from ..errors import ClusterError
from ..run.procs import kill_processes

CTLD_PORT = 6827  # beside the 1-node cluster's 6817/6818
SLURMD_PORT = 6828


def default_nodes_state_dir() -> Path:
    """The 1-node cluster's state directory with "-nodes" appended (/var/lib/scalelab/cluster-nodes as root)."""
    base = default_state_dir()
    return base.with_name(base.name + "-nodes")


class NodesCluster(LocalCluster):
    """munged and slurmctld on the host, one slurmd per node namespace; `up()` and `down()` are idempotent."""

    def __init__(self, state_dir: str | os.PathLike | None = None, *, nodes: int | None = None,
                 gpus_per_node: int | None = None, link_rate: str | None = None, ctld_port: int = CTLD_PORT,
                 slurmd_port: int = SLURMD_PORT):
        # No accounting: the hub never uses this cluster, and no course account submits to it (see accounting.py)
        super().__init__(state_dir or default_nodes_state_dir(), ctld_port=ctld_port, slurmd_port=slurmd_port,
                         accounting=False)
        saved = self._saved()  # down/status without arguments act on the shape that was brought up
        self.nodes = nodes if nodes is not None else saved.get("nodes", 2)
        self.gpus_per_node = gpus_per_node if gpus_per_node is not None else saved.get("gpus_per_node", 0)
        self.link_rate = link_rate if link_rate is not None else saved.get("link_rate")
        if not 1 <= self.nodes <= netns.MAX_NODES:
            raise ClusterError(f"--nodes {self.nodes}: give 1 to {netns.MAX_NODES} nodes")
        if not 0 <= self.gpus_per_node <= 16:
            raise ClusterError(f"--gpus-per-node {self.gpus_per_node}: give 0 to 16 stand-in GPUs per node")
        if self.link_rate:
            netns.rate_bits(self.link_rate)  # refuses a rate tc would not take, before anything starts

    def __repr__(self) -> str:
        return f"NodesCluster(state_dir={str(self.state_dir)!r}, nodes={self.nodes})"

    @property
    def node_names(self) -> list[str]:
        """node1 .. nodeN."""
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def hosts_file(self) -> Path:
        """The /etc/hosts each node sees."""
        return self.state_dir / "hosts"

    def _shape(self) -> dict:
        # "node_shm": a cluster started before each node had its own /dev/shm is not this shape: started afresh
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "link_rate": self.link_rate,
                "node_shm": "tmpfs"}

    def _saved(self) -> dict:
        try:
            return json.loads((self.state_dir / "nodes.json").read_text())
        except (OSError, ValueError):
            return {}

    # -- daemons: slurmd@nodeN is node N's slurmd ------------------------------------------------------------

    def _pid_file(self, daemon: str) -> Path:
        if daemon.startswith("slurmd@"):
            return self.paths.run_dir / f"slurmd-{daemon.split('@')[1]}.pid"
        return super()._pid_file(daemon)

    def _pid(self, daemon: str) -> int | None:
        if "@" not in daemon:
            return super()._pid(daemon)
        try:
            pid = int(self._pid_file(daemon).read_text().split()[0])
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            return None
        return pid if comm == "slurmd" and not _zombie(pid) else None

    def _running(self) -> dict[str, int | None]:
        return {d: self._pid(d) for d in ("munged", "slurmctld", *(f"slurmd@{n}" for n in self.node_names))}

    def _healthy(self) -> bool:
        if self._saved() != self._shape() or not self._mine() \
                or set(netns.namespaces()) != {netns.ns_name(n) for n in self.node_names}:
            return False
        return super()._healthy() and len(self._nodes()) == self.nodes

    def _preflight(self) -> None:
        super()._preflight()
        why = netns.unavailable()
        if why:
            raise ClusterError(f"a multi-node cluster needs network namespaces, but {why}; use the 1-node cluster "
                               "(`sudo scalelab cluster up`) or run this as root on Linux")

    def up(self, timeout: float = 90) -> "NodesCluster":
        """Start (or repair) the namespaces, munged, slurmctld and every slurmd; return once a job runs on all nodes."""
        if self._healthy():
            self._seal_accounting()
            return self
        self._preflight()
        deadline = time.monotonic() + timeout
        with self._locked():
            if self._healthy():
                return self
            self._check_owner()
            if self._repairable():
                self._restart_lost_nodes()
            else:
                self._start_all()
            self._wait_usable(deadline)
            self._probe_all(deadline)
        return self

    def _repairable(self) -> bool:
        """Only some slurmds are gone (lost nodes), the rest is this shape's and alive: restart just those."""
        return (self._saved() == self._shape() and netns.owner() == str(self.state_dir)
                and bool(self._pid("munged")) and bool(self._pid("slurmctld")))

    def _restart_lost_nodes(self) -> None:
        """A fresh namespace and slurmd for every node whose slurmd is gone; jobs on the other nodes go on."""
        for i, node in enumerate(self.node_names, 1):
            if not self._pid(f"slurmd@{node}") or netns.ns_name(node) not in netns.namespaces():
                netns.add_node(i, node, self.link_rate)  # removes what is left of it first
                self._start_slurmd(node)

    def _start_all(self) -> None:
        """Everything from scratch: stale daemons and namespaces removed, then bridge, nodes, munged, slurmctld."""
        if not self._mine():
            netns.remove_all()  # a dead cluster of another state directory left them: stale
        self._stop_all()  # daemons of an earlier start (even killed -9) and stale namespaces
        self._check_ports()
        self._prepare()
        netns.ensure_bridge(str(self.state_dir))
        for i, node in enumerate(self.node_names, 1):
            netns.add_node(i, node, self.link_rate)
        p = self.paths
        self._start("munged", ["munged", "--key-file", str(p.munge_key), "--socket", str(p.munge_socket),
                               "--pid-file", str(p.munge_pid), "--log-file", str(p.munge_log), "--seed-file",
                               str(p.munge_seed), "--force"])
        self._check_munge()
        self._start("slurmctld", ["slurmctld", "-f", str(self.conf_path)])
        for node in self.node_names:
            self._start_slurmd(node)
        (self.state_dir / "nodes.json").write_text(json.dumps(self._shape()) + "\n")

    def _start_slurmd(self, node: str) -> None:
        """slurmd -N node inside node's namespaces (it daemonises there; its pid file is run/slurmd-<node>.pid).

        -c: a slurmd started here has no job of its own to keep (its node was down, or the cluster was), and a
        credential cache left by a killed slurmd refuses the steps of new jobs that reuse a revoked job id ("Job
        credential revoked" after a repair, seen in CI)."""
        # its own /dev/shm (node-local memory): private to this node's mount namespace, gone with its last process
        own_shm = ["sh", "-c", 'mount -t tmpfs -o mode=1777 "$1" /dev/shm && shift && exec "$@"', "sh",
                   f"shm-{node}"]
        self._start(f"slurmd@{node}", netns.node_command(
            node, self.hosts_file, [*own_shm, "slurmd", "-c", "-f", str(self.conf_path), "-N", node]))

    def _check_owner(self) -> None:
        """One namespace cluster per machine (node names and addresses are fixed): refuse to take over a live one."""
        other = netns.owner()
        if other and other != str(self.state_dir) and NodesCluster(other)._pid("slurmctld"):
            raise ClusterError(f"the namespace cluster of {other} is up (one per machine): bring it down first "
                               f"with `sudo scalelab cluster --state-dir {other} down --nodes 2`, or use it "
                               f"(export SLURM_CONF={other}/slurm.conf)")

    def _mine(self) -> bool:
        """Whether the namespaces and bridge now on the machine are this state directory's."""
        return netns.owner() in (None, str(self.state_dir))

    def _prepare(self) -> None:
        """State directories, slurm.conf, gres.conf, the nodes' hosts file, stand-in GPU files, a munge key."""
        super()._prepare()  # directories and the munge key; its 1-node slurm.conf is replaced below
        m = detect_machine()
        nodes = [(n, netns.node_addr(i)) for i, n in enumerate(self.node_names, 1)]
        self.conf_path.write_text(multinode_conf_text(
            cluster_name="scalelab-nodes", ctld_host=m.hostname, ctld_addr=netns.host_addr(), nodes=nodes,
            cpus=m.cpus, real_memory_mb=m.memory_mb, gpus=self.gpus_per_node, state_dir=self.state_dir,
            sockets=m.sockets, cores_per_socket=m.cores_per_socket, threads_per_core=m.threads_per_core,
            ctld_port=self.ports[0], slurmd_port=self.ports[1]))
        self.hosts_file.write_text(hosts_text(m.hostname, netns.host_addr(), nodes))
        self.hosts_file.chmod(0o644)
        for node in self.node_names:
            (self.paths.slurmd_spool / node).mkdir(parents=True, exist_ok=True)
        self.paths.gres_conf.unlink(missing_ok=True)
        if self.gpus_per_node:
            self.paths.gres_conf.write_text(self._gres_text())

    def _gres_text(self) -> str:
        """gres.conf naming stand-in device files: slurmd counts them, Slurm binds them with CUDA_VISIBLE_DEVICES."""
        dev = self.state_dir / "dev"
        dev.mkdir(exist_ok=True)
        files = [dev / f"nvidia{k}" for k in range(self.gpus_per_node)]
        for k, f in enumerate(files):
            # slurmd accepts only character devices; NVIDIA's major (195) with no driver behind it: nothing
            # can open them, so a CUDA program sees no GPU and falls back to the CPU
            if not f.is_char_device():
                f.unlink(missing_ok=True)
                os.mknod(f, 0o644 | stat.S_IFCHR, os.makedev(195, k))
        return ("# Written by scalelab: stand-in GPU device files; compute on them falls back to the CPU.\n"
                + "".join(f"NodeName={n} Name=gpu File={','.join(map(str, files))}\n" for n in self.node_names))

    def _wait_usable(self, deadline: float) -> None:
        """Wait until every node is usable; resume, once each, nodes slurmctld kept DOWN/DRAINED from before."""
        resumed: set[str] = set()
        nodes: list[dict] = []
        while time.monotonic() < deadline:
            dead = [d for d, pid in self._running().items() if not pid]
            if dead:
                log = self.log_dir / (f"slurmd-{dead[0].split('@')[1]}.log" if "@" in dead[0] else f"{dead[0]}.log")
                raise ClusterError(f"{dead[0]} exited during start-up; see {log}")
            try:
                nodes = self._nodes()
            except ClusterError:
                nodes = []
            if len(nodes) == self.nodes and self._usable(nodes):
                return
            self._resume_kept_down(nodes, resumed)
            time.sleep(0.3)
        raise ClusterError(f"the nodes did not all become usable in time (found {_described(nodes)}); see "
                           f"`SLURM_CONF={self.conf_path} scontrol show node` and {self.log_dir}/slurmd-*.log")

    def _probe_all(self, deadline: float) -> None:
        """One tiny job step on every node: slurmctld, each slurmd and the links between them work."""
        left = max(10.0, deadline - time.monotonic())
        r = self.run("srun", "--quiet", "-J", "scalelab-probe", "-N", str(self.nodes), "-n", str(self.nodes),
                     "-t", "1", "--mem=10", "hostname", timeout=left, check=False)
        if r.returncode or sorted(r.stdout.split()) != sorted(self.node_names):
            raise ClusterError(f"the daemons run but a job step on every node failed (`srun -N{self.nodes} "
                               f"hostname`, exit {r.returncode}, answered {r.stdout.split()}): "
                               f"{r.stderr.strip()[-400:]}; see {self.log_dir}/slurmd-*.log")

    def _stop_all(self) -> None:
        """Every daemon of ours (by pid file), then whatever runs in the node namespaces, the namespaces and links."""
        for daemon in [f"slurmd@{n}" for n in self._all_node_names()] + ["slurmctld", "munged"]:
            pid = self._pid(daemon)
            if pid:
                kill_processes([pid], grace_s=10, tree=False)
            self._pid_file(daemon).unlink(missing_ok=True)
        if self._mine():
            netns.remove_all()

    def _all_node_names(self) -> list[str]:
        """This shape's nodes and those of an earlier, larger start (their pid files may still be there)."""
        found = {p.stem[len("slurmd-"):] for p in self.paths.run_dir.glob("slurmd-node*.pid")}
        return sorted(found | set(self.node_names))

    def down(self) -> None:
        """Stop every daemon, kill what runs on the nodes, and remove the namespaces, links and bridge."""
        if not self.state_dir.exists():
            if netns.owner() is None:
                netns.remove_all()  # namespaces without a bridge: what a crash in the middle of `up` leaves
            return
        with self._locked():
            self._stop_all()

    def leftovers(self) -> list[str]:
        """What of this cluster still exists on the machine (empty after `down()`): daemons, namespaces, links."""
        daemons = [f"{d} (pid {pid})" for d, pid in self._running().items() if pid]
        return daemons + [f"namespace {n}" for n in netns.namespaces()] + [f"link {n}" for n in netns.links()] \
            + [f"mount {m}" for m in netns.mounts()]

    def status(self) -> dict:
        """LocalCluster.status() plus each node's address and link rate, and the namespaces that exist."""
        result = {"up": False, "conf": str(self.conf_path), "nodes": [], "partitions": [], "jobs": 0,
                  "kind": "namespaces", "link_rate": self.link_rate,
                  "namespaces": netns.namespaces() if self._mine() else []}
        if self._pid("munged") and self._pid("slurmctld"):  # a lost node's slurmd is missing: still list them
            try:
                nodes = self._nodes()
                parts = parse_scontrol(self.run("scontrol", "show", "partition", "-o").stdout, "PartitionName")
                jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
                result.update(summarise(nodes, parts), jobs=len(jobs))
                for n, raw in zip(result["nodes"], nodes):
                    n["addr"] = raw.get("NodeAddr")
            except ClusterError:
                pass
        # a node whose slurmd died shows as down here at once; slurmctld notices within SlurmdTimeout
        for n in result["nodes"]:
            if not self._pid(f"slurmd@{n['name']}") and "down" not in n["state"]:
                n["state"] += "+slurmd_dead"
                result["up"] = False
        return result

    def set_link_rate(self, rate: str | None) -> None:
        """Shape every node's link to `rate` ("1gbit"), or take the shaping off (None), on the running cluster."""
        if rate:
            netns.rate_bits(rate)
        for node in self.node_names:
            netns.shape(node, rate) if rate else netns.unshape(node)
        self.link_rate = rate
        (self.state_dir / "nodes.json").write_text(json.dumps(self._shape()) + "\n")

    def kill_node(self, node: str) -> None:
        """Kill node's slurmd and every process on it with SIGKILL: a node lost mid-run (for tests and labs)."""
        if node not in self.node_names:
            raise ClusterError(f"no node {node!r}: this cluster has {', '.join(self.node_names)}")
        netns.kill_node(node)

    def lose_node(self, node: str, reason: str = "lost (scalelab lose_node)") -> None:
        """A crashed node: every process on it SIGKILLed, its /dev/shm gone with them, and the node DOWN in
        slurmctld now (it would mark it so itself after SlurmdTimeout): its batch jobs are requeued, new jobs
        avoid it."""
        self.kill_node(node)
        r = self.run("scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}", check=False)
        if r.returncode:
            raise ClusterError(f"slurmctld refused to mark {node} DOWN: {r.stderr.strip()}")

    def restore_node(self, node: str, timeout: float = 90) -> None:
        """Bring a lost node back (fresh namespace, slurmd, empty /dev/shm) and RESUME it; returns once a job step
        runs on every node again."""
        if node not in self.node_names:
            raise ClusterError(f"no node {node!r}: this cluster has {', '.join(self.node_names)}")
        self.up(timeout=timeout)  # repairs only the nodes whose slurmd is gone; resumes DOWN ones


__all__ = ["NodesCluster", "default_nodes_state_dir", "CTLD_PORT", "SLURMD_PORT"]
