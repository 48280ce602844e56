"""Warm a class of 30 (issue 36, item 2): the time from the warm request to the first and to the last server ready.

    flock /tmp/scalelab-cluster-tests.lock .venv/bin/python bench/bench_class_warm.py
    .venv/bin/python bench/bench_class_warm.py --students 30 --nodes 2 --out bench/results/bench_class_warm.json

A real `scalelab hub` in Slurm mode on the local 2-node Slurm in network namespaces (root; bench_spawn's --nodes
set-up: each server listens on its node's address), with a class list of N students and a class reservation over
both nodes. A hub admin presses the dashboard's warm button through its API (`POST services/dashboard/api/warm`,
the admin's token), exactly as `scalelab course warm` does; nobody signs in as a student. Each server's ready time
is JupyterHub's own "User X took S seconds to start" line in the hub log (the spawn has returned and the proxy is
about to route it); the hub's user list, read once a second with the admin's token, says when all are ready (or
which are not). CPU per process kind during the warm and its floor (CPU / cores) as bench_spawn counts them.
Writes JSON; exit 1 unless every server became ready.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_spawn import PROFILE, rush_cpu, rush_processes, summary  # noqa: E402
from scalelab.testing.hub import HubRunner, slurm_settings  # noqa: E402

_READY = re.compile(r"\[I (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) .*User (\S+) took ([0-9.]+) seconds to start")


def ready_times(log_text: str, names: set[str]) -> dict[str, float]:
    """{student: epoch seconds at which JupyterHub logged their server started} from the hub log."""
    out = {}
    for m in _READY.finditer(log_text):
        if m.group(2) in names:
            out[m.group(2)] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return out


def watch(hub, token: str, names: set[str], until: threading.Event, timeout: float) -> dict:
    """Read the hub's user list once a second until every server in `names` is ready, `until` is set and none is
    starting any more, or `timeout`; {name: 'ready' | 'pending' | 'stopped'} at the end."""
    t0, states = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        r = requests.get(f"{hub.url}/hub/api/users", headers={"Authorization": f"token {token}"}, timeout=30)
        states = {}
        for u in r.json():
            if u["name"] in names:
                server = (u.get("servers") or {}).get("") or {}
                states[u["name"]] = "ready" if server.get("ready") else "pending" if server.get("pending") else "stopped"
        if all(states.get(n) == "ready" for n in names):
            break
        if until.is_set() and not any(s == "pending" for s in states.values()):
            break
        time.sleep(1)
    return states


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--students", type=int, default=30, help="students on the class list (default 30)")
    p.add_argument("--nodes", type=int, default=2, help="Slurm nodes of the namespace cluster (default 2)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for every server (default 600)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_class_warm.json"))
    args = p.parse_args(argv)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    from scalelab.cluster.netns import host_addr
    from scalelab.cluster.nodes import NodesCluster
    cluster = NodesCluster(Path(tempfile.gettempdir()) / "scalelab-bench-nodes", nodes=args.nodes,
                           gpus_per_node=0).up()
    resv = "class-warm-bench"
    nodes = ",".join(n["name"] for n in cluster.status()["nodes"])
    cluster.run("scontrol", "delete", f"ReservationName={resv}", check=False)
    cluster.run("scontrol", "create", "reservation", f"ReservationName={resv}", "Users=root", "StartTime=now",
                "Duration=120", f"Nodes={nodes}", "Flags=IGNORE_JOBS")
    settings = slurm_settings(cluster, resv, [PROFILE])
    settings["slurm"].update(server_ip="0.0.0.0", node_address="")  # each server on its node's address
    settings["hub"] = {"hub_ip": host_addr()}  # the nodes reach the hub's API over the bridge
    settings["servers"]["start_timeout"] = int(args.timeout)
    load_start = [round(x, 2) for x in os.getloadavg()]
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        hub = HubRunner(tmp, mode="slurm", settings=settings, admins=["prof"])
        names = [hub.user(f"s{i:02d}") for i in range(args.students)]
        hub.settings["auth"]["allowed_users"] = names
        import yaml
        hub.config_path.write_text(yaml.safe_dump(hub.settings, sort_keys=False), encoding="utf-8")
        try:
            hub.start()
            prof = hub.login("prof")
            roots = [hub.proc.pid, *(pid for pid in cluster.pids().values() if pid)]
            before = rush_processes(roots)
            done, answer = threading.Event(), {}

            def press():
                t = time.time()
                r = requests.post(f"{hub.url}/services/dashboard/api/warm", json={},
                                  headers={"Authorization": f"token {prof.token}"}, timeout=args.timeout)
                answer.update(status=r.status_code, body=r.json() if r.ok else r.text[:2000],
                              request_s=round(time.time() - t, 2))
                done.set()
            t0 = time.time()
            presser = threading.Thread(target=press)
            presser.start()
            states = watch(hub, prof.token, set(names), done, args.timeout)
            presser.join(args.timeout)
            cpu = rush_cpu(before, rush_processes(roots), len(names))
            log = hub.log_path.read_text(errors="replace")
            ready = ready_times(log, set(names))
            jobs = hub.jobs()
            after = sorted(t - t0 for t in ready.values())
            outcomes: dict[str, int] = {}
            for r in (answer.get("body") or {}).get("results", []) if isinstance(answer.get("body"), dict) else []:
                outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            result = {
                "benchmark": f"warm a class of {args.students} on the local {args.nodes}-node Slurm (namespaces): "
                             "the dashboard's warm (as `scalelab course warm`), first and last server ready",
                "command": "python bench/bench_class_warm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "machine": {"cpus": os.cpu_count(), "slurm_nodes": args.nodes, "python": platform.python_version(),
                            "load_avg_at_start": load_start,
                            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
                "profile": PROFILE, "reservation": resv,
                "warm_request": {k: v for k, v in answer.items() if k != "body"}, "outcomes": outcomes,
                "ready": {"count": sum(s == "ready" for s in states.values()), "of": args.students,
                          "not_ready": sorted(n for n in names if states.get(n) != "ready"),
                          "first_s": round(after[0], 2) if after else None,
                          "last_s": round(after[-1], 2) if after else None,
                          "first_to_last_s": round(after[-1] - after[0], 2) if after else None,
                          "after_request": summary(after)},
                "jobs_in_reservation": sum(j.get("reservation") == resv for j in jobs),
                "cpu": cpu,
            }
            if result["ready"]["not_ready"]:
                Path(args.out).with_suffix(".hub.log").write_text(log)
                result["answer"] = answer.get("body")
        finally:
            hub.cleanup()
            cluster.run("scontrol", "delete", f"ReservationName={resv}", check=False)
            cluster.down()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result.get("ready", {}).get("count") == args.students else 1


if __name__ == "__main__":
    sys.exit(main())
