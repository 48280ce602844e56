"""Weak scaling on this machine: samples/s with 1 and 2 workers, DDP and Horovod, the same model.

    .venv/bin/python bench/bench_scaling.py            # writes bench/results/bench_scaling.json
    .venv/bin/python bench/bench_scaling.py --repeats 3 --steps 60   # quicker (and noisier)
    .venv/bin/python bench/bench_scaling.py --workers 1,2,4,8       # DDP against the machine's ceiling per width

Each rank gets one intra-op thread (threads_per_worker=1), so 2 workers on 2 cores is weak scaling by cores:
ideal is 2x the 1-worker throughput. Efficiency = samples/s(2) / (2 x samples/s(1)); the Horovod/DDP ratio
compares the 2-worker throughputs. Targets on a 2-core CPU machine (issue 22): DDP efficiency >= 0.95 and within
0.03 of the machine ceiling below, Horovod/DDP >= 1.0. The load average before and after goes into the JSON.

A small cloud VM drifts by +-20 % from one minute to the next, far more than the effect measured. So the
configurations run interleaved: each repeat runs all of them back to back (in a rotated order), the ratios are
taken within a repeat, and the reported figure is the median of the per-repeat ratios. Throughput is the
engine's own steady-state figure (the summary skips the first tenth of the steps). The machine's own ceiling is
measured too: two independent 1-worker runs at once (no communication at all), so a shortfall can be told
apart from what two busy cores give on this machine.

Two engine defaults matter here, and `--set` turns them back to see what they are worth
(`--set world.malloc=system --set world.wait=block`): world.malloc=retain keeps the memory a rank frees
(glibc otherwise unmaps the CNN's large buffers at each free and faults them in again next step), and
world.wait=auto lets a DDP rank on gloo spin at its last allreduce when each rank has a core, instead of
sleeping and paying the idle vCPU's wake-up every step.

Horovod starts under mpirun by default (its MPI controller, ranks yielding when idle): on 2 busy cores, the Gloo
controller of `horovodrun --gloo` pays a TCP round trip between the ranks' background threads every 1 ms cycle
and measured 10-15 % slower at 2 workers here. `--horovod-launcher horovodrun` measures that path.
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

from scalelab.errors import SpecError  # noqa: E402
from scalelab.launch import launch  # noqa: E402
from scalelab.run.metrics import scaling_efficiency  # noqa: E402
from scalelab.run.spec import preset  # noqa: E402

# name -> (strategy, launcher, workers)
CONFIGS = {"ddp_1": ("ddp", "local", 1), "ddp_2": ("ddp", "local", 2),
           "horovod_1": ("horovod", "horovodrun", 1), "horovod_2": ("horovod", "horovodrun", 2)}


def bench_spec(strategy, launcher, workers, steps, out, batch=128, changes=()):
    """A CNN on 32x32 fields whose step is long enough (~0.1 s) that compute, not set-up, is measured;
    `changes` are --set style key=value overrides on top."""
    return preset("tiny").with_overrides({
        "name": f"bench-{strategy}-{workers}", "strategy": strategy, "launcher": launcher,
        "world.workers_per_node": workers, "world.threads_per_worker": 1,
        "model.width": 32, "model.depth": 3, "data.size": 32, "data.samples": 4096,
        "optim.batch_per_worker": batch, "steps": steps, "output_dir": str(out)}).with_overrides(list(changes))


def run_once(config, steps, batch, out, changes=()) -> float:
    """samples/s of one run of (strategy, launcher, workers)."""
    strategy, launcher, workers = config
    spec = bench_spec(strategy, launcher, workers, steps, out, batch, changes)
    return launch(spec).wait(timeout=600)["samples_per_s"]


def independent_pair(steps, batch, out, changes=(), n: int = 2) -> float:
    """n 1-worker DDP runs started together: their summed samples/s is what n busy cores give here (the machine's
    ceiling at that width: no communication at all)."""
    runs = [launch(bench_spec("ddp", "local", 1, steps, Path(out) / f"solo-{i}", batch, changes)) for i in range(n)]
    return sum(r.wait(timeout=600)["samples_per_s"] for r in runs)


WIDTH_TARGETS = {4: 0.95, 8: 0.9}
"""Issue 40: DDP's efficiency at 4 and 8 ranks as a share of the machine's ceiling at the same width."""


def widths(args, world) -> dict:
    """--workers 1,2,4,8: DDP at each width and the machine's ceiling there (as many independent 1-worker runs at
    once), interleaved; per width the median of the per-repeat efficiency, ceiling and their ratio."""
    ns = sorted(set(args.workers))
    names = [f"ddp_{n}" for n in ns] + [f"independent_{n}" for n in ns if n > 1]
    runs, per_repeat = {n: [] for n in names}, []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            got = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                kind, n = name.rsplit("_", 1)
                out = Path(tmp) / f"{name}-{i}"
                got[name] = (independent_pair(args.steps, args.batch, out, args.changes, int(n)) if kind ==
                             "independent" else run_once(("ddp", "local", int(n)), args.steps, args.batch, out,
                                                         args.changes))
                runs[name].append(got[name])
            one = got[f"ddp_{ns[0]}"] / ns[0]
            r = {}
            for n in ns[1:]:
                r[f"efficiency_{n}"] = got[f"ddp_{n}"] / (n * one)
                r[f"ceiling_{n}"] = got[f"independent_{n}"] / (n * one)
                r[f"of_ceiling_{n}"] = got[f"ddp_{n}"] / got[f"independent_{n}"]
            per_repeat.append({"samples_per_s": got, **r})
            print(f"repeat {i}: " + "  ".join(f"{k} {v:7.1f}" for k, v in got.items()) + "  |  "
                  + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    keys = list(per_repeat[0]) if per_repeat else []
    keys.remove("samples_per_s")
    med = {k: statistics.median(p[k] for p in per_repeat) for k in keys}
    return {
        "benchmark": f"DDP weak scaling at {ns} ranks against the machine's ceiling at each width (as many "
                     "independent 1-worker runs at once), 1 thread per rank, interleaved repeats",
        "command": "python bench/bench_scaling.py " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": args.steps, "batch_per_worker": args.batch,
        "overrides": args.changes, "repeats": args.repeats,
        "engine": {f"world.{k}": getattr(world, k) for k in ("malloc", "wait", "threads_per_worker", "spin_ms")},
        "results": {n: {"samples_per_s": statistics.median(v), "runs": v} for n, v in runs.items()},
        **med, "quartiles": {k: _quartiles([p[k] for p in per_repeat]) for k in keys},
        "per_repeat": per_repeat,
        "targets": {f"of_ceiling_{n}": t for n, t in WIDTH_TARGETS.items() if n in ns},
        "met": {f"of_ceiling_{n}": med[f"of_ceiling_{n}"] >= t for n, t in WIDTH_TARGETS.items() if n in ns},
        "note": "" if (os.cpu_count() or 1) >= max(ns) else
                f"{max(ns)} ranks on {os.cpu_count()} CPUs: ranks share cores, so the ceiling and DDP both measure "
                "an oversubscribed machine; the issue's figure needs a machine with a core per rank",
    }


def _widths(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give widths as whole numbers, e.g. 1,2,4,8") from None
    if len(ns) < 2 or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least two widths of 1 or more, e.g. 1,2,4,8")
    return ns


def _quartiles(values: list[float]) -> list[float]:
    """First and third quartiles of the per-repeat ratios (the spread the median sits in)."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128, help="samples per worker per step")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--horovod-launcher", choices=("horovodrun", "mpirun"), default="mpirun",
                        help="how the Horovod runs start: MPI controller (mpirun, default) or Gloo (horovodrun)")
    parser.add_argument("--set", dest="changes", action="append", default=[], metavar="KEY=VALUE",
                        help="a RunSpec override for every run, as scalelab run --set (repeatable)")
    parser.add_argument("--workers", type=_widths, default=None, metavar="N,N,...",
                        help="DDP at each of these widths against the machine's ceiling there (e.g. 1,2,4,8; the "
                             "first is the baseline), instead of the 1-vs-2 DDP/Horovod comparison; writes "
                             "bench/results/bench_scaling_widths.json unless --out says otherwise")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    try:  # a bad --set fails now, not after the first runs
        world = bench_spec("ddp", "local", 2, 1, ROOT / "bench" / "results", args.batch, args.changes).world
    except SpecError as e:
        parser.error(str(e))
    if args.workers:
        report = widths(args, world)
        out = Path(args.out or ROOT / "bench" / "results" / "bench_scaling_widths.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(json.dumps({k: report[k] for k in report if k.startswith(("of_ceiling", "efficiency", "ceiling"))
                          or k in ("met", "note")}, indent=2))
        print(f"wrote {out}")
        return 0
    args.out = args.out or str(ROOT / "bench" / "results" / "bench_scaling.json")
    configs = {n: (c[0], args.horovod_launcher if c[0] == "horovod" else c[1], c[2]) for n, c in CONFIGS.items()}
    names = list(configs) + ["independent_2"]
    runs = {n: [] for n in names}
    per_repeat = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = names[i % len(names):] + names[:i % len(names)]
            got = {}
            for n in order:
                out = Path(tmp) / f"{n}-{i}"
                got[n] = (independent_pair(args.steps, args.batch, out, args.changes) if n == "independent_2"
                          else run_once(configs[n], args.steps, args.batch, out, args.changes))
                runs[n].append(got[n])
            r = {"efficiency_ddp": scaling_efficiency(got["ddp_2"], got["ddp_1"], 2),
                 "efficiency_horovod": scaling_efficiency(got["horovod_2"], got["horovod_1"], 2),
                 "horovod_over_ddp": got["horovod_2"] / got["ddp_2"],
                 "machine_ceiling": scaling_efficiency(got["independent_2"], got["ddp_1"], 2)}
            per_repeat.append({"samples_per_s": got, **r})
            print(f"repeat {i}: " + "  ".join(f"{k} {v:7.1f}" for k, v in got.items()) + "  |  "
                  + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    ratios = ("efficiency_ddp", "efficiency_horovod", "horovod_over_ddp", "machine_ceiling")
    med = {k: statistics.median(p[k] for p in per_repeat) for k in ratios}
    spread = {k: _quartiles([p[k] for p in per_repeat]) for k in ratios}
    report = {
        "benchmark": "weak scaling, 1 vs 2 workers, 1 thread per worker, interleaved repeats",
        "command": "python bench/bench_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": args.steps, "batch_per_worker": args.batch,
        "horovod_launcher": args.horovod_launcher,
        "overrides": args.changes,
        "engine": {f"world.{k}": getattr(world, k) for k in ("malloc", "wait", "threads_per_worker")},
        "repeats": args.repeats,
        "results": {n: {"samples_per_s": statistics.median(v), "runs": v} for n, v in runs.items()},
        **med,
        "quartiles": spread,
        "per_repeat": per_repeat,
        "engine_fields": {"world.spin_ms": world.spin_ms},
        "targets": {"efficiency_ddp": 0.95, "ddp_below_ceiling_at_most": 0.03, "horovod_over_ddp": 1.0},
        "met": {"efficiency_ddp": med["efficiency_ddp"] >= 0.95,
                "ddp_within_ceiling": med["machine_ceiling"] - med["efficiency_ddp"] <= 0.03,
                "horovod_over_ddp": med["horovod_over_ddp"] >= 1.0},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in (*med, "quartiles", "met")}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
