"""Grading throughput as Slurm jobs: submissions per node-hour for one lab, `--slurm` against the local path.

    flock /tmp/scalelab-cluster-tests.lock .venv/bin/python bench/bench_grade_slurm.py   # -> bench/results/bench_grade_slurm.json
    .venv/bin/python bench/bench_grade_slurm.py --submissions 8 --repeats 2 --jobs 2
    .venv/bin/python bench/bench_grade_slurm.py --lab labs/05_data_pipeline --submission labs/05_data_pipeline/lab.ipynb

As root, with the local 1-node cluster (started if it is down): the same N copies of one submission (default: the
fixture lab's correct notebook) graded on this host and as Slurm jobs on the 'grading' partition, both at `--jobs`
at a time, interleaved `--repeats` times (the median counts). The node is this machine, so submissions per
node-hour is N / wall hours; what --slurm adds per submission is the job's submission, scheduling and start (the
queue wait and the sacct elapsed time of each job are kept). A centre's throughput is this per node times the
grading partition's nodes, as long as `--jobs` keeps them all busy. Every submission must grade 100 %.
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
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab.cluster.local import LocalCluster  # noqa: E402
from scalelab.grade.grader import GradeOptions, grade  # noqa: E402
from scalelab.grade.slurm_grading import JOB_NAME, SlurmGrading  # noqa: E402

LAB = ROOT / "tests" / "fixtures" / "grading" / "labs" / "90_fixture"
SUBMISSION = ROOT / "tests" / "fixtures" / "grading" / "submissions" / "correct.ipynb"


def one_batch(mode: str, lab: Path, subs: list[Path], out: Path, jobs: int, cluster: LocalCluster) -> dict:
    """Grade `subs` on this host or as Slurm jobs; wall time, submissions per node-hour, and per job its queue wait."""
    slurm = SlurmGrading() if mode == "slurm" else None
    load = os.getloadavg()[0]
    start = time.perf_counter()
    batch = grade(lab, subs, out, GradeOptions(jobs=jobs, workdir="/tmp", slurm=slurm))
    wall = time.perf_counter() - start
    bad = [(r.student, r.status, r.percent) for r in batch.results if r.percent != 100]
    if bad:
        raise SystemExit(f"bench_grade_slurm: {bad} did not grade 100 % ({mode}; see {out}/feedback)")
    result = {"mode": mode, "jobs": jobs, "wall_s": round(wall, 2), "load_before": round(load, 2),
              "per_node_hour": round(len(subs) * 3600 / wall, 1),
              "per_submission_s": [r.duration_s for r in batch.results]}
    if slurm:
        ids = ",".join(r.sandbox["slurm"]["job"] for r in batch.results)
        rows = cluster.run("sacct", "-n", "-X", "-P", "-j", ids, "-o", "JobID,Submit,Start,ElapsedRaw,State",
                           check=False).stdout.splitlines()
        waits = [(datetime.fromisoformat(r.split("|")[2]) - datetime.fromisoformat(r.split("|")[1])).total_seconds()
                 for r in rows]
        result.update(slurm_jobs=len(rows), queue_wait_s=waits,
                      job_elapsed_s=[int(r.split("|")[3]) for r in rows])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", default=str(LAB))
    parser.add_argument("--submission", default=str(SUBMISSION), help="the notebook every student hands in")
    parser.add_argument("--submissions", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="submissions in flight at once, both ways")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_grade_slurm.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_grade_slurm: run as root (the sandbox and the local cluster need it)")
    cluster = LocalCluster().up()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grade-slurm-"))
    try:
        subs = []
        for i in range(args.submissions):
            subs.append(tmp / "subs" / f"student{i:02d}.ipynb")
            subs[-1].parent.mkdir(exist_ok=True)
            shutil.copyfile(args.submission, subs[-1])
        runs = {"local": [], "slurm": []}
        for rep in range(args.repeats):
            for mode in runs:  # interleaved, so a change in the machine's load hits both alike
                runs[mode].append(one_batch(mode, Path(args.lab), subs, tmp / f"out-{mode}-{rep}", args.jobs, cluster))
                print(f"{mode}: {runs[mode][-1]['wall_s']} s, {runs[mode][-1]['per_node_hour']} per node-hour "
                      f"(load {runs[mode][-1]['load_before']})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: round(statistics.median(r["wall_s"] for r in runs[m]), 2) for m in runs}
    per_hour = {m: round(args.submissions * 3600 / med[m], 1) for m in runs}
    result = {"benchmark": "grade_slurm", "lab": Path(args.lab).name, "submission": Path(args.submission).name,
              "submissions": args.submissions, "jobs": args.jobs, "repeats": args.repeats, "nodes": 1,
              "median_wall_s": med, "submissions_per_node_hour": per_hour,
              "slurm_over_local": round(per_hour["slurm"] / per_hour["local"], 3), "runs": runs,
              "command": "flock /tmp/scalelab-cluster-tests.lock .venv/bin/python bench/bench_grade_slurm.py "
                         + " ".join(sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
              "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.submissions} submissions of {result['lab']} at -j {args.jobs}: local {med['local']} s "
          f"({per_hour['local']}/node-hour), --slurm {med['slurm']} s ({per_hour['slurm']}/node-hour) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
