"""Weak scaling on this machine: samples/s with 1 and 2 workers, DDP and Horovod, the same model.

    .venv/bin/python bench/bench_scaling.py            # writes bench/results/bench_scaling.json
    .venv/bin/python bench/bench_scaling.py --repeats 1 --steps 40   # quicker

Each rank gets one intra-op thread (threads_per_worker=1), so 2 workers on 2 cores is weak scaling by cores:
ideal is 2x the 1-worker throughput. Efficiency = samples/s(2) / (2 x samples/s(1)); the Horovod/DDP ratio
compares the 2-worker throughputs. Targets on a 2-core CPU machine: efficiency >= 0.90, Horovod/DDP >= 0.95.
Each configuration runs `--repeats` times; the median throughput is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab.launch import launch  # noqa: E402
from scalelab.metrics import scaling_efficiency  # noqa: E402
from scalelab.spec import preset  # noqa: E402

CONFIGS = [("ddp", "local"), ("horovod", "horovodrun")]


def bench_spec(strategy, launcher, workers, steps, out):
    """A CNN on 32x32 fields whose step is long enough (tens of ms) that compute, not set-up, is measured."""
    return preset("tiny").with_overrides({
        "name": f"bench-{strategy}-{workers}", "strategy": strategy, "launcher": launcher,
        "world.workers_per_node": workers, "world.threads_per_worker": 1,
        "model.width": 32, "model.depth": 3, "data.size": 32, "data.samples": 4096,
        "optim.batch_per_worker": 64, "steps": steps, "output_dir": str(out)})


def measure(strategy, launcher, workers, steps, repeats, tmp) -> dict:
    rates = []
    for i in range(repeats):
        out = Path(tmp) / f"{strategy}-{workers}-{i}"
        summary = launch(bench_spec(strategy, launcher, workers, steps, out)).wait(timeout=600)
        rates.append(summary["samples_per_s"])
        frac = summary["time_fraction"]
    return {"strategy": strategy, "launcher": launcher, "workers": workers, "samples_per_s": statistics.median(rates),
            "runs": rates, "time_fraction_last_run": frac}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_scaling.json"))
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, launcher in CONFIGS:
            for workers in (1, 2):
                r = measure(strategy, launcher, workers, args.steps, args.repeats, tmp)
                results[f"{strategy}_{workers}"] = r
                print(f"{strategy:8s} {workers} worker(s): {r['samples_per_s']:9.1f} samples/s  runs={r['runs']}",
                      flush=True)
    report = {
        "benchmark": "weak scaling, 1 vs 2 workers, 1 thread per worker",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": args.steps, "repeats": args.repeats,
        "results": results,
        "efficiency_ddp": scaling_efficiency(results["ddp_2"]["samples_per_s"], results["ddp_1"]["samples_per_s"], 2),
        "efficiency_horovod": scaling_efficiency(results["horovod_2"]["samples_per_s"],
                                                 results["horovod_1"]["samples_per_s"], 2),
        "horovod_over_ddp": results["horovod_2"]["samples_per_s"] / results["ddp_2"]["samples_per_s"],
        "targets": {"efficiency": 0.90, "horovod_over_ddp": 0.95},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("efficiency_ddp", "efficiency_horovod", "horovod_over_ddp")}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
