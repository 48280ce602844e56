"""The engine's side of instructor injection (run/inject.py): a kill or a preemption the instructor issued, acted on
at the top of a step, before the forward pass.

A `fault` event goes first, with source "instructor" and the record's id, so the run's evidence shows what hit it
and when. Then kill: SIGKILL to this rank, exactly like an injected FaultSpec kill (train/faults.py); preempt:
SIGTERM to this rank, so the engine's own preemption path takes over (with checkpoint.on_signal: the ranks vote,
save an emergency checkpoint and exit cleanly, train/preempt.py; without it the SIGTERM ends the rank, as a real
preemption would).
"""
from __future__ import annotations

import os
import signal
import time

from ..run.inject import ENV_VAR, InjectionWatch


def launch_started_at() -> float:
    """When this rank's process started (Unix time, at most a clock tick late): a record issued before it belongs to
    an earlier launch. From /proc/self/stat's start time on the boot clock (psutil's create_time adds /proc/stat's
    boot time, whole seconds: up to 1 s early); without /proc, the time of asking."""
    now = time.time()
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        started_ticks = int(fields[19])  # field 22: starttime, clock ticks after boot
        # rounded up to the next tick: a record written just before the process started is never taken for this
        # launch's (one written within a tick after its start is missed, which no instructor can tell apart)
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - (started_ticks + 1) / os.sysconf("SC_CLK_TCK")
        return min(now, now - since)
    except (OSError, ValueError, IndexError, AttributeError):
        return now


def instructor_injection(spec, info):
    """A function of (step, events) that acts on a due record, when $SCALELAB_INJECT_FILE names a spool file;
    None otherwise, so a run without one pays one test of None per step."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    watch = InjectionWatch(path, launch_started_at(), info.rank, info.world_size, spec.output_dir)

    def act(step: int, events) -> None:
        record = watch.due(step)
        if record is None:
            return
        events.emit("fault", kind=record["kind"], source="instructor", id=record["id"], step=step, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL if record["kind"] == "kill" else signal.SIGTERM)
    return act


__all__ = ["instructor_injection", "launch_started_at"]
