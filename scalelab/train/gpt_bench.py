"""Tokens/s and MFU of the engine's gpt on one device, in fp32, bf16 and bf16 with torch.compile: the measured part
of the GPU check (tools/gpu_check.sh), written as reference results JSON.

    python -m scalelab.train.gpt_bench --device cuda --out bench/gpu/nvidia-h100-80gb-hbm3/gpt.json
    python -m scalelab.train.gpt_bench --device cpu --tiny --compile-backend eager --out /tmp/gpt.json   # CI

It needs torch and numpy only (no launcher, no Jupyter, no YAML): one process trains the model in a plain loop
the way the engine's loop does (AdamW, fused on a GPU; autocast for bf16; next-byte cross-entropy on windows of
the Python sources, data/pysrc.py; the step is gpt.train_step_fn, the one lab 01's ladder times too), and times `--steps` steps after `--warmup` untimed ones (the first steps pay
for kernel selection, the allocator's growth and, with compile, the compilation: that time is reported apart).
On a GPU every timed region ends in a synchronize, so the clock sees the kernels finish, not just their launch.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

import torch

from ..data import pysrc
from ..run.field_groups import ModelSpec
from .gpt import GPT, build_gpt, device_peak, train_step_fn

MODES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "bf16-compile": ("bf16", True)}
"""mode -> (precision, torch.compile of each block)."""
GPU_SIZE = {"preset": "100m", "seq_len": 1024, "batch": 16, "steps": 20, "warmup": 5}
TINY_SIZE = {"preset": "tiny", "seq_len": 64, "batch": 8, "steps": 3, "warmup": 1}
"""--tiny: seconds on a CPU (the CI run of the script, so it cannot rot)."""


def device_facts(device: torch.device) -> dict:
    """What the numbers were measured on: device name, driver, CUDA and torch versions, host, date."""
    now = datetime.datetime.now(datetime.timezone.utc)
    facts = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
             "host": socket.gethostname(), "date": now.isoformat(timespec="seconds")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(device_name=props.name, memory_bytes=props.total_memory, cuda=torch.version.cuda,
                     capability=f"{props.major}.{props.minor}", driver=_driver())
    else:
        facts.update(device_name=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                     threads=torch.get_num_threads())
    return facts


def _driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi), or None where it cannot be asked."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def slug(name: str) -> str:
    """A folder name for a device: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    out = "".join(c.lower() if c.isalnum() else "-" for c in name)
    return "-".join(part for part in out.split("-") if part) or "unknown"


def measure(mode: str, device: torch.device, preset: str, seq_len: int, batch: int, steps: int, warmup: int,
            compile_backend: str = "inductor", seed: int = 0) -> dict:
    """Train the preset for warmup + steps steps in `mode`; tokens/s, MFU, step time and memory of the timed steps."""
    precision, compiled = MODES[mode]
    model: GPT = build_gpt(ModelSpec(name="gpt", preset=preset), seq_len, seed).to(device)
    fused = device.type == "cuda"  # one kernel for the whole update instead of a few per parameter
    x, y = pysrc.train_samples(batch * (warmup + steps), seq_len, seed)
    step, losses = train_step_fn(model, x.to(device), y.to(device), batch, precision=precision, fused=fused,
                                 compile_backend=compile_backend if compiled else None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    timed_from = None
    for n in range(warmup + steps):
        if n == warmup:
            _sync(device)
            timed_from = time.perf_counter()
        step()
    _sync(device)
    end = time.perf_counter()
    timed_s = end - timed_from
    tokens_per_s = steps * batch * seq_len / timed_s
    peak, peak_source = device_peak(device, precision)
    return {"mode": mode, "precision": precision, "compile": compiled,
            "compile_backend": compile_backend if compiled else None, "fused_adamw": fused,
            "parameters": sum(p.numel() for p in model.parameters()), "flops_per_token": model.flops_per_token,
            "tokens_per_s": tokens_per_s, "step_ms": 1000 * timed_s / steps,
            "mfu": model.flops_per_token * tokens_per_s / peak if peak else None,
            "peak_tflops": peak / 1e12 if peak else None,
            "peak_source": peak_source, "warmup_s": timed_from - started,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "loss_first": float(losses[0]), "loss_last": float(losses[-1])}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU's queue is done: the clock stops after the work, not its launch


def run(device: str, modes: list[str], size: dict, compile_backend: str, tests_log: str | None = None) -> dict:
    """Measure every mode; the results with the device facts, the sizes and the bf16 / fp32 speed-up."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device (torch.cuda.is_available() is False)")
    results = []
    for mode in modes:
        print(f"gpt_bench: {mode} ...", file=sys.stderr, flush=True)
        results.append(measure(mode, dev, size["preset"], size["seq_len"], size["batch"], size["steps"],
                               size["warmup"], compile_backend))
        r = results[-1]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "unknown"
        print(f"gpt_bench: {mode}: {r['tokens_per_s']:,.0f} tokens/s, {r['step_ms']:.1f} ms/step, MFU {mfu}",
              file=sys.stderr, flush=True)
    speed = {r["mode"]: r["tokens_per_s"] for r in results}
    report = {**device_facts(dev), "size": size, "corpus": pysrc.corpus_facts(), "results": results,
              "bf16_over_fp32": speed["bf16"] / speed["fp32"] if {"bf16", "fp32"} <= set(speed) else None,
              "compile_over_bf16": speed["bf16-compile"] / speed["bf16"] if {"bf16", "bf16-compile"} <= set(speed)
              else None}
    if tests_log:
        report["gpu_tests"] = pytest_summary(Path(tests_log))
    return report


def pytest_summary(log: Path) -> str:
    """A pytest run's summary line (e.g. '14 passed in 66.1s'), else the log's last line (why it did not run)."""
    if not log.is_file():
        return f"not run ({log} is missing)"
    lines = [line.strip("= \n") for line in log.read_text(errors="replace").splitlines() if line.strip()]
    counts = re.compile(r"^(\d+ (passed|failed|skipped|deselected|errors?)\b.*|no tests ran.*)")
    return next((line for line in reversed(lines) if counts.match(line)), lines[-1] if lines else "no output")


def main(argv: list[str] | None = None) -> int:
    """Parse the options, measure, write the JSON; 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m scalelab.train.gpt_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--tiny", action="store_true", help="CI sizes (tiny preset, 3 steps): seconds on a CPU")
    parser.add_argument("--preset", help="the gpt preset (default: 100m, tiny with --tiny)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: the code path "
                                                                      "without a compiler, for CI on a CPU)")
    parser.add_argument("--tests-log", help="a pytest log whose summary line goes into the JSON (gpu_tests)")
    parser.add_argument("--out", required=True, help="where to write the JSON")
    args = parser.parse_args(argv)
    size = dict(TINY_SIZE if args.tiny else GPU_SIZE)
    for key in size:
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    report = run(args.device, modes, size, args.compile_backend, args.tests_log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpt_bench: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
