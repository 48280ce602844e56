"""Profiling a training run: torch.profiler traces per rank, phase ranges, Horovod's timeline.

With `spec.profile.enabled` every rank records its steps with torch.profiler on a schedule (wait, warm-up, active
steps) and writes `<run dir>/traces/rank-<r>.json`, a Chrome trace (chrome://tracing, https://ui.perfetto.dev,
`scalelab.experiments.profiling.load_trace`). The loop marks its phases:

    profiler = StepProfiler(spec, info.rank, device, events)   # before the strategy starts (Horovod reads env)
    profiler.start()
    for step in ...:
        with profiler.phase("data"): ...
        with profiler.phase("forward"): ...
        with profiler.phase("backward"): ...
        with profiler.phase("optimizer"): ...
        profiler.step()
    profiler.stop()

Each phase is a `record_function` range named `scalelab:<phase>` in the trace and, on CUDA, an NVTX range of the
same name (what Nsight Systems shows). Profiling off, every call is a no-op: the loop pays nothing.
With strategy horovod, HOROVOD_TIMELINE is set before `hvd.init()` in the rank itself, so the timeline is written
whatever launcher started the rank (horovodrun, mpirun, srun); Horovod's coordinator (rank 0) writes it.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

PHASES = ("data", "forward", "backward", "optimizer")
"""The step phases the loop marks, in order."""
PREFIX = "scalelab:"
"""Phase ranges are named PREFIX + phase in the trace."""


def trace_dir(run_dir) -> Path:
    """Where a run's traces go: next to its events."""
    return Path(run_dir) / "traces"


def trace_path(run_dir, rank: int) -> Path:
    """Rank `rank`'s Chrome trace."""
    return trace_dir(run_dir) / f"rank-{rank}.json"


def horovod_timeline_path(run_dir) -> Path:
    """The Horovod timeline of a profiled horovod run (written by rank 0)."""
    return trace_dir(run_dir) / "horovod-timeline.json"


class StepProfiler:
    """torch.profiler on the spec's schedule plus named phase ranges; a no-op when profiling is off."""

    def __init__(self, spec, rank: int, device: torch.device, events=None):
        self.cfg, self.rank, self.device, self.events = spec.profile, rank, device, events
        self.enabled = bool(self.cfg.enabled)
        self.path = trace_path(spec.output_dir, rank)
        self._prof, self._first = None, 1
        self._nvtx = self.enabled and device.type == "cuda"
        if self.enabled:
            trace_dir(spec.output_dir).mkdir(parents=True, exist_ok=True)
            if spec.strategy == "horovod":  # read by hvd.init(), which has not run yet
                os.environ["HOROVOD_TIMELINE"] = str(horovod_timeline_path(spec.output_dir))
                os.environ["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"

    def start(self, start_step: int = 0) -> "StepProfiler":
        """Start recording on the schedule (call once, before the first step; `start_step` after a resume)."""
        self._first = start_step + self.cfg.wait_steps + self.cfg.warmup_steps + 1
        if not self.enabled:
            return self
        from torch.profiler import ProfilerActivity, profile, schedule
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        c = self.cfg
        self._prof = profile(activities=activities, record_shapes=c.record_shapes, profile_memory=c.profile_memory,
                             with_stack=c.with_stack, on_trace_ready=self._write,
                             schedule=schedule(wait=c.wait_steps, warmup=c.warmup_steps, active=c.active_steps,
                                               repeat=1))
        self._prof.__enter__()
        return self

    def phase(self, name: str):
        """A context manager marking one phase of the step (record_function + NVTX on CUDA)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return _Phase(PREFIX + name, self._nvtx)

    def step(self) -> None:
        """One optimizer step is over: advance the schedule (the trace is written after the last active step)."""
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        """Stop the profiler (writes the trace if the run ended inside the active steps)."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _write(self, prof) -> None:
        prof.export_chrome_trace(str(self.path))
        if self.events is not None:
            self.events.emit("trace", path=str(self.path), active_steps=self.cfg.active_steps,
                             first_step=self._first)


class _Phase:
    """record_function plus, on CUDA, an NVTX push/pop of the same name."""

    def __init__(self, name: str, nvtx: bool):
        self.name, self.nvtx = name, nvtx
        self._rf = torch.profiler.record_function(name)

    def __enter__(self):
        self._rf.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        return self._rf.__exit__(*exc)


__all__ = ["StepProfiler", "PHASES", "PREFIX", "trace_dir", "trace_path", "horovod_timeline_path"]
