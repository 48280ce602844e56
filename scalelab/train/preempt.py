"""Preemption: a signal (SIGTERM from a scheduler or a stop, SIGUSR1 from `sbatch --signal=B:USR1@N` passed on by
the batch script) becomes an emergency checkpoint and a clean exit, so a preempted job loses no work.

The handler only notes the signal; the loop asks `agreed(strategy)` after each step. Ranks may receive the signal
a step apart (srun delivers it to each task separately), so they vote with one small all-reduce per step: all stop
after the same step, save one consistent checkpoint, and exit 0. A relaunch (or Slurm's requeue) resumes from it
exactly like from any other checkpoint. Off unless `checkpoint.on_signal` is set: the vote costs one collective per
step.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Notes SIGTERM/SIGUSR1 and lets the ranks agree to stop after the same step."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.signal: str | None = None
        """Name of the first signal received (SIGTERM or SIGUSR1), None while none came."""
        if enabled:
            for sig in SIGNALS:
                signal.signal(sig, self._note)

    def _note(self, signum, _frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name

    def agreed(self, strategy) -> bool:
        """True on every rank once any rank got a signal (a collective: call it on all ranks, every step)."""
        if not self.enabled:
            return False
        return strategy.mean(1.0 if self.signal else 0.0) > 0.0

    def restore_defaults(self) -> None:
        """Default actions again (a second SIGTERM while exiting ends the process)."""
        if self.enabled:
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)


__all__ = ["Preemption", "SIGNALS"]
