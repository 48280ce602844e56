"""What the queue looks like to a student at spawn time: free/total nodes, CPUs and GPUs per partition and in the
class reservation (the spawn form), and a pending job's place in its partition's queue with Slurm's expected start
(the spawn-pending page).

Everything here is counts and times. The hub asks Slurm as itself (it sees every job); what reaches a student is
never another job's id, name or user. One `QueueView` is shared by every spawner of the hub: a class of 100 opening
the form within `ttl` seconds costs one `sinfo` (callers that arrive while it runs wait for the same answer).
When Slurm does not answer, the view says so ("unknown") instead of failing the form.
"""
from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping

Runner = Callable[[list], Awaitable[tuple[int, str, str]]]
"""Runs a Slurm command (argv) as the hub; returns (returncode, stdout, stderr) and never raises for exit codes."""

SINFO_FIELDS = "NodeList:|,PartitionName:|,Available:|,StateLong:|,Gres:|,GresUsed:|,CPUsState:|"
"""`sinfo -h -N -O` fields: one line per node and partition."""

_NOT_USABLE = ("down", "drain", "fail", "maint", "power", "reboot", "unknown", "no_respond", "future", "inval")


def _gpu_count(gres: str) -> int:
    """GPUs in a Gres/GresUsed field ('gpu:2', 'gpu:a100:1(IDX:0),mps:0'); 0 for '(null)'."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        fields = item.strip().split(":")
        if len(fields) >= 2 and fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total


@dataclass(frozen=True)
class Node:
    """One node as one partition lists it."""

    name: str
    partition_up: bool
    state: str
    cpus: int
    idle_cpus: int
    gpus: int
    used_gpus: int
    gres: str = ""
    """The node's Gres as sinfo says it ('gpu:a100:4(S:0-1)'): GPU types for `options.partition_gpus`."""

    @property
    def usable(self) -> bool:
        """Up, not drained or down, and its partition takes jobs."""
        return self.partition_up and not self.state.endswith("*") and not any(w in self.state for w in _NOT_USABLE)

    @property
    def free(self) -> bool:
        """No job on it (idle), usable."""
        return self.usable and self.state in ("idle", "reserved")


def parse_sinfo(text: str) -> dict[str, list[Node]]:
    """partition -> its nodes, from `sinfo -h -N -O SINFO_FIELDS`. A line that does not have the fields is skipped."""
    out: dict[str, list[Node]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 7 or not parts[0] or not parts[1]:
            continue
        name, partition, avail, state, gres, used, cpus = parts[:7]
        m = re.fullmatch(r"(\d+)/(\d+)/(\d+)/(\d+)", cpus.strip())
        alloc_idle_other_total = [int(x) for x in m.groups()] if m else [0, 0, 0, 0]
        out.setdefault(partition, []).append(Node(
            name=name, partition_up=avail.strip().lower() == "up", state=state.strip().lower(),
            cpus=alloc_idle_other_total[3], idle_cpus=alloc_idle_other_total[1], gpus=_gpu_count(gres),
            used_gpus=_gpu_count(used), gres=gres.strip()))
    return out


@dataclass(frozen=True)
class Reservation:
    """One reservation as `scontrol show reservation -o` gives it."""

    name: str
    nodes: tuple[str, ...]
    active: bool
    start: str
    cpus: int = 0
    """Cores reserved (TRES cpu=); 0 = not said."""
    gpus: int = 0
    """GPUs reserved (TRES gres/gpu=); 0 = not said."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact node list ('n[1-3,5],gpu01') as names; '(null)' or '' is none."""
    text = (text or "").strip()
    if not text or text == "(null)":
        return []
    names: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", text):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if hi and lo.isdigit() and hi.isdigit():
                names.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                names.append(prefix + lo)
    return names


def parse_reservations(text: str) -> dict[str, Reservation]:
    """name -> Reservation, from `scontrol show reservation -o` ('No reservations in the system' is none)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"ReservationName=(.*?) StartTime=", line.strip())
        if not m:
            continue
        fields = dict(re.findall(r"(\w+)=(\S*)", line[m.end() - len(" StartTime="):]))
        tres = fields.get("TRES", "")
        cpus = re.search(r"(?:^|,)cpu=(\d+)", tres)
        gpus = re.search(r"gres/gpu(?::[^=,]+)?=(\d+)", tres)
        out[m.group(1)] = Reservation(name=m.group(1), nodes=tuple(expand_hostlist(fields.get("Nodes", ""))),
                                      active=fields.get("State", "") == "ACTIVE", start=fields.get("StartTime", ""),
                                      cpus=int(cpus.group(1)) if cpus else 0, gpus=int(gpus.group(1)) if gpus else 0)
    return out


@dataclass(frozen=True)
class Free:
    """Free and total nodes, CPUs and GPUs of a partition or a reservation, now."""

    free_nodes: int
    nodes: int
    free_cpus: int
    cpus: int
    free_gpus: int
    gpus: int

    def text(self) -> str:
        """'1/2 nodes, 3/8 CPUs, 0/4 GPUs free', or '... CPUs free (no GPUs)' where there are none."""
        if self.gpus:
            return (f"{self.free_nodes}/{self.nodes} nodes, {self.free_cpus}/{self.cpus} CPUs, "
                    f"{self.free_gpus}/{self.gpus} GPUs free")
        return f"{self.free_nodes}/{self.nodes} nodes, {self.free_cpus}/{self.cpus} CPUs free (no GPUs)"


def partition_free(nodes: list[Node]) -> Free:
    """What a partition has free now: whole idle nodes, idle CPUs and unused GPUs of its usable nodes (a node of an
    active reservation is free only to the reservation's jobs, so it counts as busy here)."""
    open_nodes = [n for n in nodes if n.usable and n.state != "reserved"]
    return Free(free_nodes=sum(1 for n in open_nodes if n.free), nodes=len(nodes),
                free_cpus=sum(n.idle_cpus for n in open_nodes), cpus=sum(n.cpus for n in nodes),
                free_gpus=sum(max(n.gpus - n.used_gpus, 0) for n in open_nodes), gpus=sum(n.gpus for n in nodes))


def reservation_free(resv: Reservation, partition_nodes: list[Node]) -> Free:
    """What the reservation has free now: its nodes in the profile's partition that are free, their idle CPUs and
    unused GPUs, each capped at what the reservation holds (a core-count reservation holds fewer than its nodes
    have, and no GPUs unless its TRES names them). An inactive reservation (it starts later) has nothing free now."""
    mine = [n for n in partition_nodes if n.name in resv.nodes]
    node_cpus = sum(n.cpus for n in mine)
    cpus = min(resv.cpus, node_cpus) if resv.cpus else node_cpus
    whole = cpus >= node_cpus  # whole nodes: their GPUs come with them
    gpus = resv.gpus or (sum(n.gpus for n in mine) if whole else 0)
    if not resv.active:
        return Free(0, len(mine), 0, cpus, 0, gpus)
    usable = [n for n in mine if n.usable]
    return Free(free_nodes=sum(1 for n in usable if n.free), nodes=len(mine),
                free_cpus=min(sum(n.idle_cpus for n in usable), cpus), cpus=cpus,
                free_gpus=min(sum(max(n.gpus - n.used_gpus, 0) for n in usable), gpus), gpus=gpus)


@dataclass(frozen=True)
class Snapshot:
    """The cluster at one moment, as the form shows it."""

    taken: float
    """time.time() of the sinfo answer."""
    partitions: dict[str, list[Node]] | None
    """None: sinfo failed (see `error`)."""
    reservations: dict[str, Reservation] | None = None
    """None: scontrol failed."""
    error: str = ""

    def gres_lines(self) -> str:
        """The partitions' GPUs as `sinfo -h -o '%R|%G'` would say them (options.partition_gpus reads it)."""
        return "\n".join(f"{p}|{n.gres or '(null)'}" for p, nodes in (self.partitions or {}).items() for n in nodes)

    def profile_lines(self, partition: str, reservation: str) -> list[str]:
        """What the form says under a profile: free now on its partition, and in its reservation ('' = none)."""
        if self.partitions is None:
            return ["Free now: unknown (Slurm did not answer)"]
        nodes = self.partitions.get(partition)
        lines = [f"Free now on partition {partition}: "
                 + (partition_free(nodes).text() if nodes else "no nodes (partition not found)")]
        if nodes and not any(n.partition_up for n in nodes):
            lines[0] += " (the partition is not taking jobs)"
        if reservation:
            if self.reservations is None:
                lines.append(f"In reservation {reservation}: unknown (Slurm did not answer)")
            elif reservation not in self.reservations:
                lines.append(f"In reservation {reservation}: not found on the cluster")
            else:
                resv = self.reservations[reservation]
                text = reservation_free(resv, nodes or []).text()
                lines.append(f"In reservation {reservation}: {text}"
                             + ("" if resv.active else f" (it starts {resv.start})"))
        return lines


@dataclass
class PendingPlace:
    """A pending job's place: `position` of `waiting` pending jobs of its partition (1 = next), Slurm's expected
    start ('' = not estimated yet)."""

    position: int
    waiting: int
    partition: str
    start: str

    def text(self) -> str:
        when = f"expected start {self.start}" if self.start else "no expected start from Slurm yet"
        return f"position {self.position} of {self.waiting} waiting in partition {self.partition}; {when}"


def pending_place(text: str, job_id: str) -> PendingPlace | None:
    """`job_id`'s place among the pending jobs of its partition, from `squeue --start -h -o '%i|%P|%Q|%S'` (id,
    partition(s), priority, expected start): ordered by priority, then submission (job id). None when the job is not
    pending there."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        jid, parts_, prio, start = parts[:4]
        rows.append((jid.strip(), set(parts_.split(",")), int(prio) if prio.strip().isdigit() else 0, start.strip()))
    mine = [r for r in rows if r[0] == str(job_id)]
    if not mine:
        return None
    _, partitions, _, start = mine[0]
    same = [r for r in rows if r[1] & partitions]

    def key(r):
        base = r[0].split("_")[0]
        return (-r[2], int(base) if base.isdigit() else 0, r[0])
    same.sort(key=key)
    position = [r[0] for r in same].index(str(job_id)) + 1
    start = "" if start in ("N/A", "Unknown", "(null)", "") else start
    return PendingPlace(position=position, waiting=len(same), partition=",".join(sorted(partitions)), start=start)


@dataclass
class QueueView:
    """The hub's one cached view of the queue (shared by every spawner: `QueueView.shared`)."""

    run: Runner
    sinfo: str
    scontrol: str
    squeue: str
    ttl: float = 5.0
    conf: str = ""
    """The SLURM_CONF the runner hands over ('' = Slurm's default): when it names no file, Slurm is not asked
    (its tools retry a missing configuration for a minute) and the view is 'unknown' at once."""
    _snapshot: tuple[float, Snapshot | None] = (0.0, None)
    _pending: tuple[float, tuple[int, str, str] | None] = (0.0, None)
    _inflight: dict = field(default_factory=dict)

    @classmethod
    def shared(cls, run: Runner, bin_dir: str, conf: str, ttl: float) -> "QueueView":
        """The hub's view of its Slurm (bin dir and SLURM_CONF), made on first use."""
        view = _VIEWS.get((bin_dir, conf))
        if view is None:
            view = _VIEWS[(bin_dir, conf)] = cls(run=run, sinfo=os.path.join(bin_dir, "sinfo"),
                                                 scontrol=os.path.join(bin_dir, "scontrol"),
                                                 squeue=os.path.join(bin_dir, "squeue"), ttl=ttl, conf=conf)
        view.ttl = ttl
        return view

    async def _once(self, what: str, make: Callable[[], Awaitable]):
        """Run `make()` once for everyone waiting on `what` now."""
        task = self._inflight.get(what)
        if task is None:
            task = asyncio.ensure_future(make())
            self._inflight[what] = task
            task.add_done_callback(lambda _t: self._inflight.pop(what, None))
        return await asyncio.shield(task)

    async def snapshot(self) -> Snapshot:
        """The cluster now, at most `ttl` seconds old."""
        stamp, snap = self._snapshot
        if snap is not None and time.monotonic() - stamp <= self.ttl:
            return snap
        return await self._once("snapshot", self._take_snapshot)

    def _no_conf(self) -> str:
        return f"SLURM_CONF {self.conf} is not a file" if self.conf and not os.path.isfile(self.conf) else ""

    async def _take_snapshot(self) -> Snapshot:
        if self._no_conf():
            snap = Snapshot(taken=time.time(), partitions=None, error=self._no_conf())
            self._snapshot = (time.monotonic(), snap)
            return snap
        (rc, out, err), (rrc, rout, _) = await asyncio.gather(
            self.run([self.sinfo, "-h", "-N", "-O", SINFO_FIELDS]),
            self.run([self.scontrol, "show", "reservation", "-o"]))
        if rc != 0:
            snap = Snapshot(taken=time.time(), partitions=None, error=f"sinfo exit {rc}: {err[:300]}")
        else:
            snap = Snapshot(taken=time.time(), partitions=parse_sinfo(out),
                            reservations=parse_reservations(rout) if rrc == 0 else None)
        self._snapshot = (time.monotonic(), snap)
        return snap

    async def place(self, job_id: str) -> PendingPlace | None:
        """`job_id`'s place in its partition's queue, from a pending list at most `ttl` seconds old."""
        stamp, answer = self._pending
        if answer is None or time.monotonic() - stamp > self.ttl:
            answer = await self._once("pending", self._take_pending)
        rc, out, _ = answer
        return pending_place(out, job_id) if rc == 0 else None

    async def _take_pending(self):
        if self._no_conf():
            answer = (1, "", self._no_conf())
            self._pending = (time.monotonic(), answer)
            return answer
        answer = await self.run([self.squeue, "--start", "-h", "-t", "PENDING", "-o", "%i|%P|%Q|%S"])
        self._pending = (time.monotonic(), answer)
        return answer


_VIEWS: dict[tuple, QueueView] = {}


def profile_queue_lines(snapshot: Snapshot | None, profiles) -> Mapping[str, list[str]]:
    """profile name -> the lines the form shows under it (`Snapshot.profile_lines`)."""
    if snapshot is None:
        return {}
    return {p.name: snapshot.profile_lines(p.partition, p.reservation) for p in profiles}
