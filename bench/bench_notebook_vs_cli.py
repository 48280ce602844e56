"""A run launched from a notebook (executed by papermill) is as fast as the same run from `scalelab run --json`.

    .venv/bin/python bench/bench_notebook_vs_cli.py               # writes bench/results/bench_notebook_vs_cli.json
    .venv/bin/python bench/bench_notebook_vs_cli.py --repeats 3   # quicker

The notebook path is what a lab cell or widget does: `launch(spec).wait()` inside a Jupyter kernel (run here by
papermill through scalelab.course.execute.execute_notebook), the ranks being children of the kernel. The CLI path is
`scalelab run ... --json` in a terminal. Both run the same RunSpec (2 DDP ranks, 1 thread each).

Why the two runs go *at the same time*: on a shared machine the load of other users moves single-run throughput
by 10-40 % from one minute to the next, far more than the 3 % this benchmark must resolve. Run side by side, both
see the same load (and each other, symmetrically); the notebook waits for a go-file so that both launch together,
and samples/s of each is computed from its step events inside the time window where both were training. Each
repeat gives one notebook/CLI ratio; the figure is their median. Target: each reaches >= 0.98 of the other
(issue 22).
`--mode sequential` runs them one after the other instead (interleaved pairs), for a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab.course.execute import execute_notebook  # noqa: E402

# The run, as `scalelab run --set` overrides; the notebook builds the same spec from the same overrides.
OVERRIDES = {"world.workers_per_node": 2, "world.threads_per_worker": 1, "model.width": 16, "data.size": 32,
             "data.samples": 2048, "optim.batch_per_worker": 64, "steps": 150}
TARGET = 0.98

NOTEBOOK_CELLS = [
    ("parameters", "overrides = {}  # RunSpec overrides of the run\nout = 'run'  # its output folder\n"
                   "go_file = ''  # when set, wait for this file before launching"),
    ("", "import os, time\nfrom scalelab import launch, preset, record\n"
         "spec = preset('tiny').with_overrides({**overrides, 'output_dir': out})\n"
         "while go_file and not os.path.exists(go_file):\n    time.sleep(0.01)\n"
         "summary = launch(spec).wait(timeout=900)\n"
         "record('samples_per_s', summary['samples_per_s'])\nrecord('steps', summary['steps'])"),
]


def write_notebook(path: Path) -> Path:
    """The one-run notebook the bench executes (written fresh: nothing to keep in sync by hand)."""
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "outputs": [], "source": src,
              "metadata": {"tags": [tag]} if tag else {}} for i, (tag, src) in enumerate(NOTEBOOK_CELLS)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                      "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


def from_notebook(nb: Path, out: Path, go_file: str = "") -> float:
    """samples/s (whole run) of the run launched inside a papermill-executed notebook."""
    result = execute_notebook(nb, {"overrides": OVERRIDES, "out": str(out), "go_file": go_file},
                              output_path=out.parent / f"{out.name}.ipynb", cell_timeout=900,
                              total_timeout=1200).raise_for_status()
    assert result.records["steps"] == OVERRIDES["steps"]
    return float(result.records["samples_per_s"])


def cli_command(out: Path) -> list[str]:
    """`scalelab run --preset tiny --set ... --out OUT --json`."""
    cmd = [str(Path(sys.executable).parent / "scalelab"), "run", "--preset", "tiny", "--out", str(out), "--json"]
    for key, value in OVERRIDES.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def from_cli(out: Path) -> float:
    """samples/s (whole run) of `scalelab run --json` in a terminal."""
    r = subprocess.run(cli_command(out), capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise RuntimeError(f"scalelab run failed ({r.returncode}): {r.stderr[-2000:]}")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == OVERRIDES["steps"] and summary["status"] == "succeeded"
    return float(summary["samples_per_s"])


def step_events(run_dir: Path) -> list[dict]:
    """Every step event of a run, all ranks."""
    return [e for f in sorted((run_dir / "events").glob("rank-*.jsonl")) for e in map(json.loads, f.open())
            if e["type"] == "step"]


def window_rate(steps: list[dict], lo: float, hi: float) -> float:
    """Global samples/s from the steps that ended inside [lo, hi]: per rank samples / busy seconds, summed."""
    total = 0.0
    for rank in {e["rank"] for e in steps}:
        mine = [e for e in steps if e["rank"] == rank and lo <= e["t"] <= hi]
        busy = sum(e["step_s"] for e in mine)
        total += sum(e["samples"] for e in mine) / busy if busy > 0 else 0.0
    return total


def concurrent_pair(nb: Path, work: Path, i: int) -> dict:
    """Notebook and CLI launched together; samples/s of each inside their common training window."""
    go = work / f"go-{i}"
    nb_dir, cli_dir = work / f"notebook-{i}", work / f"cli-{i}"
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, from_notebook, nb, nb_dir, str(go)))
    thread.start()
    time.sleep(8)  # the kernel starts and the notebook waits at the go-file
    go.touch()
    cli = subprocess.run(cli_command(cli_dir), capture_output=True, text=True, timeout=1200)
    thread.join()
    if errors or cli.returncode:
        raise RuntimeError(f"a run failed: {errors or cli.stderr[-2000:]}")
    a, b = step_events(nb_dir), step_events(cli_dir)
    skip = OVERRIDES["steps"] // 10  # start-up steps (as the summaries skip them)
    lo = max(min(e["t"] for e in a if e["step"] > skip), min(e["t"] for e in b if e["step"] > skip))
    hi = min(max(e["t"] for e in a), max(e["t"] for e in b))
    rates = {"notebook": window_rate(a, lo, hi), "cli": window_rate(b, lo, hi)}
    return {**rates, "window_s": hi - lo, "ratio": rates["notebook"] / rates["cli"]}


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported by the caller
        errors.append(repr(e))


def sequential_pair(nb: Path, work: Path, i: int, settle: float) -> dict:
    """Notebook then CLI (or CLI then notebook on odd repeats), each over its whole run."""
    rates = {}
    for kind in ("notebook", "cli") if i % 2 == 0 else ("cli", "notebook"):
        time.sleep(settle)
        run_dir = work / f"{kind}-{i}"
        rates[kind] = from_notebook(nb, run_dir) if kind == "notebook" else from_cli(run_dir)
    return {**rates, "ratio": rates["notebook"] / rates["cli"]}


def main(argv=None) -> int:
    """Run the pairs, take the median ratio, write the JSON result; exit 1 below target."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="pairs of runs (default 7)")
    parser.add_argument("--mode", choices=("concurrent", "sequential"), default="concurrent")
    parser.add_argument("--settle", type=float, default=3.0, help="sequential mode: quiet seconds before each run")
    parser.add_argument("--workers", type=int, default=OVERRIDES["world.workers_per_node"],
                        help="DDP ranks of the run (default 2)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_notebook_vs_cli.json"))
    args = parser.parse_args(argv)
    OVERRIDES["world.workers_per_node"] = args.workers
    work = Path(tempfile.mkdtemp(prefix="scalelab-bench-nb-cli-"))
    nb = write_notebook(work / "run.ipynb")
    pairs = []
    for i in range(args.repeats):
        pair = concurrent_pair(nb, work, i) if args.mode == "concurrent" else sequential_pair(nb, work, i, args.settle)
        pairs.append(pair)
        print(f"pair {i + 1}/{args.repeats}: notebook {pair['notebook']:8.1f}  cli {pair['cli']:8.1f} samples/s  "
              f"ratio {pair['ratio']:.3f}", flush=True)
    ratio = statistics.median(p["ratio"] for p in pairs)
    worst = min(ratio, 1 / ratio)
    result = {"benchmark": "same run from a papermill-executed notebook vs `scalelab run --json`", "mode": args.mode,
              "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "load_average": os.getloadavg()},
              "run": OVERRIDES, "repeats": args.repeats, "pairs": pairs,
              "median_samples_per_s": {k: statistics.median(p[k] for p in pairs) for k in ("notebook", "cli")},
              "notebook_over_cli": ratio, "each_reaches_of_other": worst, "target": TARGET, "ok": worst >= TARGET}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"median notebook/cli = {ratio:.3f}: each reaches {worst:.3f} of the other (target {TARGET}) -> "
          f"{'ok' if result['ok'] else 'BELOW TARGET'}\nwritten: {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
