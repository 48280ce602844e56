"""Lab 08 on the namespace cluster: a rank lost vs a whole node lost, and which checkpoint tier each restart reads.

    story = node_loss(spec, state_dir="/tmp/scalelab-test-nodes", crash_after=5, lose_after=12)
    story["attempts"]      # three Slurm jobs: rank 1 SIGKILLed, node1 lost, the finish on the survivor
    story["attempts"][1]["tier"], story["attempts"][2]["tier"]   # "local", "shared"

`spec` is a 2-node run (`world.nodes = 2`, one rank per node, launcher slurm) with `checkpoint.mode = "multilevel"`:
rank 0 (on node1) writes each checkpoint to its node's /dev/shm, a background thread copies it to the shared
`checkpoints/`. On this cluster every node has its own /dev/shm (a tmpfs in its mount namespace), so the local tier
really is node1's memory. The story, on real processes and a real Slurm:

1. rank 1 (node2) is SIGKILLed: the job fails, both nodes live on. The relaunch (same shape, same run directory)
   finds the newest checkpoint in node1's /dev/shm and reads the local tier.
2. node1 is lost (`NodesCluster.lose_node`: every process on it SIGKILLed, its /dev/shm gone, slurmctld told it is
   DOWN). Slurm requeues the job ("requeue job due to failure of node node1": batch jobs are requeueable by
   default), but it asks for 2 nodes and only node2 is up, so it would wait for node1. Either the run handle hears
   of the lost node first (rank 1's peer error) and fails the run naming it, or it sees the job pending again; the
   job is cancelled either way (status failed or stopped). The relaunch runs as 1 node x 2 ranks (the same world
   size) on node2, whose /dev/shm never held this run: it reads the shared tier — and loses the steps since the
   newest checkpoint that reached it.
3. node1 is restored (`restore_node`) before this returns, even when something failed after it was lost: the
   cluster is shared.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

from ..ckpt import read_manifest
from ..errors import SpecError
from .resilience import signal_rank


def _rank0(run) -> list[dict]:
    return [e for e in run.events() if e["rank"] == 0]


def _attempt_events(run) -> list[dict]:
    """Rank 0's events of this run's last attempt (the event files of a run directory collect every attempt)."""
    events = _rank0(run)
    starts = [i for i, e in enumerate(events) if e["type"] == "start"]
    return events[starts[-1]:] if starts else []


def wait_until(run, done, what: str, timeout: float = 180) -> list[dict]:
    """Poll `run` until `done(events of rank 0's last attempt)`; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = _attempt_events(run)
        if done(events):
            return events
        if run.status not in ("pending", "running"):
            break
        time.sleep(0.2)
    raise TimeoutError(f"{run.run_dir}: rank 0 did not reach {what} (run {run.status}) within {timeout:g} s")


def _steps(events, kind: str) -> list[int]:
    return [e["step"] for e in events if e["type"] == kind]


def tier_of(path, run_dir) -> str | None:
    """Which tier a `resumed_from` path is: "shared" (the run directory's checkpoints/), "local", or None."""
    if not path:
        return None
    return "shared" if Path(path).parent == Path(run_dir) / "checkpoints" else "local"


def _attempt(run, events: list[dict], how: str, summary: dict) -> dict:
    start = next(e for e in events if e["type"] == "start")
    info = run.job_info()  # Slurm's own view: a job whose node failed was requeued (Restarts=1) before we cancelled
    return {"how": how, "job_id": run.job_id, "status": summary["status"], "host": start["host"],
            "slurm_state": info.get("JobState"), "slurm_restarts": int(info.get("Restarts", 0)),
            "start_step": start["start_step"], "resumed_from": start["resumed_from"],
            "tier": tier_of(start["resumed_from"], run.run_dir), "error": summary.get("error"),
            "saved_local": _steps(events, "checkpoint"), "flushed_shared": _steps(events, "checkpoint_done"),
            "last_step": max(_steps(events, "step"), default=start["start_step"])}


def _end_lost(run, timeout: float = 90) -> dict:
    """After the node loss: the run's own verdict (it names the lost node when a rank's peer reported it first), or
    a stop once Slurm has requeued the job for the node failure (PENDING again with Restarts > 0: it would wait for
    the lost node to come back). The run's summary either way."""
    deadline = time.monotonic() + timeout
    while run.status in ("pending", "running"):
        info = run.job_info()
        if info.get("JobState") == "PENDING" and int(info.get("Restarts", 0)) > 0:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {run.job_id} neither failed nor was requeued within {timeout:g} s of the node "
                               f"loss (Slurm says {info.get('JobState')}, {info.get('Reason')})")
        time.sleep(0.5)
    run.stop()  # the requeued job would start again from the checkpoint once the node is back: not here
    return run.summary()


def _check_story(spec) -> None:
    """The story needs rank 0 on a node of its own that can be lost, writing multilevel checkpoints."""
    if spec.launcher != "slurm":
        raise SpecError("launcher", f"node_loss runs Slurm jobs on the namespace cluster, got {spec.launcher!r}: "
                                    "set launcher='slurm'")
    if spec.world.nodes < 2:
        raise SpecError("world.nodes", f"node_loss loses one node of several, got {spec.world.nodes}: set 2")
    if spec.checkpoint.mode != "multilevel" or not spec.checkpoint.every_steps:
        raise SpecError("checkpoint.mode", f"node_loss compares the node-local and shared tiers, got mode "
                                           f"{spec.checkpoint.mode!r} every {spec.checkpoint.every_steps} steps: set "
                                           "checkpoint.mode='multilevel' and checkpoint.every_steps > 0")


def node_loss(spec, state_dir: str | None = None, crash_after: int = 5, lose_after: int = 12, lose: str = "node1",
              timeout: float = 180) -> dict:
    """The three attempts of the story above (each: job id, status, rank 0's host, start step, resumed_from and
    its tier, checkpoints saved locally and flushed to the shared tier, last step), the shared tier's steps when
    the node was lost and the run directory. `crash_after`/`lose_after`: rank 0's step (in the attempt) after
    which rank 1 is killed / the node is lost; the node is lost only once a checkpoint of that attempt has reached
    the shared tier. `lose` is rank 0's node (the first of the job's nodes: node1 on an idle cluster)."""
    import os

    from ..cluster.nodes import NodesCluster
    from ..launch import launch
    _check_story(spec)
    cluster = NodesCluster(state_dir) if state_dir else NodesCluster()
    env = {**os.environ, **cluster.env()}
    attempts, run, lost = [], None, False
    try:
        run = launch(spec, env=env)  # 1. a rank lost: its node lives on
        signal_rank(run, rank=1, after_step=crash_after, sig=signal.SIGKILL, timeout=timeout)
        attempts.append(_attempt(run, _attempt_events(run), "rank 1 killed", run.wait(timeout=60, check=False)))

        run = launch(spec, env=env)  # 2. relaunch on both nodes: node1's /dev/shm still holds the local tier
        started = wait_until(run, lambda ev: any(e["type"] == "start" for e in ev), "its start", timeout)
        first = started[0]["start_step"]
        wait_until(run, lambda ev: any(s > first for s in _steps(ev, "checkpoint_done"))
                   and max(_steps(ev, "step"), default=0) >= first + lose_after,
                   f"step {first + lose_after} with a checkpoint in the shared tier", timeout)
        lost_t, lost = time.time(), True
        cluster.lose_node(lose)
        summary = _end_lost(run)
        shared_at_loss = [e["step"] for e in read_manifest(run.run_dir / "checkpoints")]
        attempts.append(_attempt(run, _attempt_events(run), f"{lose} lost", summary))

        survivor = spec.with_overrides({"world.nodes": spec.world.nodes - 1,
                                        "world.workers_per_node": spec.world.workers_per_node * spec.world.nodes
                                        // (spec.world.nodes - 1)})
        run = launch(survivor, env=env)  # 3. on the survivor: the same world size, the shared tier
        summary = run.wait(timeout=timeout, check=False)
        attempts.append(_attempt(run, _attempt_events(run), "finish on the survivor", summary))
        hosts = sorted({e["host"] for e in run.events() if e["type"] == "start" and e["t"] > lost_t})
    finally:
        if run is not None:
            run.stop()
        if lost:  # even when something failed after it: the cluster is shared
            cluster.restore_node(lose)
    return {"attempts": attempts, "lost_node": lose, "shared_at_loss": shared_at_loss, "survivor_hosts": hosts,
            "run_dir": str(run.run_dir), "status": attempts[-1]["status"]}


__all__ = ["node_loss", "wait_until", "tier_of"]
