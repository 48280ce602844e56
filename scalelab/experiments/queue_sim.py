"""Lab 11 (ML for HPC): a job chain on a busy Slurm-like queue, submitted reactively or proactively (Mirage-style).

    r = compare_policies(nodes=32, days=4, load=0.9, seed=0, links=4, link_hours=2.0, link_nodes=8)
    r["reactive"]["idle_gap_h"], r["afterok"]["idle_gap_h"], r["predictive"]["idle_gap_h"]   # per link transition
    r["predictive"]["overlap_node_h"]   # node-hours a proactive link held idle waiting for its predecessor

A long training run on a cluster is a chain of jobs (`links`), each `link_hours` long and resuming from the
previous one's checkpoint. Submitting the next link only when the previous one ends ("reactive") puts it at the
back of the queue every time: the run sits idle for a whole queue wait between links. Mirage (TACC, SC'23)
submits the next link *before* the previous ends, at a time chosen from a prediction of the queue wait. This
module simulates that on a seeded synthetic trace. Pure Python, deterministic for a seed, well under a second.

The model (simple on purpose; every choice here is one a lab exercise can change):

- Background trace (`background_trace`): Poisson arrivals at the rate that offers `load` x nodes of work;
  sizes 1..nodes/2 in powers of two, small ones more likely; runtimes log-normal (median ~40 min, capped at
  12 h); users request 1.2-3x their runtime as the time limit (as users do), and jobs end at their runtime.
- Scheduler (`simulate`): FIFO with EASY backfill, as Slurm's sched/backfill does in its simplest form. Jobs are
  ordered by priority time; jobs start from the head while they fit; when the head does not fit it gets a
  reservation at the earliest time enough nodes free up (from running jobs' *requested* limits), and later
  jobs start now only if they fit and end (by their limit) before it, or use nodes the head will not need.
  Priority time is the submit time (Slurm's priority/basic: a job keeps its place from submission, even while
  it waits on a dependency) or, with `priority="eligible"`, the time its dependency was met (the age factor of
  priority/multifactor counts only eligible time; then `afterok` buys no place in line).
- Chain policies: "reactive" submits link i+1 when link i ends. "afterok" submits every link at the start with
  a dependency on the previous one (`sbatch --dependency=afterok:<id>`). "predictive" submits link i+1, without a
  dependency, when link i starts plus its length minus the predicted queue wait, the median wait of the jobs
  that started in the last `window_h` hours (a heuristic standing in for Mirage's learned model). A predictive
  link that starts early holds its nodes idle until its predecessor's checkpoint exists (overlap, wasted
  node-hours), at most `slack_h` (it asks for link_hours + slack_h as its limit); if the checkpoint is not there
  by then it exits and is resubmitted with afterok.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from ..errors import SpecError

POLICIES = ("reactive", "afterok", "predictive")
DRIVEN = ("decide", "replay")
"""Chain policies driven from outside (queue_policy.py): "decide" asks a callable at every poll whether to submit
the next link now; "replay" submits each link at a recorded time (how a grader re-simulates a student's policy)."""
PRIORITIES = ("submit", "eligible")


@dataclass
class Job:
    """One job: what was asked (submit, nodes, limit) and what happened (start, end); times in hours."""

    id: int
    submit: float
    nodes: int
    runtime: float
    walltime: float
    after: int | None = None  # afterok dependency: eligible once that job has ended
    link: int | None = None   # the chain link this job runs (None: background)
    eligible: float | None = None
    start: float | None = None
    end: float | None = None
    gave_up: bool = False     # a predictive link that found no checkpoint within its slack and exited


def background_trace(nodes: int = 32, days: float = 4.0, load: float = 0.9, seed: int = 0) -> list[Job]:
    """A seeded synthetic trace of background jobs offering about `load` x `nodes` of work over `days` days."""
    if nodes < 2:
        raise SpecError("nodes", f"needs at least 2 nodes, got {nodes}")
    if not 0 < load < 1.5:
        raise SpecError("load", f"offered load {load} should be in (0, 1.5): 1 is every node busy")
    rng = random.Random(seed)
    sizes = [2 ** i for i in range(int(math.log2(nodes // 2)) + 1)]
    weights = [1 / (i + 1) ** 1.5 for i in range(len(sizes))]  # many small jobs, few big ones
    mu, sigma, cap = math.log(2 / 3), 1.0, 12.0  # log-normal runtime: median 40 min
    mean_work = sum(s * w for s, w in zip(sizes, weights)) / sum(weights) * math.exp(mu + sigma ** 2 / 2)
    rate = load * nodes / mean_work  # jobs per hour
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > days * 24:
            return jobs
        runtime = min(cap, rng.lognormvariate(mu, sigma))
        walltime = min(24.0, max(runtime * rng.uniform(1.2, 3.0), 0.25))
        jobs.append(Job(len(jobs), t, rng.choices(sizes, weights)[0], runtime, walltime))


class Simulator:
    """An event-driven FIFO + EASY-backfill scheduler over `nodes` identical nodes."""

    def __init__(self, nodes: int, priority: str = "submit"):
        self.nodes, self.priority, self.free = nodes, priority, nodes
        self.now, self.events, self.seq = 0.0, [], 0
        self.queue: list[Job] = []      # eligible, waiting
        self.held: list[Job] = []       # waiting on a dependency
        self.running: list[Job] = []
        self.done: dict[int, Job] = {}
        self.started: list[Job] = []    # in start order: the history a predictor reads
        self.on_start = self.on_end = lambda job: None

    def at(self, time: float, action, *args) -> None:
        """Run `action(*args)` at `time` (ties in the order they were added)."""
        heapq.heappush(self.events, (time, self.seq, action, args))
        self.seq += 1

    def submit(self, job: Job) -> None:
        """Queue a job now (held until its dependency has ended)."""
        job.submit = self.now
        if job.after is not None and job.after not in self.done:
            self.held.append(job)
        else:
            job.eligible = self.now
            self.queue.append(job)

    def _end(self, job: Job) -> None:
        job.end = self.now
        self.running.remove(job)
        self.free += job.nodes
        self.done[job.id] = job
        for held in [j for j in self.held if j.after == job.id]:
            self.held.remove(held)
            held.eligible = self.now
            self.queue.append(held)
        self.on_end(job)

    def _start(self, job: Job) -> None:
        job.start = self.now
        self.queue.remove(job)
        self.running.append(job)
        self.free -= job.nodes
        self.started.append(job)
        self.on_start(job)  # may change job.runtime (a predictive link that waits for its predecessor)
        self.at(self.now + job.runtime, self._end, job)

    def schedule(self) -> None:
        """Start the head of the queue while it fits, then backfill around the head's reservation (EASY)."""
        key = (lambda j: (j.submit, j.id)) if self.priority == "submit" else (lambda j: (j.eligible, j.id))
        self.queue.sort(key=key)
        while self.queue and self.queue[0].nodes <= self.free:
            self._start(self.queue[0])
        if not self.queue:
            return
        head, avail, shadow, extra = self.queue[0], self.free, math.inf, 0
        for end, n in sorted((j.start + j.walltime, j.nodes) for j in self.running):
            avail += n
            if avail >= head.nodes:
                shadow, extra = end, avail - head.nodes
                break
        for job in list(self.queue[1:]):
            if job.nodes > self.free:
                continue
            if self.now + job.walltime <= shadow:
                self._start(job)
            elif job.nodes <= extra:  # runs past the reservation, on nodes the head will not need
                extra -= job.nodes
                self._start(job)

    def run(self, until: float = math.inf) -> None:
        """Process events in time order, scheduling after each instant's events."""
        while self.events and self.events[0][0] <= until:
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:
                _, _, action, args = heapq.heappop(self.events)
                action(*args)
            self.schedule()


def predicted_wait(sim: Simulator, window_h: float, nodes: int = 1, quantile: float = 0.5) -> float:
    """The `quantile` of the queue waits (start - eligible) of jobs of at least `nodes` nodes that started in the
    last `window_h` hours (small jobs backfill at once and say little about a big one); 0 when there are none."""
    recent = []
    for job in reversed(sim.started):
        if job.start < sim.now - window_h:
            break
        if job.nodes >= nodes:
            recent.append(job.start - job.eligible)
    if not recent:
        return 0.0
    recent.sort()
    return recent[min(len(recent) - 1, int(quantile * len(recent)))]


class QueueView:
    """What a provisioning policy sees at a poll: the time, when the running link ends (its checkpoint exists), the
    size of the next link, and the queue: waiting and running jobs, free nodes, recent waits (`features()`)."""

    def __init__(self, sim: Simulator, ready_h: float, nodes: int, window_h: float):
        self.now_h, self.ready_h, self.nodes, self.window_h, self._sim = sim.now, ready_h, nodes, window_h, sim

    @property
    def left_h(self) -> float:
        """Hours until the running link ends."""
        return self.ready_h - self.now_h

    def features(self) -> dict[str, float]:
        """The queue now, as numbers a wait model reads (queue_policy.FEATURES, in that order)."""
        return queue_state(self._sim, self.nodes, self.window_h)


def queue_state(sim: Simulator, nodes: int, window_h: float = 6.0) -> dict[str, float]:
    """The queue as a job of `nodes` nodes submitted now would meet it: hours of whole-cluster work waiting ahead
    of it (by requested limits), hours of work the running jobs may still hold, the fraction of nodes free, its
    share of the cluster, and the median wait of comparable jobs in the last `window_h` hours."""
    total = sim.nodes
    return {"ahead_h": sum(j.nodes * j.walltime for j in sim.queue + sim.held) / total,
            "running_h": sum(j.nodes * max(0.0, j.start + j.walltime - sim.now) for j in sim.running) / total,
            "free": sim.free / total, "size": nodes / total,
            "recent_wait_h": predicted_wait(sim, window_h, nodes)}


def simulate(trace: list[Job], nodes: int, policy: str = "reactive", links: int = 4, link_hours: float = 2.0,
             link_nodes: int = 8, chain_start_h: float = 48.0, priority: str = "submit", window_h: float = 6.0,
             quantile: float = 0.5, slack_h: float | None = None, decide=None, poll_h: float = 0.25,
             submit_at: list[float] | None = None) -> dict:
    """Run the trace with one job chain under `policy`; returns the chain's figures (`chain_figures`).

    policy "decide": from each link's start, every `poll_h` hours, `decide(view)` (a `QueueView` of the queue now)
    says whether to submit the next link now; at the latest it is submitted when its predecessor ends.
    policy "replay": link i >= 1 is submitted at `submit_at[i - 1]` (or when its predecessor starts, if later)."""
    _check(policy, priority, links, link_nodes, nodes, decide, submit_at)
    sim = Simulator(nodes, priority)
    for bg in trace:
        sim.at(bg.submit, sim.submit, Job(bg.id, bg.submit, bg.nodes, bg.runtime, bg.walltime))
    chain = _Chain(sim, policy, links, link_hours, link_nodes, window_h, quantile,
                   link_hours / 2 if slack_h is None else slack_h, decide, poll_h, submit_at)
    sim.on_start, sim.on_end = chain.on_start, chain.on_end
    sim.at(chain_start_h, chain.start)
    sim.run()
    return chain_figures(chain.jobs, links, link_hours, chain_start_h, policy)


class _Chain:
    """One job chain in a `Simulator`: its links submitted as `policy` says, as the simulation calls back."""

    def __init__(self, sim: Simulator, policy: str, links: int, link_hours: float, link_nodes: int, window_h: float,
                 quantile: float, slack: float, decide, poll_h: float, submit_at: list[float] | None):
        self.sim, self.policy, self.links, self.link_hours, self.link_nodes = sim, policy, links, link_hours, link_nodes
        self.window_h, self.quantile, self.slack, self.decide, self.poll_h = window_h, quantile, slack, decide, poll_h
        self.submit_at = submit_at
        self.ids = iter(range(10 ** 9, 2 * 10 ** 9))
        self.jobs: list[Job] = []  # every chain job, failed predictive tries included
        self.ready: dict[int, float] = {}  # link -> when its predecessor's checkpoint exists (its end)

    def link_job(self, i: int, after: int | None = None, walltime: float | None = None) -> Job:
        job = Job(next(self.ids), self.sim.now, self.link_nodes, self.link_hours,
                  self.link_hours if walltime is None else walltime, after=after, link=i)
        self.jobs.append(job)
        return job

    def submit_predictive(self, i: int) -> None:
        self.sim.submit(self.link_job(i, walltime=self.link_hours + self.slack))

    def on_start(self, job: Job) -> None:
        if job.link is None:
            return
        sim, i = self.sim, job.link
        wait = self.ready.get(i, job.start) - job.start  # > 0: started before the predecessor's checkpoint
        if wait > self.slack:
            job.runtime, job.gave_up = self.slack, True  # exits; resubmitted with afterok when it does
            return
        job.runtime = max(wait, 0.0) + self.link_hours
        self.ready[i + 1] = job.start + job.runtime
        if i + 1 >= self.links:
            return
        if self.policy == "predictive":
            t = max(sim.now, self.ready[i + 1] - predicted_wait(sim, self.window_h, self.link_nodes, self.quantile))
            sim.at(t, self.submit_predictive, i + 1)
        elif self.policy == "decide":
            sim.at(sim.now, self.poll, i + 1)
        elif self.policy == "replay":
            sim.at(max(sim.now, self.submit_at[i]), self.submit_predictive, i + 1)

    def poll(self, i: int) -> None:
        sim = self.sim
        if sim.now >= self.ready[i] or self.decide(QueueView(sim, self.ready[i], self.link_nodes, self.window_h)):
            self.submit_predictive(i)
        else:
            sim.at(min(sim.now + self.poll_h, self.ready[i]), self.poll, i)

    def on_end(self, job: Job) -> None:
        if job.link is None:
            return
        if job.gave_up:
            prev = next(j for j in reversed(self.jobs) if j.link == job.link - 1 and not j.gave_up)
            self.sim.submit(self.link_job(job.link, after=prev.id))
        elif self.policy == "reactive" and job.link + 1 < self.links:
            self.sim.submit(self.link_job(job.link + 1))

    def start(self) -> None:
        first = self.link_job(0)
        self.sim.submit(first)
        if self.policy == "afterok":
            prev = first
            for i in range(1, self.links):
                prev = self.link_job(i, after=prev.id)
                self.sim.submit(prev)


def chain_figures(chain: list[Job], links: int, link_hours: float, chain_start_h: float, policy: str) -> dict:
    """Idle gaps between links, queue time, overlap and makespan of a finished chain (hours, node-hours)."""
    work, overlap = {}, 0.0  # link -> (when its work began, when it ended); node-hours held idle
    for job in chain:
        held = max(0.0, job.end - job.start - (0.0 if job.gave_up else link_hours))  # rounding: never < 0
        overlap += held * job.nodes
        if not job.gave_up:
            work[job.link] = (job.end - link_hours, job.end)
    gaps = [work[i + 1][0] - work[i][1] for i in range(links - 1)]
    first_wait = work[0][0] - chain_start_h
    return {"policy": policy, "idle_gap_h": gaps, "total_idle_h": sum(gaps), "first_wait_h": first_wait,
            "queue_h": first_wait + sum(gaps), "makespan_h": work[links - 1][1] - chain_start_h,
            "overlap_node_h": overlap, "tries": len(chain),
            "links": [{"link": j.link, "submit": j.submit, "eligible": j.eligible, "start": j.start, "end": j.end,
                       "nodes": j.nodes} for j in chain]}


def _check(policy, priority, links, link_nodes, nodes, decide=None, submit_at=None) -> None:
    """Name the first bad argument."""
    if policy not in POLICIES + DRIVEN:
        raise SpecError("policy", f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES + DRIVEN)}")
    if policy == "decide" and not callable(decide):
        raise SpecError("decide", f"policy 'decide' needs a function decide(view) -> bool, got {decide!r}")
    if policy == "replay" and (not isinstance(submit_at, (list, tuple)) or len(submit_at) != links - 1
                               or not all(isinstance(t, (int, float)) and math.isfinite(t) for t in submit_at)):
        raise SpecError("submit_at", f"policy 'replay' needs the {links - 1} submit times of links 1..{links - 1} "
                                     f"in hours, got {submit_at!r}")
    if priority not in PRIORITIES:
        raise SpecError("priority", f"unknown priority {priority!r}; choose one of: {', '.join(PRIORITIES)}")
    if links < 2:
        raise SpecError("links", f"a chain needs at least 2 links, got {links}")
    if not 1 <= link_nodes <= nodes:
        raise SpecError("link_nodes", f"{link_nodes} nodes do not fit a {nodes}-node cluster")


def compare_policies(nodes: int = 32, days: float = 4.0, load: float = 0.9, seed: int = 0,
                     policies: tuple = POLICIES, **chain) -> dict:
    """`simulate` each policy on the same seeded trace; {policy: figures, "trace": its summary}."""
    trace = background_trace(nodes, days, load, seed)
    out = {p: simulate(trace, nodes, p, **chain) for p in policies}
    work = sum(j.nodes * j.runtime for j in trace)
    out["trace"] = {"jobs": len(trace), "nodes": nodes, "days": days, "offered_load": work / (nodes * days * 24),
                    "seed": seed}
    return out
