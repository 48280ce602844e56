"""Preemption: a signal (SIGTERM from a scheduler or a stop, SIGUSR1 from `sbatch --signal=B:USR1@N` passed on by
the batch script) becomes an emergency checkpoint and a clean exit, so a preempted job loses no work.

The handler only notes the signal; the loop asks `agreed(strategy)` after each step. Ranks may receive the signal
a step apart (srun delivers it to each task separately), so they vote with one small all-reduce per step: all stop
after the same step, save one consistent checkpoint, and exit 0. A relaunch (or Slurm's requeue) resumes from it
exactly like from any other checkpoint. Off unless `checkpoint.on_signal` is set: the vote costs one collective per
step.

A handler of the student's own (lab 08): with `checkpoint.on_signal` set and the environment variable
SCALELAB_PREEMPT_HANDLER = "module:Class" in the ranks' environment, every rank builds `Class()` instead (it
installs its own signal handlers and keeps the name of the first signal in `.signal`), and the loop's vote after
each step is its `agreed(device)`: a collective over torch.distributed whose tensors live on `device`, True on
every rank to stop after this step. The module is imported like a spec's `module:function` code (the run's code/
folder first: `experiments.resilience.preempt_with_handler` copies it there, so the start event names its
SHA-256). DDP-family strategies only (the vote uses torch.distributed).

Runs a student's server job interrupted (its walltime: `scalelab.hub.walltime` passes the job's end signal on to
the runs the server started, and notes each in WALLTIME_REGISTRY) are offered for resuming by `interrupted_runs`
and `resume_spec` (the widget `scalelab.widgets.ResumeOffer` shows them and launches one).
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HANDLER_ENV = "SCALELAB_PREEMPT_HANDLER"
"""The environment variable naming a preemption handler class of the student's own ("module:Class")."""
WALLTIME_REGISTRY = Path(".scalelab") / "interrupted.jsonl"
"""Below the home: one JSON line per run a server job's end interrupted (written by scalelab.hub.walltime, which
may not import this wing and keeps its own copy of the name: tests/test_hub_walltime.py holds them equal)."""


class Preemption:
    """Notes SIGTERM/SIGUSR1 and lets the ranks agree to stop after the same step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._signal: str | None = None
        self.handler = None
        """The student's handler object (SCALELAB_PREEMPT_HANDLER), None for the engine's own."""
        if enabled and os.environ.get(HANDLER_ENV):
            from ..run.user_code import resolve_code
            self.handler = resolve_code(os.environ[HANDLER_ENV], HANDLER_ENV)()
        elif enabled:
            for sig in SIGNALS:
                signal.signal(sig, self._note)

    @property
    def signal(self) -> str | None:
        """Name of the first signal received (SIGTERM or SIGUSR1), None while none came."""
        if self.handler is not None:
            return getattr(self.handler, "signal", None)
        return self._signal

    def _note(self, signum, _frame) -> None:
        self._signal = self._signal or signal.Signals(signum).name

    def agreed(self, strategy) -> bool:
        """True on every rank once any rank got a signal (a collective: call it on all ranks, every step)."""
        if not self.enabled:
            return False
        if self.handler is not None:
            device = strategy.device if getattr(strategy, "backend", None) == "nccl" else "cpu"
            return bool(self.handler.agreed(device))
        return strategy.mean(1.0 if self._signal else 0.0) > 0.0

    def restore_defaults(self) -> None:
        """Default actions again (a second SIGTERM while exiting ends the process)."""
        if self.enabled:
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)


@dataclass
class Interrupted:
    """A run that a server job's end stopped, and the checkpoint it resumes from."""

    run_dir: Path
    """The run's folder (its spec.json, events/ and checkpoints/)."""
    step: int
    """The step the run reached: its emergency checkpoint's (0 when it saved none)."""
    total_steps: int
    """The steps the run was asked for."""
    checkpoint: str
    """The newest complete checkpoint ('' when there is none: resuming starts from scratch)."""
    job_id: str
    """The server job whose end interrupted it."""
    signal: str
    """The signal the server passed on (SIGUSR1: Slurm's warning before the walltime; SIGTERM: the end itself)."""
    time: float
    """When the server passed it on (Unix time)."""


def _last_run_event(run_dir: Path) -> dict | None:
    """Rank 0's latest start, end or preempted event (None without events)."""
    path = run_dir / "events" / "rank-0.jsonl"
    last = None
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # a line a kill cut short
            continue
        if isinstance(event, dict) and event.get("type") in ("start", "end", "preempted"):
            last = event
    return last


def interrupted_runs(home: str | os.PathLike | None = None) -> list[Interrupted]:
    """The runs a server job's end interrupted and that have not gone on since (newest first): each listed in
    `home`/WALLTIME_REGISTRY, its folder still there, rank 0's last word 'preempted'."""
    from ..ckpt import read_manifest
    registry = Path(home or Path.home()) / WALLTIME_REGISTRY
    try:
        lines = registry.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    seen, found = set(), []
    for line in reversed(lines):
        try:
            note = json.loads(line)
            run_dir = Path(note["run_dir"])
        except (ValueError, KeyError, TypeError):
            continue
        if run_dir in seen:
            continue
        seen.add(run_dir)
        last = _last_run_event(run_dir)
        if not last or last["type"] != "preempted":
            continue  # resumed since, finished, or never got as far as the signal
        try:
            entries = read_manifest(run_dir / "checkpoints")
            total = int(json.loads((run_dir / "spec.json").read_text(encoding="utf-8")).get("steps", 0))
        except Exception:  # a damaged manifest or spec: nothing to resume from
            continue
        newest = entries[-1] if entries else {}
        name = newest.get("file") or ""
        found.append(Interrupted(run_dir=run_dir, step=int(newest.get("step", 0)), total_steps=total,
                                 checkpoint=str(run_dir / "checkpoints" / name) if name else "",
                                 job_id=str(note.get("job_id") or ""),
                                 signal=str(note.get("signal", "")), time=float(note.get("time", 0.0))))
    return found


def resume_spec(run_dir: str | os.PathLike):
    """The spec that continues the run in `run_dir` from its newest checkpoint: its own spec.json, same folder,
    checkpoint.resume on."""
    from ..run.spec import load
    run_dir = Path(run_dir).resolve()
    spec = load(run_dir / "spec.json")
    return spec.with_overrides({"output_dir": str(run_dir), "checkpoint.resume": True})


__all__ = ["Preemption", "SIGNALS", "HANDLER_ENV", "WALLTIME_REGISTRY", "Interrupted", "interrupted_runs",
           "resume_spec"]
