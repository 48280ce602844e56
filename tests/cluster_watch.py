"""The local Slurm between the tests that share it (tests/conftest.py calls this after each test of the clusters group).

Every test of that group uses one LocalCluster. A node left unusable (drained, down: Slurm's "Kill task failed" on a
loaded machine, a failing Epilog) or a base partition left DOWN by one test makes every job after it pend, so a CI
run showed seven failures and a 600 s timeout with no word of why. Here the test during which it happened gets an
error naming the node, its state, Slurm's reason and slurmctld's last words about it, and the node (or partition) is
resumed, so the tests after it see a cluster that works. Each finding is also appended to build/cluster-watch.txt,
which `.ci/run` prints at the end of a failed run.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

WATCH_LOG = Path(__file__).resolve().parent.parent / "build" / "cluster-watch.txt"
NOTABLE = re.compile(r"drain|not responding|kill task failed|epilog|prolog|down|invalid|unkillable|error",
                     re.IGNORECASE)
NOISE = ("MailProg is invalid", "Could not open", "Trying backup state", "No fed_mgr state", "Invalid partition (hub",
         "Cached username", "_slurm_rpc_delete_partition", "No node state file")


def running_cluster():
    """The default LocalCluster when its daemons run (the one the clusters group shares), else None."""
    from scalelab.cluster.local import LocalCluster
    cluster = LocalCluster()
    if not cluster.conf_path.exists() or not all(cluster._running().values()):
        return None
    return cluster


def base_partitions(cluster) -> set[str]:
    """The partitions slurm.conf defines (a test may create and drop others of its own)."""
    return set(re.findall(r"^PartitionName=(\S+)", cluster.conf_path.read_text(), re.MULTILINE))


def problems(cluster) -> list[str]:
    """What keeps jobs from starting now: unusable nodes and base partitions that are not UP."""
    from scalelab.cluster.conf import node_usable, parse_scontrol
    found = []
    for n in cluster._nodes():
        if not node_usable(n.get("State", "")):
            found.append(f"node {n.get('NodeName')}: {n.get('State')} (reason: {n.get('Reason') or 'none given'})")
    shown = parse_scontrol(cluster.run("scontrol", "show", "partition", "-o", timeout=15).stdout, "PartitionName")
    base = base_partitions(cluster)
    for p in shown:
        if p.get("PartitionName") in base and p.get("State") != "UP":
            found.append(f"partition {p['PartitionName']}: {p.get('State')}")
    return found


def heal(cluster) -> None:
    """Resume unusable nodes (one that is NOT_RESPONDING comes back when its slurmd answers) and set base partitions UP."""
    from scalelab.cluster.conf import node_usable, parse_scontrol
    for n in cluster._nodes():
        if not node_usable(n.get("State", "")):
            cluster.run("scontrol", "update", f"NodeName={n['NodeName']}", "State=RESUME", check=False)
    shown = parse_scontrol(cluster.run("scontrol", "show", "partition", "-o", timeout=15).stdout, "PartitionName")
    for p in shown:
        if p.get("PartitionName") in base_partitions(cluster) and p.get("State") != "UP":
            cluster.run("scontrol", "update", f"PartitionName={p['PartitionName']}", "State=UP", check=False)


def ctld_words(cluster, lines: int = 12) -> list[str]:
    """slurmctld's and slurmd's last notable log lines (drains, kills, daemons not answering), known noise left out."""
    out = []
    for log in (cluster.paths.ctld_log, cluster.paths.slurmd_log):
        try:
            text = log.read_text(errors="replace").splitlines()[-4000:]
        except OSError:
            continue
        out += [f"{log.name}: {line}" for line in text if NOTABLE.search(line) and not any(n in line for n in NOISE)]
    return out[-lines:]


def queue(cluster) -> list[str]:
    """Every job Slurm holds that has not ended: id, user, state, reason, time used and limit, name."""
    r = cluster.run("squeue", "-h", "-o", "%i %u %T %r %M/%l %j", check=False, timeout=15)
    return r.stdout.strip().splitlines()


def after_test(nodeid: str, log: Path | None = WATCH_LOG) -> str | None:
    """Check the shared cluster after test `nodeid`; on a finding: heal it, log it, and return what to fail with."""
    from scalelab.cluster.local import ClusterError
    try:
        cluster = running_cluster()
        if cluster is None:
            return None
        found = problems(cluster)
        if not found:
            return None
        words, jobs = ctld_words(cluster), queue(cluster)
        left = found
        deadline = time.monotonic() + 20  # a node still COMPLETING a job may take the resume a moment later
        while left and time.monotonic() < deadline:
            heal(cluster)
            time.sleep(1.0)
            left = problems(cluster)
    except ClusterError as e:
        return f"the local Slurm did not answer after this test: {e}"
    text = (f"after {nodeid}: the local Slurm could not start jobs: {'; '.join(found)}"
            + (f"; still after resuming: {'; '.join(left)}" if left else "; resumed")
            + "\n  jobs held:\n    " + ("\n    ".join(jobs) or "none")
            + "\n  slurm logs (notable lines, newest last):\n    " + ("\n    ".join(words) or "none"))
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(time.strftime("%H:%M:%S ") + text + "\n")
    return text


def reservations(cluster) -> set[str]:
    """The names of the reservations Slurm holds now."""
    from scalelab.cluster.conf import parse_scontrol
    r = cluster.run("scontrol", "show", "reservation", "-o", check=False, timeout=15)
    return {x["ReservationName"] for x in parse_scontrol(r.stdout, "ReservationName")}


def after_module(module: str, before: set[str], log: Path | None = WATCH_LOG) -> str | None:
    """Reservations a test module made and left (a hub fixture's class reservation still in use at its teardown:
    its core held from every later job for up to two hours, the jobs asking for 2 CPUs pending all that time) are
    deleted, their jobs cancelled; what to fail with, or None."""
    from scalelab.cluster.local import ClusterError
    cluster = running_cluster()
    if cluster is None:
        return None
    left = sorted(reservations(cluster) - before)
    if not left:
        return None
    notes = []
    for name in left:
        try:
            cluster.drop_reservation(name, wait_s=5, cancel_jobs=True)
            notes.append(f"{name} (deleted)")
        except ClusterError as e:
            notes.append(f"{name} (could not be deleted: {e})")
    text = f"after {module}: reservations it made were left on the local Slurm: {'; '.join(notes)}"
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(time.strftime("%H:%M:%S ") + text + "\n")
    return text


TEST_PREFIXES = ("hubtest-", "hubdown-", "scalelab-test-", "watch-test-")
"""The names the tests give the reservations and partitions they make on the shared local Slurm."""


def clear_leftovers(cluster, log: Path | None = WATCH_LOG) -> list[str]:
    """At the start of a run: the reservations and partitions an earlier, killed run of the tests left (slurmctld
    keeps them across restarts; a one-core reservation holds every 2-CPU job of this run until it ends), removed
    with their jobs. What was removed."""
    from scalelab.cluster.conf import parse_scontrol
    from scalelab.cluster.local import ClusterError
    removed = []
    for name in sorted(reservations(cluster)):
        if name.startswith(TEST_PREFIXES):
            try:
                cluster.drop_reservation(name, wait_s=5, cancel_jobs=True)
                removed.append(f"reservation {name}")
            except ClusterError as e:
                removed.append(f"reservation {name} (could not be deleted: {e})")
    shown = parse_scontrol(cluster.run("scontrol", "show", "partition", "-o", timeout=15).stdout, "PartitionName")
    for p in shown:
        if p["PartitionName"].startswith(TEST_PREFIXES):
            cluster.run("scontrol", "delete", f"PartitionName={p['PartitionName']}", check=False)
            removed.append(f"partition {p['PartitionName']}")
    if removed and log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(time.strftime("%H:%M:%S ") + "before the run: an earlier run's leftovers removed: "
                    + "; ".join(removed) + "\n")
    return removed
