"""Hub spawn latency on the local single-node Slurm: spawn→ready, one at a time and 10 at once.

    .venv/bin/python bench/bench_spawn.py                 # 7 sequential spawns, then 10 concurrent ones
    .venv/bin/python bench/bench_spawn.py --runs 5 --concurrent 10 --out bench/results/bench_spawn.json

A real `scalelab hub` in slurm mode (as in the end-to-end tests) on free ports in a temporary directory; each
spawn is timed from the REST request to the moment the hub reports the server ready (the job ran, the server
reported its port and answers). Targets: median ≤ 5 s, all concurrent spawns succeed. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scalelab.cluster.local import LocalCluster  # noqa: E402
from scalelab.testing.hub import HubRunner, slurm_settings  # noqa: E402

PROFILE = {"name": "bench", "display_name": "bench", "partition": "cpu", "cpus_per_task": 1, "memory": "1G",
           "walltime": "0:30:00"}
TARGET_MEDIAN_S = 5.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def timed_spawn(user, timeout: float = 180) -> float:
    """Seconds from the spawn request until the server is ready."""
    t0 = time.monotonic()
    r = user.spawn(options={"profile": "bench"})
    if r.status_code not in (201, 202):
        raise RuntimeError(f"spawn refused: {r.status_code} {r.text}")
    user.wait_ready(timeout=timeout)
    return time.monotonic() - t0


def stop(user) -> None:
    user.stop()
    user.wait_gone(timeout=60)


def sequential(hub, runs: int) -> list[float]:
    user = hub.login("seq")
    times = []
    for _ in range(runs):
        times.append(timed_spawn(user))
        stop(user)
        time.sleep(1)  # let Slurm finish the job before the next one
    return times


def concurrent(hub, n: int) -> tuple[list[float], list[str], float]:
    users = [hub.login(f"c{i}") for i in range(n)]
    times: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(user):
        try:
            t = timed_spawn(user)
            with lock:
                times.append(t)
        except Exception as e:  # noqa: BLE001  (a failed spawn is a result here)
            with lock:
                errors.append(f"{user.name}: {e}"[:500])

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    for u in users:
        try:
            stop(u)
        except Exception:  # noqa: BLE001
            pass
    return times, errors, wall


_STAMP = r"\[I (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) "


def phases(log_text: str, user: str) -> dict:
    """Median seconds per phase of `user`'s spawns, from the hub log: submit → port reported (Slurm starts the
    job, the wrapper reports) → server listening (JupyterLab starts)."""
    from datetime import datetime

    def stamps(pattern: str) -> list[float]:
        out = []
        for m in re.finditer(_STAMP + r".*" + pattern, log_text):
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp())
        return out

    submit = stamps(rf"Submitted job \d+ for {user} ")
    port = stamps(rf"POST /hub/api/batchspawner \({user}@")
    serving = stamps(rf"Job \d+ of {user} serves at")
    n = min(len(submit), len(port), len(serving))
    if not n:
        return {}
    return {"submit_to_port_s": round(statistics.median(port[i] - submit[i] for i in range(n)), 2),
            "port_to_listening_s": round(statistics.median(serving[i] - port[i] for i in range(n)), 2)}


def summary(times: list[float]) -> dict:
    if not times:
        return {"n": 0}
    return {"n": len(times), "median_s": round(statistics.median(times), 2), "p95_s": round(percentile(times, 95), 2),
            "min_s": round(min(times), 2), "max_s": round(max(times), 2), "all_s": [round(t, 2) for t in times]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=7, help="sequential spawns (median over them; default 7)")
    p.add_argument("--concurrent", type=int, default=10, help="spawns started at once (default 10)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_spawn.json"))
    args = p.parse_args(argv)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    cluster = LocalCluster().up()
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-spawn-") as tmp:
        hub = HubRunner(tmp, mode="slurm", settings=slurm_settings(cluster, "", [PROFILE]))
        try:
            hub.start()
            seq = sequential(hub, args.runs)
            conc, errors, wall = concurrent(hub, args.concurrent)
            seq_phases = phases(hub.log_path.read_text(errors="replace"), hub.user("seq"))
        finally:
            hub.cleanup()
    s_seq, s_conc = summary(seq), summary(conc)
    result = {
        "benchmark": "hub spawn→ready on the local single-node Slurm (scalelab hub, slurm mode, REST API)",
        "command": "python bench/bench_spawn.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_at_start": load_start,
                    "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "hub": {"poll_min_s": 0.5, "poll_max_s": 5.0, "wrapper": "python -m scalelab.hub.singleuser"},
        "sequential": {**s_seq, "phases_median": seq_phases},
        "concurrent": {**s_conc, "requested": args.concurrent, "succeeded": len(conc),
                       "success_rate": round(len(conc) / args.concurrent, 3), "wall_s": round(wall, 2),
                       "errors": errors},
        "targets": {"median_s_max": TARGET_MEDIAN_S, "median_ok": bool(seq) and s_seq["median_s"] <= TARGET_MEDIAN_S,
                    "all_concurrent_ok": not errors and len(conc) == args.concurrent},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["targets"]["median_ok"] and result["targets"]["all_concurrent_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
