"""Lab 01: where does a single device's training time go, and what makes it faster?

Every function runs in the calling process on one device (cuda:0 when the spec asks for it or `device=auto`
finds one, else the CPU) with the model, data and optimizer the engine would build for the spec. Throughput is
measured after `warmup` steps (allocator, loader start-up, autotuning) and is always samples per second.

    split = throughput_split(spec, steps=20, read_ms=1.0)   # {"data": .., "compute": .., "full": ..}

`read_ms` stands in for storage: each sample costs that many milliseconds of waiting, as a read from a shared
file system does. Waiting (not computing) is what makes loader workers pay off even on a 2-core laptop.

`phase_shares(run_dir)` reads an engine run's own profiler trace back: ms per step and share of each phase
(data, forward, backward, optimizer), the numbers of the profile -> fix -> profile again loop.

Code of the student's own runs here too. Every measurement takes `timer="my_timer:time_steps"`, the student's
honest timer (`timer_probe`, from .timing, tests it on a simulated asynchronous device first), and `ladder` a rung
{"step": "my_step:train_step"}, the student's mixed-precision training step (`step_runs`, from .own_step, runs it
beside the lab's fp32 step as two runs with event files).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..data.loader import build_loader
from ..train.profiling import trace_path as rank_trace_path
from ._common import autocast_for, build_workload, sync, train_step
from .own_code import OwnCodeError, load_own
from .own_step import own_step, step_runs  # step_runs and timer_probe: the lab calls them as sd.*
from .timing import timer_probe
from .profiling import trace_intervals, trace_summary

MODES = ("data", "compute", "full")


class SlowReads(torch.utils.data.Dataset):
    """A dataset whose every sample takes `read_ms` to arrive, like a read from a busy parallel file system."""

    def __init__(self, base, read_ms: float):
        self.base, self.read_ms = base, float(read_ms)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if self.read_ms > 0:
            time.sleep(self.read_ms / 1000)
        return self.base[i]

    def __getitems__(self, indices):
        """A whole batch, as the DataLoader asks for it: its samples' waits in one sleep. Per-sample sleeps measured
        the machine's wake-up delays instead of the latency: on a loaded 2-core machine each of a few thousand
        4 ms sleeps took several times that, and lab 01's loader sweep ran past its cell's time limit."""
        if self.read_ms > 0:
            time.sleep(self.read_ms * len(indices) / 1000)
        return [self.base[i] for i in indices]


def _batches(spec, dataset, device):
    """Batches forever from the engine's loader (one rank of one), moved to the device."""
    loader = build_loader(dataset, spec.data, spec.optim.batch_per_worker, 0, 1, spec.seed)
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        epoch += 1


def measure(spec, mode: str = "full", steps: int = 20, warmup: int = 3, read_ms: float = 0.0,
            compile_backend: str | None = None, timer: str | None = None, step: str | None = None) -> dict:
    """Samples/s of one of: `data` (loader only), `compute` (a fixed synthetic batch), `full` (both, in turn).

    timer: "module:function" of a timer of the student's own, time_steps(step, steps, warmup, sync) -> seconds
    per step (default: the lab's own; also used, with a note, while the student's is not written yet).
    step: "module:function" of a training step of the student's own at spec.precision (see own_step)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} must be one of {', '.join(MODES)}")
    spec.validate()
    wl = build_workload(spec)
    model = torch.compile(wl.model, backend=compile_backend) if compile_backend else wl.model
    autocast = autocast_for(spec.precision, wl.device)
    train = own_step(step, spec.precision, wl.device) if step else \
        (lambda m, o, x, y: train_step(m, o, x, y, autocast))
    batch = spec.optim.batch_per_worker
    batches = None
    if mode != "compute":
        batches = _batches(spec, SlowReads(wl.dataset, read_ms), wl.device)
    else:  # synthetic input already on the device: no loader, no copy, just the model
        g = torch.Generator().manual_seed(spec.seed)
        fixed = (torch.randn(batch, *wl.sample_shape, generator=g).to(wl.device),
                 torch.randint(0, wl.classes, (batch,), generator=g).to(wl.device))
    last = {"loss": float("nan")}

    def one_step():
        x, y = fixed if batches is None else next(batches)
        if mode != "data":
            last["loss"] = train(model, wl.optimizer, x, y)

    seconds = _timed(timer, one_step, steps, warmup, lambda: sync(wl.device))
    if batches is not None:
        batches.close()  # ends the loader's worker processes now, not at garbage collection
    return {"mode": mode, "samples_per_s": batch / seconds, "step_ms": 1000 * seconds,
            "loss": last["loss"], "batch": batch, "steps": steps, "device": str(wl.device), "read_ms": read_ms}


def lab_timer(step, steps: int, warmup: int, sync) -> float:
    """Seconds per call of `step()` over `steps` calls, after `warmup` untimed ones, the device waited for at both
    ends of the clock (the timer every measurement uses until the student's own is written)."""
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


_NOTED: set[str] = set()


def _timed(ref: str | None, step, steps: int, warmup: int, sync) -> float:
    """Seconds per step by the timer `ref` (None: the lab's); a timer not written yet falls back to the lab's, once
    noted per timer."""
    if ref:
        timer, _ = load_own(ref)
        try:
            seconds = timer(step, steps, warmup, sync)
        except NotImplementedError:
            if ref not in _NOTED:
                _NOTED.add(ref)
                print(f"note: {ref} is not written yet, so this lab times its measurements with its own timer")
        else:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise OwnCodeError(f"{ref} returned {seconds!r}: it must return the seconds per step, a number > 0")
            return float(seconds)
    return lab_timer(step, steps, warmup, sync)


def throughput_split(spec, steps: int = 20, read_ms: float = 0.0, warmup: int = 3, rounds: int = 3,
                     timer: str | None = None) -> dict:
    """Samples/s for data only, compute only and the full step: the slower of the first two is the bottleneck.

    The three are measured in `rounds` interleaved rounds and each keeps its best: a burst of load from another
    process slows whichever mode it lands on, and the best of a few rounds is what the machine can do (measured
    one after another once, a compute phase slowed by a neighbour came out slower than the full step)."""
    best = dict.fromkeys(MODES, 0.0)
    for _ in range(max(1, rounds)):
        for mode in MODES:
            best[mode] = max(best[mode], measure(spec, mode, steps, warmup, read_ms, timer=timer)["samples_per_s"])
    return best


def loader_sweep(spec, workers=(0, 1, 2, 4), steps: int = 20, read_ms: float = 1.0, warmup: int = 3,
                 rounds: int = 3, timer: str | None = None) -> list[dict]:
    """Full-step samples/s with each number of DataLoader worker processes.

    The counts are measured in `rounds` interleaved rounds and each keeps its best, as in `throughput_split`: a
    few dozen short steps are a fraction of a second, and a burst of load from another process landing on one
    count's only measurement made 4 workers look no better than none (CI graded 701 vs 579 samples/s)."""
    counts = [int(w) for w in workers]
    best = dict.fromkeys(counts, 0.0)
    for _ in range(max(1, rounds)):
        for w in counts:
            s = spec.with_overrides({"data.loader_workers": w})
            best[w] = max(best[w], measure(s, "full", steps, warmup, read_ms, timer=timer)["samples_per_s"])
    return [{"workers": w, "samples_per_s": best[w]} for w in counts]


def precision_compare(spec, precisions=("fp32", "bf16"), steps: int = 20, warmup: int = 3,
                      timer: str | None = None) -> list[dict]:
    """Compute-only samples/s and the loss reached on the same batch from the same start, per precision."""
    rows = [dict(precision=p, **_pick(measure(spec.replace(precision=p), "compute", steps, warmup, timer=timer),
                                      "samples_per_s", "loss")) for p in precisions]
    ref = rows[0]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / ref["samples_per_s"]
        r["loss_diff"] = abs(r["loss"] - ref["loss"])
    return rows


def _pick(d: dict, *keys) -> dict:
    return {k: d[k] for k in keys}


def try_compile(spec, backend: str = "inductor", steps: int = 20, warmup: int = 3, timer: str | None = None) -> dict:
    """torch.compile on the compute-only step: compile time, speedup over eager, or the error where it fails."""
    out = {"backend": backend, "ok": False, "error": None, "compile_s": None, "speedup": None,
           "eager_samples_per_s": measure(spec, "compute", steps, warmup, timer=timer)["samples_per_s"]}
    try:
        first = measure(spec, "compute", 1, 0, compile_backend=backend, timer=timer)  # the first step compiles
        out["compile_s"] = first["step_ms"] / 1000
        compiled = measure(spec, "compute", steps, warmup, compile_backend=backend, timer=timer)
    except Exception as e:  # noqa: BLE001 - "where it works": a missing compiler is a result, not a crash
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return out
    out.update(ok=True, compiled_samples_per_s=compiled["samples_per_s"],
               speedup=compiled["samples_per_s"] / out["eager_samples_per_s"])
    return out


def profile_steps(spec, trace_path: str | Path, steps: int = 5, warmup: int = 2, read_ms: float = 0.0,
                  top: int = 12) -> dict:
    """Profile full steps with torch.profiler; save a Chrome trace; return the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile
    wl = build_workload(spec)
    autocast = autocast_for(spec.precision, wl.device)
    batches = _batches(spec, SlowReads(wl.dataset, read_ms), wl.device)
    for _ in range(warmup):
        train_step(wl.model, wl.optimizer, *next(batches), autocast)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if wl.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(steps):
            train_step(wl.model, wl.optimizer, *next(batches), autocast)
        sync(wl.device)
    batches.close()
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    ops = [{"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1000,
            "total_ms": e.cpu_time_total / 1000} for e in prof.key_averages()]
    ops.sort(key=lambda r: -r["self_ms"])
    return {"trace_path": str(trace_path), "trace_events": len(json.loads(trace_path.read_text())["traceEvents"]),
            "self_ms_total": sum(r["self_ms"] for r in ops), "ops": ops[:top], "steps": steps}


def phase_shares(run_dir, rank: int = 0, trace: dict | None = None) -> dict:
    """Where the profiled steps of an engine run went, from rank `rank`'s trace (or the already loaded `trace`):
    {"run_dir", "steps", "ms_per_step": {phase: ms}, "shares": {phase: fraction of the phases' time}}."""
    if trace is None:
        trace = json.loads(rank_trace_path(run_dir, rank).read_text())
    s = trace_summary(trace_intervals(trace, rank))
    total = sum(s["phase_s"].values())
    if not s["steps"] or total <= 0:
        raise ValueError(f"the trace of {run_dir} holds no profiled step: was the run profiled "
                         "(profile.enabled=true) with steps past profile.wait_steps + profile.warmup_steps?")
    return {"run_dir": str(run_dir), "steps": s["steps"],
            "ms_per_step": {p: 1e3 * v / s["steps"] for p, v in s["phase_s"].items()},
            "shares": {p: v / total for p, v in s["phase_s"].items()}}


def ladder(spec, rungs: list[tuple[str, dict]], steps: int = 20, read_ms: float = 1.0, warmup: int = 3,
           rounds: int = 3, timer: str | None = None) -> list[dict]:
    """Full-step samples/s as changes pile up: rung i applies its overrides on top of rungs 0..i-1.

    A rung is (name, {"data.loader_workers": 2, ...}); the keys "compile" (a torch.compile backend) and "step"
    (a training step of the student's own, "module:function", see own_step) are not RunSpec fields and are handled
    here. `speedup` is against the first rung, `gain` against the previous one.
    The rungs are measured in `rounds` interleaved rounds and each keeps its best, as in `loader_sweep`: measured
    once each, a burst of load landing on the last rung made a 4x ladder look 1.28x (CI, grading beside another
    batch on 2 cores)."""
    piled, changes, extra = [], {}, {}
    for name, step in rungs:
        step = dict(step)
        extra.update({k: step.pop(k) for k in ("compile", "step") if k in step})
        changes.update(step)
        piled.append((name, dict(changes), dict(extra)))
    best = [0.0] * len(piled)
    for _ in range(max(1, rounds)):
        for i, (_, changed, own) in enumerate(piled):
            sps = measure(spec.with_overrides(changed), "full", steps, warmup, read_ms, timer=timer,
                          compile_backend=own.get("compile"), step=own.get("step"))["samples_per_s"]
            best[i] = max(best[i], sps)
    rows = []
    for (name, changed, own), sps in zip(piled, best):
        base = rows[0]["samples_per_s"] if rows else sps
        prev = rows[-1]["samples_per_s"] if rows else sps
        rows.append({"name": name, "samples_per_s": sps, "speedup": sps / base, "gain": sps / prev,
                     "changes": {**changed, **own}})
    return rows


GPT_RUNGS = (("fp32, AdamW", {}), ("bf16 autocast", {"precision": "bf16"}), ("fused AdamW", {"fused": True}),
             ("torch.compile", {"compile": True}))
"""Section 5b's ladder on the engine's gpt, one change per rung on top of the ones before."""


def gpt_ladder(preset: str = "tiny", seq_len: int = 64, batch: int = 8, steps: int = 3, warmup: int = 1,
               device: str = "auto", compile_backend: str = "inductor", timer: str | None = None,
               seed: int = 0) -> list[dict]:
    """The engine's gpt (byte-level transformer on the Python sources, data/pysrc.py) trained on one device as
    GPT_RUNGS pile up: fp32 with the for-each AdamW, bf16 autocast, the fused AdamW (one kernel for the whole
    update), torch.compile of every block (left out when `compile_backend` is ""). Each rung starts from the same
    weights and batches; `timer` ("module:function", the student's) times `steps` steps after `warmup`.

    Rows: name, precision, fused, compile, tokens_per_s, step_ms, speedup (against the first rung), gain (against
    the previous), mfu (model FLOPs per token x tokens/s over the device's peak; None on a CPU), compile_s (the
    first compiled step), loss_first, loss_last; a rung that could not run (no compiler, no fused AdamW for this
    device) has `error` and no numbers, and the next rung builds on the one before it."""
    from ..data import pysrc
    from ..run.field_groups import ModelSpec
    from ..train.gpt import build_gpt, device_peak, train_step_fn
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    total = warmup + steps + 1
    x, y = pysrc.train_samples(batch * total, seq_len, seed)
    x, y = x.to(dev), y.to(dev)
    rows, setting = [], {"precision": "fp32", "fused": False, "compile": False}
    for name, change in GPT_RUNGS:
        if change.get("compile") and not compile_backend:
            continue
        trying = {**setting, **change}
        row = {"name": name, **trying, "compile_backend": compile_backend if trying["compile"] else None}
        try:
            model = build_gpt(ModelSpec(name="gpt", preset=preset), seq_len, seed).to(dev)
            one_step, losses = train_step_fn(model, x, y, batch, precision=trying["precision"],
                                             fused=trying["fused"],
                                             compile_backend=compile_backend if trying["compile"] else None)
            warm = warmup
            if trying["compile"]:
                start = time.perf_counter()
                one_step()  # the first compiled step compiles: one of the warm-up steps, so every rung trains alike
                sync(dev)
                row["compile_s"] = time.perf_counter() - start
                warm = max(0, warmup - 1)
            seconds = _timed(timer, one_step, steps, warm, lambda: sync(dev))
        except Exception as e:  # noqa: BLE001 - a rung that cannot run here is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rows.append(row)
            continue
        setting = trying
        peak, _ = device_peak(dev, trying["precision"])
        tokens_per_s = batch * seq_len / seconds
        row.update(tokens_per_s=tokens_per_s, step_ms=1000 * seconds, device=str(dev),
                   mfu=model.flops_per_token * tokens_per_s / peak if peak else None,
                   loss_first=float(losses[0]), loss_last=float(losses[-1]))
        done = [r for r in rows if "error" not in r]
        row["speedup"] = tokens_per_s / done[0]["tokens_per_s"] if done else 1.0
        row["gain"] = tokens_per_s / done[-1]["tokens_per_s"] if done else 1.0
        rows.append(row)
    return rows


def gpt_reference(root: str | Path | None = None) -> list[dict]:
    """The GPU check's reference results for the gpt (bench/gpu/<device>/gpt.json of the course's checkout, written
    by tools/gpu_check.sh), one row per device: device_name, date, torch, size, and per mode (fp32, bf16,
    bf16-compile) tokens_per_s and mfu; [] where the checkout's bench/ folder is not on this machine."""
    from ..paths import checkout_root
    folder = Path(root) if root else checkout_root() / "bench" / "gpu"
    out = []
    for path in sorted(folder.glob("*/gpt.json")):
        try:
            report = json.loads(path.read_text())
            out.append({"device_name": report.get("device_name", report.get("device")), "date": report["date"][:10],
                        "torch": report.get("torch"), "size": report.get("size"), "file": str(path),
                        "modes": {r["mode"]: {"tokens_per_s": r["tokens_per_s"], "mfu": r.get("mfu")}
                                  for r in report["results"]}})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
