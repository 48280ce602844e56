"""Multi-node on one machine: 2 nodes x 1 rank against 1 node x 2 ranks (same global batch), and a shaped link.

    sudo .venv/bin/python bench/bench_multinode.py          # writes bench/results/bench_multinode.json
    sudo .venv/bin/python bench/bench_multinode.py --repeats 1 --steps 40 --rates 1gbit,100mbit

It brings up its own 2-node cluster in network namespaces (`scalelab.cluster.nodes`, state in a temporary
directory, ports 6827/6828, beside the 1-node cluster) and takes it down at the end. Every run is DDP through
`launcher=slurm` on that cluster, so both layouts pay the same batch-job start; only where the ranks sit differs:
1 node x 2 ranks talk over the node's loopback, 2 nodes x 1 rank over two veths and the bridge (real TCP between
two hosts), and then over links shaped with tc tbf to each `--rates` value.

Both layouts share the same 2 cores, so the ratio isolates the network path, not more compute.
efficiency = samples/s(2 nodes x 1) / samples/s(1 node x 2); shaped_over_unshaped = samples/s(2 nodes, shaped) /
samples/s(2 nodes, unshaped), samples/s = global batch / median step time (a step lasts as long as its slowest
rank); comm is the median time a step waits for its allreduce over the median step time.
Configurations run interleaved (each repeat runs all of them, rotated) and the median of the per-repeat ratios is
reported, because a small VM drifts more than the effect.
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

from scalelab.cluster.nodes import NodesCluster  # noqa: E402
from scalelab.launch import launch  # noqa: E402
from scalelab.run.spec import preset  # noqa: E402


def bench_spec(nodes: int, workers: int, steps: int, batch: int, width: int, out: Path):
    """A CNN whose gradient (width^2 x depth weights) is big enough that the link shows; same global batch."""
    return preset("tiny").with_overrides({
        "name": f"bench-mn-{nodes}x{workers}", "strategy": "ddp", "launcher": "slurm",
        "world.nodes": nodes, "world.workers_per_node": workers, "world.threads_per_worker": 1,
        "model.width": width, "model.depth": 3, "data.size": 32, "data.samples": 4096,
        "optim.batch_per_worker": batch, "steps": steps, "output_dir": str(out)})


def run_once(cluster, nodes, workers, args, out) -> dict:
    """samples/s, comm share and final loss of one run on the namespace cluster, from medians over its steps."""
    spec = bench_spec(nodes, workers, args.steps, args.batch, args.width, out)
    s = launch(spec, env={**os.environ, **cluster.env()}).wait(timeout=600)
    events = _events(out)
    hosts = sorted({e["host"] for e in events if e["type"] == "start"})
    # A step lasts as long as its slowest rank; the median step (after the first tenth) shrugs off the bursts of
    # other work on a shared machine that a mean over the run does not.
    by_step: dict[int, list[dict]] = {}
    for e in events:
        if e["type"] == "step" and e["step"] > args.steps // 10:
            by_step.setdefault(e["step"], []).append(e)
    step_s = statistics.median(max(x["step_s"] for x in v) for v in by_step.values())
    comm_s = statistics.median(statistics.mean(x["comm_s"] for x in v) for v in by_step.values())
    return {"samples_per_s": spec.global_batch / step_s, "step_s": step_s, "comm_s": comm_s, "comm": comm_s / step_s,
            "mean_samples_per_s": s["samples_per_s"], "final_loss": s["final_loss"], "hosts": hosts}


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((run_dir / "events").glob("rank-*.jsonl")) for line in f.open()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (global: 2x this)")
    parser.add_argument("--width", type=int, default=64, help="model width (the gradient grows with its square)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rates", default="1gbit", help="comma-separated link rates to shape to (tc tbf)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_multinode.json"))
    args = parser.parse_args(argv)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    names = ["1node_x2", "2nodes_x1"] + [f"2nodes_x1_{r}" for r in rates]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    per_repeat = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = NodesCluster(Path(tmp) / "cluster", nodes=2).up()
        try:
            for i in range(args.repeats):
                order = names[i % len(names):] + names[:i % len(names)]
                got = {}
                for n in order:
                    rate = n.split("_x1_")[1] if "_x1_" in n else None
                    cluster.set_link_rate(rate)
                    nodes, workers = (1, 2) if n == "1node_x2" else (2, 1)
                    got[n] = run_once(cluster, nodes, workers, args, Path(tmp) / f"{n}-{i}")
                    runs[n].append(got[n])
                cluster.set_link_rate(None)
                r = {"efficiency_2nodes_over_1node": got["2nodes_x1"]["samples_per_s"]
                     / got["1node_x2"]["samples_per_s"]}
                r.update({f"shaped_{rate}_over_unshaped": got[f"2nodes_x1_{rate}"]["samples_per_s"]
                          / got["2nodes_x1"]["samples_per_s"] for rate in rates})
                per_repeat.append({"runs": got, **r})
                print(f"repeat {i}: " + "  ".join(f"{k} {v['samples_per_s']:7.1f} (comm {v['comm']:.2f})"
                                                 for k, v in got.items())
                      + "  |  " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        finally:
            cluster.down()
    ratios = [k for k in per_repeat[0] if k != "runs"]
    med = {k: statistics.median(p[k] for p in per_repeat) for k in ratios}
    report = {
        "benchmark": "2 nodes x 1 rank vs 1 node x 2 ranks (same global batch) on network-namespace nodes, "
                     "and the 2-node run with each node's link shaped (tc tbf)",
        "command": "python bench/bench_multinode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": args.steps, "batch_per_rank": args.batch,
        "global_batch": 2 * args.batch, "model_width": args.width, "repeats": args.repeats, "rates": rates,
        "results": {n: {"samples_per_s": statistics.median(x["samples_per_s"] for x in v),
                        "comm": statistics.median(x["comm"] for x in v),
                        "comm_s": statistics.median(x["comm_s"] for x in v), "hosts": v[0]["hosts"],
                        "final_loss": v[0]["final_loss"]} for n, v in runs.items()},
        **med,
        "per_repeat": per_repeat,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("results", *med)}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
