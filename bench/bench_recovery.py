"""Recovery time after a lost worker: restart from checkpoint, elastic torchrun, Horovod elastic, forward recovery.

    .venv/bin/python bench/bench_recovery.py                  # writes bench/results/bench_recovery.json
    .venv/bin/python bench/bench_recovery.py --repeats 1      # quicker

Each run trains the tiny preset on `--workers` ranks; rank 1 SIGKILLs itself at step `--fault-step` (a fault of the
RunSpec, so the moment is on the run's own clock, in its events). Measured from that fault event:

- restart: the run fails (the local launcher; the Run handle names the dead rank), and a new launch into the same
  run directory resumes from the newest checkpoint — what a user or a job chain does. training_again_s is until
  the relaunched rank 0's first finished step; it includes noticing the failure, tearing the run down, starting
  new processes (Python, torch import, the group) and the first step.
- elastic: torchrun with max_restarts=2 and a c10d rendezvous restarts the worker group itself and resumes from the
  checkpoint: no user in the loop, but still new processes.
- horovod_elastic: strategy horovod under horovodrun's elastic mode (hvd.elastic.run): the survivors roll back to
  the last in-memory commit (every `--every` steps), re-form and go on with fewer workers; no new processes.
- forward: fault.recovery=forward; the survivors re-form the group and redo the failed step's all-reduce.
steps_redone: the work since the checkpoint, done twice (0 for forward recovery, which keeps the in-memory state).
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab import launch, preset  # noqa: E402
from scalelab.experiments.resilience import recovery  # noqa: E402


def spec(out: Path, args, **changes):
    """The tiny preset with the kill fault and checkpoints every `--every` steps."""
    return preset("tiny").replace(output_dir=str(out)).with_overrides({
        "world.workers_per_node": args.workers, "steps": args.steps, "checkpoint.every_steps": args.every,
        "fault.kind": "kill", "fault.rank": 1, "fault.step": args.fault_step, **changes})


def restart(out: Path, args) -> dict:
    """Fail, then relaunch into the same run directory with the fault turned off (the relaunch resumes from a
    checkpoint before the fault step, so the fault would fire again)."""
    first = launch(spec(out, args))
    first.wait(timeout=300, check=False)
    second = launch(spec(out, args, **{"fault.kind": "none"}))
    second.wait(timeout=300)
    return recovery(first.events() + second.events())


def elastic(out: Path, args) -> dict:
    run = launch(spec(out, args, launcher="torchrun", **{"world.max_restarts": 2}))
    run.wait(timeout=300)
    return recovery(run.events())


def horovod_elastic(out: Path, args) -> dict:
    run = launch(spec(out, args, strategy="horovod", launcher="horovodrun", **{
        "world.max_restarts": 2, "world.commit_every": args.every, "checkpoint.every_steps": 0,
        "fault.detect_timeout_s": 10.0}))
    run.wait(timeout=300)
    return recovery(run.events())


def forward(out: Path, args) -> dict:
    run = launch(spec(out, args, **{"fault.recovery": "forward"}))
    run.wait(timeout=300)
    return recovery(run.events())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_recovery.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    ways = {"restart": restart, "elastic": elastic, "horovod_elastic": horovod_elastic, "forward": forward}
    found: dict[str, list[dict]] = {k: [] for k in ways}
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        for i in range(args.repeats):
            for name, fn in ways.items():  # interleaved: each way sees the same load on this shared machine
                found[name].append(fn(Path(tmp) / f"{name}-{i}", args))
    result = {
        "benchmark": "recovery time after a SIGKILLed rank: restart from checkpoint, elastic torchrun, Horovod "
                     "elastic, forward",
        "command": "python bench/bench_recovery.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "repeats": args.repeats, "workers": args.workers,
        "fault_step": args.fault_step, "checkpoint_every": args.every,
        "ways": {name: {"median_training_again_s": statistics.median(r["training_again_s"] for r in runs),
                        "median_back_s": statistics.median(r["back_s"] for r in runs),
                        "steps_redone": runs[0]["steps_redone"], "runs": runs} for name, runs in found.items()},
    }
    ways_out = result["ways"]
    result["forward_speedup_over_elastic"] = (ways_out["elastic"]["median_training_again_s"]
                                              / ways_out["forward"]["median_training_again_s"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, w in ways_out.items():
        print(f"{name:8s} training again after {w['median_training_again_s']:7.3f} s (median of {args.repeats}), "
              f"back past the fault step after {w['median_back_s']:7.3f} s, {w['steps_redone']} steps redone")
    print(f"forward recovery is training again {result['forward_speedup_over_elastic']:.0f} x sooner than elastic")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
