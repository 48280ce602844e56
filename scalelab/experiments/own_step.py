"""A training step of the student's own: mixed precision by hand (autocast, and a GradScaler for fp16), run as a run.

Lab 01's students write `train_step(model, optimizer, x, y, dtype, scaler) -> loss` in `my_step.py`: forward and
loss under `torch.autocast` at `dtype`, backward, the optimizer step (through `scaler` when one is given: fp16),
gradients zeroed. `step_runs` trains the same steps from the same start on the same batches twice, with the lab's
fp32 step and with the student's, each as a run folder with the engine's event files (start, a memory event,
steps, end), so the grader holds what the lab prints against the runs' own evidence:

- the memory event: the bytes autograd kept for backward during the first step, by dtype (autocast that ran keeps
  its 16-bit activations; autocast for the wrong device type silently keeps fp32 ones);
- the end event: the dtypes of the parameters afterwards (autocast casts per operation; the weights stay fp32) and,
  for fp16, how often the step called the scaler's scale, step and update;
- the start event: the SHA-256 of the module that ran (its copy is in the run's code/ folder).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ..data.batches import resumable_batches
from ..data.loader import build_loader
from ..run.events import EventWriter
from ..train.memory import SavedTensorBytes
from ._common import autocast_for, build_workload, sync, train_step
from .own_code import load_own, not_written

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts the calls a training step makes to scale, step and update."""

    def __init__(self, device: str):
        super().__init__(device)
        self.calls = {"scale": 0, "step": 0, "update": 0}

    def scale(self, outputs):
        self.calls["scale"] += 1
        return super().scale(outputs)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


class SavedBytesByDtype(SavedTensorBytes):
    """SavedTensorBytes that also sums the saved bytes by dtype (`by_dtype`: {"torch.float16": bytes, ...})."""

    def __enter__(self):
        self.by_dtype: dict[str, int] = {}
        return super().__enter__()

    def add(self, t: torch.Tensor) -> None:
        before = self.bytes
        super().add(t)
        if self.bytes > before:
            self.by_dtype[str(t.dtype)] = self.by_dtype.get(str(t.dtype), 0) + self.bytes - before


def low_precision_share(saved_bytes: dict) -> float:
    """The share of the saved bytes held in a 16-bit float type."""
    total = sum(saved_bytes.values())
    low = sum(b for d, b in saved_bytes.items() if d in ("torch.float16", "torch.bfloat16"))
    return low / total if total else 0.0


def _lab_step(model, optimizer, x, y, dtype, scaler) -> float:
    """The lab's fp32 step (dtype and scaler unused), the reference the student's step is held against."""
    return train_step(model, optimizer, x, y)


def step_runs(spec, ref: str, out_dir, precision: str = "fp16", steps: int = 8) -> dict:
    """Train `steps` steps of `spec`'s workload with the lab's fp32 step (run folder out_dir/fp32) and with the step
    `ref` ("module:function") at `precision` (out_dir/<precision>), from the same start on the same batches.
    Returns {"fp32": run, "yours": run, "precision", "loss_diff"}, each run {run_dir, losses, final_loss, step_ms,
    saved_bytes, low_precision_share, param_dtypes, scaler_calls}."""
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r} must be one of {', '.join(DTYPES)}: the step under test is a "
                         "mixed-precision one")
    out_dir = Path(out_dir)
    reference = _one_run(spec, out_dir / "fp32", _lab_step, "fp32", {}, steps)
    fn, code = load_own(ref, out_dir / precision)
    yours = _one_run(spec, out_dir / precision, fn, precision, code, steps, ref)
    return {"fp32": reference, "yours": yours, "precision": precision,
            "loss_diff": abs(yours["final_loss"] - reference["final_loss"])}


def _one_run(spec, run_dir: Path, step_fn, precision: str, code: dict, steps: int, ref: str = "") -> dict:
    wl = build_workload(spec)  # seeded: both runs start from the same weights
    dtype = DTYPES.get(precision)
    scaler = CountingScaler(wl.device.type) if precision == "fp16" else None
    batch = spec.optim.batch_per_worker  # the engine's loader for one rank of one: the same batches in both runs
    batches = resumable_batches(build_loader(wl.dataset, spec.data, batch, 0, 1, spec.seed), 0, wl.device)
    events, started, losses, busy = EventWriter(run_dir, 0), time.perf_counter(), [], 0.0
    events.emit("start", world_size=1, local_rank=0, start_step=0, total_steps=steps, strategy="single",
                device=str(wl.device), precision=precision, step_function=ref or "the lab's fp32 step", code=code)
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = next(batches)
            data_s = time.perf_counter() - t0
            with (SavedBytesByDtype() if step == 0 else contextlib.nullcontext()) as saved:
                try:
                    loss = float(step_fn(wl.model, wl.optimizer, x, y, dtype, scaler))
                except NotImplementedError:
                    raise not_written(ref) from None
            sync(wl.device)
            step_s = time.perf_counter() - t0
            if step == 0:
                saved_bytes = dict(saved.by_dtype)
                events.emit("memory", step=1, saved_bytes=saved_bytes, activation_bytes=saved.bytes)
            losses.append(loss)
            busy += step_s
            events.emit("step", step=step + 1, loss=loss, samples=batch, step_s=step_s, data_s=data_s,
                        compute_s=step_s - data_s, comm_s=0.0, samples_per_s=batch / step_s)
        dtypes = sorted({str(p.dtype) for p in wl.model.parameters()})
        calls = dict(scaler.calls) if scaler else None
        events.emit("end", steps=steps, final_loss=losses[-1], elapsed_s=time.perf_counter() - started,
                    param_dtypes=dtypes, scaler_calls=calls)
    finally:
        events.close()
        batches.close()
    return {"run_dir": str(run_dir), "losses": losses, "final_loss": losses[-1], "saved_bytes": saved_bytes,
            "low_precision_share": low_precision_share(saved_bytes), "param_dtypes": dtypes, "scaler_calls": calls,
            "step_ms": 1e3 * busy / steps}


def own_step(ref: str, precision: str, device: torch.device):
    """The step `ref` as the lab's measurements call it, step(model, optimizer, x, y) -> loss, at `precision` (with
    a GradScaler for fp16); while it is not written yet, the lab's own step at that precision, with a note."""
    fn, _ = load_own(ref)
    dtype, autocast = DTYPES[precision], autocast_for(precision, device)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    own = [fn]

    def step(model, optimizer, x, y) -> float:
        if own:
            try:
                return float(own[0](model, optimizer, x, y, dtype, scaler))
            except NotImplementedError:
                own.clear()
                print(f"note: {ref} is not written yet, so this measurement runs the lab's own {precision} step")
        return train_step(model, optimizer, x, y, autocast)
    return step


__all__ = ["step_runs", "own_step", "low_precision_share", "CountingScaler", "SavedBytesByDtype", "DTYPES"]
