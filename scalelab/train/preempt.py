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
"""
from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HANDLER_ENV = "SCALELAB_PREEMPT_HANDLER"
"""The environment variable naming a preemption handler class of the student's own ("module:Class")."""


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


__all__ = ["Preemption", "SIGNALS", "HANDLER_ENV"]
