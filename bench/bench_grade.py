"""Grading throughput: 8 submissions of the fixture lab with -j 1 and with -j 2, in the full sandbox.

    .venv/bin/python bench/bench_grade.py              # writes bench/results/bench_grade.json
    .venv/bin/python bench/bench_grade.py --repeats 1

Each submission is a kernel start plus a few short cells, so a batch is mostly kernel start-up (Python imports,
CPU-bound) and waiting: with 2 cores, -j 2 should take clearly less wall time than -j 1 (ideal: half). The
result records the machine's load average before each batch, because other work on a shared machine moves
these numbers more than anything the grader does. Each configuration runs `--repeats` times; the median counts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab.grade.grader import GradeOptions, grade  # noqa: E402

LAB = ROOT / "tests" / "fixtures" / "grading" / "labs" / "90_fixture"
SUBMISSION = ROOT / "tests" / "fixtures" / "grading" / "submissions" / "correct.ipynb"


def one_batch(jobs: int, subs: list[Path], out: Path) -> dict:
    """Grade `subs` with `jobs` at a time; wall time and per-submission durations."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    batch = grade(LAB, subs, out, GradeOptions(jobs=jobs))
    wall = time.perf_counter() - start
    bad = [r.student for r in batch.results if r.percent != 100]
    if bad:
        raise SystemExit(f"bench_grade: {bad} did not grade 100 % (see {out}/feedback)")
    return {"jobs": jobs, "wall_s": round(wall, 2), "load_before": round(load, 2),
            "per_submission_s": [r.duration_s for r in batch.results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_grade.json"))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grade-"))
    try:
        subs = []
        for i in range(args.submissions):
            subs.append(tmp / "subs" / f"student{i:02d}.ipynb")
            subs[-1].parent.mkdir(exist_ok=True)
            shutil.copyfile(SUBMISSION, subs[-1])
        runs = {1: [], 2: []}
        for rep in range(args.repeats):
            for jobs in (1, 2):  # interleaved, so a change in machine load hits both alike
                runs[jobs].append(one_batch(jobs, subs, tmp / f"out-{jobs}-{rep}"))
                print(f"-j {jobs}: {runs[jobs][-1]['wall_s']} s (load {runs[jobs][-1]['load_before']})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {j: round(statistics.median(r["wall_s"] for r in runs[j]), 2) for j in runs}
    result = {"benchmark": "grade", "submissions": args.submissions, "repeats": args.repeats,
              "median_wall_s": {"j1": med[1], "j2": med[2]}, "speedup_j2_over_j1": round(med[1] / med[2], 3),
              "j2_faster": med[2] < med[1], "runs": runs,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "root": os.geteuid() == 0,
                          "platform": platform.platform()},
              "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.submissions} submissions: -j 1 {med[1]} s, -j 2 {med[2]} s, speedup {result['speedup_j2_over_j1']}x -> {args.out}")
    return 0 if result["j2_faster"] else 1


if __name__ == "__main__":
    sys.exit(main())
