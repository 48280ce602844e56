"""The `Run` handle: what a notebook cell, a widget and the CLI hold while a run goes on.

    run = launch(spec)            # returns at once
    run.status                    # pending | running | succeeded | failed | stopped | preempted
    run.events(since=0)           # every event so far (new ones: pass the count you already have)
    run.logs(rank)                # a rank's output (None: the launcher's own)
    summary = run.wait(timeout)   # raises RunFailed (naming the rank and its error) or RunTimeout
    run.stop()                    # ends every process of the run

A launcher subclass supplies `_backend_state()` (is the process/job still there, did it fail?) and
`_cancel()`. Everything else — failure detection from error events and vanished ranks, cleanup, summaries —
lives here once.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path

import psutil

from ..errors import RunFailed, RunTimeout
from .event_types import EVENTS
from .events import EventReader
from .metrics import summarize
from .procs import PEER_GRACE_S, alive, kill_processes

ACTIVE = ("pending", "running")
POLL_S = 0.2


class Run:
    """A launched run, observed through its event files and its launcher."""

    launcher = "base"

    def __init__(self, spec, run_dir, reader: EventReader | None = None):
        self.spec = spec
        self.run_dir = Path(run_dir)
        # made by the launcher before any rank starts (see prepare_run_dir), so earlier attempts' lines are skipped
        self._reader = reader or EventReader(self.run_dir, from_now=True)
        self._state = "pending"
        self.error: str | None = None
        self.failed_rank: int | None = None
        self._rank_procs: dict[int, psutil.Process] = {}
        self._started = time.time()
        self._ended: float | None = None
        self._peer_seen: float | None = None  # when a peer's connection error was first the only failure known

    # -- for subclasses ---------------------------------------------------------------------------
    def _backend_state(self) -> tuple[str, str | None, int | None]:
        """(pending|running|succeeded|failed, failure message or None, failed rank or None)."""
        raise NotImplementedError

    def _cancel(self) -> None:
        """End every process of the run (idempotent)."""
        raise NotImplementedError

    # -- observing --------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """pending, running, succeeded, failed, stopped or preempted (polls when still active)."""
        if self._state in ACTIVE:
            self.poll()
        return self._state

    def poll(self) -> str:
        """Read new events and the launcher's state; fail the run as soon as any rank is known to have failed."""
        if self._state not in ACTIVE:
            return self._state
        new = self._reader.poll()
        self._track_ranks(new)
        # Root causes first: a rank's own error, then a rank that vanished, then what the launcher says about a
        # rank, and only then errors that ranks saw because a peer died.
        # An elastic or forward-recovering run outlives a lost rank: only its launcher's verdict counts.
        tolerant = self.tolerates_rank_loss
        failure = None if tolerant else self._first_error_event(primary=True) or self._vanished_rank()
        state, message, rank = self._backend_state()
        if failure is None and state == "failed" and rank is not None:
            failure = (message, rank)
        if failure is None and not tolerant:
            failure = self._first_error_event(primary=False)
            if failure is not None and state != "failed":  # the socket of a dying rank closes before its
                self._peer_seen = self._peer_seen or time.monotonic()  # process can be seen gone: wait for it
                if time.monotonic() - self._peer_seen < PEER_GRACE_S:
                    failure = None
        if failure is None and state == "failed":
            failure = (message or "the launcher reported a failure", rank)
        if failure is not None:
            self._fail(*failure)
        elif state == "succeeded" and self._all_preempted():  # every rank saved an emergency checkpoint and left
            self._finish("preempted")
        elif state == "succeeded" and not self._all_ended():
            self._reader.poll()  # last lines may land just after the processes exit
            if self._all_ended():
                self._finish("succeeded")
            else:
                self._fail(f"the processes exited but ranks {self._missing_end()} never reported the end of "
                           f"training; see {self.run_dir / 'logs'}", None)
        elif state == "succeeded":
            self._finish("succeeded")
        else:
            self._state = state
        return self._state

    def events(self, since: int = 0, type: str | None = None, rank: int | None = None) -> list[dict]:  # noqa: A002
        """Events read so far, from index `since` (poll first for the newest); only those of one `type` (a name
        in scalelab.run.event_types.EVENTS) and/or one `rank` when given. `since` counts all events, unfiltered."""
        self.poll()
        if type is not None and type not in EVENTS:
            raise ValueError(f"events(type={type!r}): no such event type; the engine writes {', '.join(EVENTS)}")
        return [e for e in self._reader.all[since:]
                if (type is None or e.get("type") == type) and (rank is None or e.get("rank") == rank)]

    def follow(self, kind: str | None = None, poll_s: float = 0.05, timeout: float | None = None):
        """Yield the run's events (of type `kind`, or all) as they are written, until the run has ended and every
        event is read; `timeout` (seconds) ends the wait with TimeoutError. For code that acts on a run while it
        runs: an HPO objective reporting each `eval` event to its pruner, a monitor."""
        seen, deadline = 0, None if timeout is None else time.monotonic() + timeout
        while True:
            ended = self.poll() not in ACTIVE
            new = self.events(since=seen)
            seen += len(new)
            for event in new:
                if kind is None or event.get("type") == kind:
                    yield event
            if ended and not new:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.run_dir} still running after {timeout:g} s")
            if not new:
                time.sleep(poll_s)

    def logs(self, rank: int | None = None, tail: int | None = None) -> str:
        """A rank's output (stdout and stderr), or the launcher's own with rank=None; `tail` lines at most."""
        path = self.run_dir / "logs" / (f"rank-{rank}.log" if rank is not None else "launcher.log")
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-tail:]) if tail else text

    def summary(self) -> dict:
        """Throughput, loss, time breakdown and status, from the events so far."""
        self.poll()
        s = summarize(self._reader.all, self.spec.world_size)
        s.update(status=self._state, launcher=self.launcher, strategy=self.spec.strategy, run_dir=str(self.run_dir),
                 elapsed_s=(self._ended or time.time()) - self._started, error=self.error,
                 failed_rank=self.failed_rank)
        return s

    # -- waiting and stopping ----------------------------------------------------------------------
    def wait(self, timeout: float | None = None, check: bool = True) -> dict:
        """Block until the run ends; returns the summary. Raises RunFailed (check=True) or RunTimeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() in ACTIVE:
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout(f"run {self.run_dir.name} still {self._state} after {timeout:g} s; "
                                 "call run.stop() to end it, or wait longer")
            time.sleep(POLL_S)
        if check and self._state == "failed":
            raise RunFailed(self.error, rank=self.failed_rank, run_dir=str(self.run_dir))
        return self.summary()

    def stop(self) -> None:
        """End the run now: every process of it, including ranks the launcher started."""
        if self._state in ACTIVE:
            self._finish("stopped")
        self._cleanup()

    def _finish(self, state: str) -> None:
        self._state = state
        self._ended = time.time()

    def _fail(self, message: str, rank: int | None) -> None:
        self.error, self.failed_rank = message, rank
        self._finish("failed")
        self._cleanup()

    def _cleanup(self) -> None:
        self._cancel()
        kill_processes([p for p in self._rank_procs.values() if not isinstance(p, _Gone)])

    # -- failure detection -------------------------------------------------------------------------
    def _track_ranks(self, new_events) -> None:
        here = socket.gethostname()
        for e in new_events:
            if e["type"] == "start" and e.get("host") == here:
                try:
                    self._rank_procs[e["rank"]] = psutil.Process(e["pid"])
                except psutil.NoSuchProcess:
                    self._rank_procs[e["rank"]] = _Gone(e["pid"])  # died before we first looked

    def _first_error_event(self, primary: bool):
        """The earliest error event that is (primary) or is not (secondary) a peer's communication failure."""
        errors = [e for e in self._reader.all if e["type"] == "error" and bool(e.get("peer_failure")) != primary]
        if not errors:
            return None
        e = min(errors, key=lambda e: e["t"])
        return f"rank {e['rank']} failed: {e['error']}: {e['message']}", e["rank"]

    def _vanished_rank(self):
        """A rank on this host whose process is gone without an end or error event: killed or crashed hard."""
        final = ("end", "error", "preempted")
        ended = {e["rank"] for e in self._reader.all if e["type"] in final}
        for rank, proc in sorted(self._rank_procs.items()):
            if rank not in ended and not _alive(proc):
                self._reader.poll()  # it may have written its end event just before exiting
                if any(e["rank"] == rank and e["type"] in final for e in self._reader.all):
                    continue
                return f"rank {rank} (pid {proc.pid}) died without reporting an error: killed by a signal or " \
                       f"os._exit; see {self.run_dir / 'logs'}", rank
        return None

    @property
    def tolerates_rank_loss(self) -> bool:
        """True for runs that recover from a lost rank: torchrun restarts (world.max_restarts) or forward
        recovery (fault.recovery) — their ranks' errors and deaths are recovered from, not the run's end."""
        return self.spec.world.max_restarts > 0 or self.spec.fault.recovery == "forward"

    def lost_ranks(self) -> set[int]:
        """Ranks the survivors left behind (forward recovery's `recovered` events name them)."""
        return {r for e in self._reader.all if e["type"] == "recovered" for r in e.get("lost", [])}

    def _all_preempted(self) -> bool:
        """Every rank's latest start/end/preempted event is 'preempted' (a requeued attempt starts them again)."""
        last = {}
        for e in self._reader.all:
            if e["type"] in ("start", "end", "preempted"):
                last[e["rank"]] = e["type"]
        return all(last.get(r) == "preempted" for r in range(self.spec.world_size))

    def _all_ended(self) -> bool:
        return not self._missing_end()

    def _missing_end(self) -> list[int]:
        ended = {e["rank"] for e in self._reader.all if e["type"] == "end"} | self.lost_ranks()
        return [r for r in range(self.spec.world_size) if r not in ended]

    def __repr__(self):
        return f"<{type(self).__name__} {self.run_dir} {self._state}>"


class _Gone:
    """Stands for a rank process that had already exited when its start event was read."""

    def __init__(self, pid: int):
        self.pid = pid


def _alive(proc) -> bool:
    return not isinstance(proc, _Gone) and alive(proc)
