"""Injected faults, for the resilience lessons and the launcher tests: what a failing rank does to the run.

A `FaultSpec` names the rank (or a whole node: rank -1), the step and the kind. The fault fires once, in the
first attempt only: a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) or a relaunch that resumed past the step
does not fail again, so a recovered run can finish.

Kind slow (a straggler) sleeps `slow_s` every step from `step` on, in the phase `fault.phase` names: step (before
the step, outside its step_s: only the other ranks' waits show it), data (in the rank's batch fetch: its data_s) or
compute (before its forward: its compute_s). The last two are what a root-cause exercise reads back from the step
events (experiments/root_cause.py); `phase_delay` gives the loop a sleeper for them, or None so a run without one
pays nothing.
"""
from __future__ import annotations

import os
import signal
import time


def node_index() -> int:
    """This rank's node index: Slurm's SLURM_NODEID, torchrun's GROUP_RANK, else 0."""
    for key in ("SLURM_NODEID", "GROUP_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def first_attempt() -> bool:
    """False in a worker that torchrun restarted after a failure."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


def targets(fault, rank: int) -> bool:
    """Whether `fault` is meant for this rank (on this node)."""
    if fault.kind == "none" or not first_attempt():
        return False
    if fault.node != -1 and fault.node != node_index():
        return False
    return fault.rank in (-1, rank)


def maybe_inject(fault, rank: int, step: int, events=None) -> None:
    """Misbehave as `fault` says when this rank and step are its target; a `fault` event goes first."""
    if not targets(fault, rank):
        return
    if fault.kind == "slow":
        if fault.phase == "step" and step >= fault.step:  # a straggler: every step from `step` on is late
            time.sleep(fault.slow_s)
        return
    if fault.step != step:
        return
    if events is not None:
        events.emit("fault", kind=fault.kind, step=step, node=node_index(), pid=os.getpid())
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raised at step {step}")
    if fault.kind == "exit":
        os._exit(3)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: stop answering, like a rank stuck on a dead file system
        time.sleep(3600)


def phase_delay(fault, rank: int, phase: str):
    """For a slow fault in `phase` (data or compute) aimed at this rank: a function of the step that sleeps
    `slow_s` from `fault.step` on; None otherwise, so the loop's check costs one test of None."""
    if fault.kind != "slow" or fault.phase != phase or not targets(fault, rank):
        return None

    def delay(step: int) -> None:
        if step >= fault.step:
            time.sleep(fault.slow_s)
    return delay


__all__ = ["maybe_inject", "phase_delay", "targets", "node_index", "first_attempt"]
