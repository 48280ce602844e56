"""Model parallelism at 2 ranks: FSDP against DDP (throughput, state and peak memory per rank, collective bytes),
and a 2-stage pipeline's bubble against (p - 1)/(m + p - 1).

    .venv/bin/python bench/bench_model_parallel.py              # writes bench/results/bench_model_parallel.json
    .venv/bin/python bench/bench_model_parallel.py --steps 10 --repeats 1   # quicker

- FSDP vs DDP: the engine's MLP (width `--width`, AdamW) trained by `launch()` with strategy ddp and fsdp
  (full shard, grad_op), 2 ranks of 1 thread, `--steps` steps, `--repeats` runs each, alternating, so every
  strategy sees the same load on this shared machine. samples/s is the engine's summary (the first steps left
  out); state bytes (parameters + gradients + Adam, this rank's shard) and the RSS high-water mark come from each
  run's `memory` / `end` events, collective bytes and times from the first step's counted collectives (each
  waited for as it is issued, so the times are the collectives' own).
- Pipeline: `pipeline_measure` (2 stages, GPipe and 1F1B) at m = 1, 2, 4, 8, 16 micro-batches; the bubble is
  replayed from each stage's median forward and backward times (what a core per stage would show) and also read
  off the wall clock (which on a loaded 2-core machine includes the two stages taking turns on the cores).
Targets: FSDP full shard state per rank <= 0.6 x DDP's; measured bubble within 0.15 of the formula at m >= 4.
Medians of `--repeats`; the load average is recorded (the machine is shared, figures are noisy).
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

from scalelab import launch, preset  # noqa: E402
from scalelab.launch.spmd import SpmdPool  # noqa: E402

STRATEGIES = {"ddp": {}, "fsdp_full": {"strategy": "fsdp"},
              "fsdp_grad_op": {"strategy": "fsdp", "fsdp.sharding": "grad_op"}}


def strategy_run(tmp: Path, name: str, changes: dict, width: int, steps: int, i: int) -> dict:
    """One 2-rank engine run: throughput, rank 0's memory event, RSS peaks of both ranks."""
    spec = preset("tiny").with_overrides({
        "model.name": "mlp", "model.width": width, "optim.name": "adamw", "optim.lr": 0.001, "steps": steps,
        "data.samples": 2048, "world.workers_per_node": 2, "world.threads_per_worker": 1,
        "output_dir": str(tmp / f"{name}-{i}"), **changes})
    run = launch(spec)
    summary = run.wait(timeout=600)
    events = run.events()
    memory = [e for e in events if e["type"] == "memory" and e["rank"] == 0][0]
    rss = [e["rss_peak_bytes"] for e in events if e["type"] == "end"]
    return {"samples_per_s": summary["samples_per_s"], "final_loss": summary["final_loss"],
            "state_bytes": memory["state_bytes"], "param_bytes": memory["param_bytes"],
            "rss_peak_bytes_max": max(rss), "comm": memory["comm"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="MLP width of the FSDP/DDP runs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro", default="1,2,4,8,16", help="pipeline micro-batch counts")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_model_parallel.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    runs = {name: [] for name in STRATEGIES}
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        for i in range(args.repeats):
            for name, changes in STRATEGIES.items():
                runs[name].append(strategy_run(Path(tmp), name, changes, args.width, args.steps, i))
    strategies = {}
    for name, rows in runs.items():
        strategies[name] = {"median_samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
                            "state_bytes_per_rank": rows[0]["state_bytes"], "param_bytes": rows[0]["param_bytes"],
                            "rss_peak_bytes_max": max(r["rss_peak_bytes_max"] for r in rows),
                            "collective_bytes_per_step": sum(c["bytes"] for c in rows[0]["comm"].values()),
                            "collective_s_first_step": statistics.median(
                                sum(c.get("time_s", 0.0) for c in r["comm"].values()) for r in rows),
                            "comm": rows[0]["comm"], "runs": rows}
    pipeline = {}
    with SpmdPool(world=2, threads=1) as pool:
        for schedule in ("gpipe", "1f1b"):
            for m in (int(x) for x in args.micro.split(",")):
                r = pool.run("scalelab.experiments.model_parallel:pipeline_measure", timeout=300, schedule=schedule,
                             micro=m, steps=max(3, args.repeats + 1))
                pipeline[f"{schedule}/{m}"] = {
                    "formula": r[0]["formula"], "replayed_bubble": r[0]["measured_bubble"],
                    "wall_clock_bubble": r[0]["measured_wall_bubble"], "per_step": r[0]["bubble"],
                    "peak_in_flight": [x["peak_in_flight"] for x in r]}
    ddp, full = strategies["ddp"], strategies["fsdp_full"]
    result = {
        "benchmark": "FSDP vs DDP at 2 ranks; pipeline bubble vs (p-1)/(m+p-1)",
        "command": "python bench/bench_model_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "repeats": args.repeats, "width": args.width,
        "strategies": strategies, "pipeline": pipeline,
        "fsdp_state_over_ddp": full["state_bytes_per_rank"] / ddp["state_bytes_per_rank"],
        "fsdp_throughput_over_ddp": full["median_samples_per_s"] / ddp["median_samples_per_s"],
        "fsdp_collective_bytes_over_ddp": full["collective_bytes_per_step"] / ddp["collective_bytes_per_step"],
        "targets": {"fsdp_state_over_ddp": "<= 0.6", "bubble_error_at_m_ge_4": "<= 0.15"},
    }
    errors = [abs(v["replayed_bubble"] - v["formula"]) for k, v in pipeline.items() if int(k.split("/")[1]) >= 4]
    result["met"] = {"fsdp_state_over_ddp": result["fsdp_state_over_ddp"] <= 0.6,
                     "bubble_error_at_m_ge_4": max(errors, default=0.0) <= 0.15}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, s in strategies.items():
        print(f"{name:13s} {s['median_samples_per_s']:7.0f} samples/s, state "
              f"{s['state_bytes_per_rank'] / 1e6:6.2f} MB/rank, RSS peak {s['rss_peak_bytes_max'] / 2**20:5.0f} MiB, "
              f"collectives {s['collective_bytes_per_step'] / 1e6:6.2f} MB/step in "
              f"{s['collective_s_first_step'] * 1e3:.1f} ms (first step, each waited for)")
    for key, p in pipeline.items():
        print(f"{key:9s} bubble replayed {p['replayed_bubble']:.3f}, wall clock {p['wall_clock_bubble']:.3f}, "
              f"formula {p['formula']:.3f}, held {p['peak_in_flight']}")
    print(f"met: {result['met']} (load {load_before[0]:.1f} -> {result['load_average_after'][0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
