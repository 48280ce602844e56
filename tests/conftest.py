"""Shared test set-up.

Tests that need a real part (Slurm, Horovod, MPI, a browser, a hub) carry a marker. Outside CI they skip
with the command that installs what is missing; under CI=true a missing part FAILS the test, so CI can
never go green by skipping them.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
PY = sys.executable
# every run a test starts holds its events to the declaration (scalelab/run/event_types.py): an undeclared event
# type or field fails that run, and with it the test
os.environ.setdefault("SCALELAB_STRICT_EVENTS", "1")


def require(ok: bool, what: str, fix: str) -> None:
    """Skip (locally) or fail (under CI=true) when a real part the test needs is missing."""
    if ok:
        return
    message = f"{what} is missing; {fix}"
    if CI:
        pytest.fail(f"CI=true: this test must run, but {message}", pytrace=False)
    pytest.skip(message)


def _has_horovod() -> bool:
    if importlib.util.find_spec("horovod") is None:
        return False
    import subprocess
    r = subprocess.run([PY, "-c", "import horovod.torch"], capture_output=True)
    return r.returncode == 0


def _netns_problem() -> str | None:
    from scalelab.cluster.netns import unavailable
    return unavailable()


CHECKS = {
    "horovod": lambda: require(_has_horovod(), "Horovod (horovod.torch)", "run `bash tools/ensure_horovod.sh`"),
    "mpi": lambda: require(shutil.which("mpirun") is not None, "Open MPI (mpirun)",
                           "run `apt-get install openmpi-bin libopenmpi-dev`"),
    "slurm": lambda: require(all(shutil.which(b) for b in ("slurmctld", "sbatch", "slurmdbd", "mariadbd")),
                             "Slurm (slurmctld, sbatch) and its accounting (slurmdbd, mariadbd)",
                             "run `apt-get install slurm-wlm munge slurmdbd mariadb-server`"),
    "netns": lambda: require(_netns_problem() is None, "network namespaces (root, ip, tc, nsenter, unshare)",
                             f"{_netns_problem()}: run the tests as root on Linux with iproute2 and util-linux"),
    "browser": lambda: require(Path("/usr/bin/chromium").exists(), "Chromium (/usr/bin/chromium)",
                               "run `apt-get install chromium chromium-driver`"),
    "hub": lambda: require(shutil.which("configurable-http-proxy") is not None
                           or (Path(sys.prefix) / "bin" / "configurable-http-proxy").exists(),
                           "configurable-http-proxy", "run `bash tools/ensure_chp.sh` (or `make test`)"),
}


@pytest.fixture(autouse=True)
def _real_parts(request):
    for name, check in CHECKS.items():
        if request.node.get_closest_marker(name):
            check()
    if request.node.get_closest_marker("gpu"):  # CI machines have no GPU: these skip there, and run on a GPU node
        import torch
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU on this machine: run `pytest -m gpu tests/test_gpu.py` on a GPU node")


@pytest.fixture(autouse=True)
def _shared_cluster_left_working(request):
    """After each test of the clusters group: the shared local Slurm can still start jobs, else this test errors with
    Slurm's reason and the cluster is resumed for the tests after it (tests/cluster_watch.py)."""
    yield
    if os.geteuid() == 0 and xdist_group_of(request.node) == "clusters":
        import cluster_watch
        found = cluster_watch.after_test(request.node.nodeid)
        if found:
            pytest.fail(found, pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_reservation(request):
    """A module whose tests all share the local Slurm leaves no reservation of its own behind (see
    tests/cluster_watch.after_module); a module split over both workers is not watched (the other may be making one)."""
    mine = [i for i in request.session.items if i.path == request.node.path]
    if os.geteuid() != 0 or not mine or any(xdist_group_of(i) != "clusters" for i in mine):
        yield
        return
    import cluster_watch
    cluster = cluster_watch.running_cluster()
    before = cluster_watch.reservations(cluster) if cluster is not None else set()
    yield
    found = cluster_watch.after_module(request.node.nodeid, before)
    if found:
        pytest.fail(found, pytrace=False)


@contextlib.contextmanager
def one_worker_holds(part: str):
    """Fail when a second worker of this run sets up `part`: the tests sharing it were not kept to one worker
    (xdist_group_of below), and two workers would each start their own (two clusters on one state, every lab
    graded twice)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one process: nothing to share
        yield
        return
    import fcntl
    import tempfile
    with open(Path(tempfile.gettempdir()) / f"scalelab-tests-{run}-{part}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail(f"worker {os.environ.get('PYTEST_XDIST_WORKER')} sets up {part}, which another worker of "
                        "this run holds: its tests were not kept to one worker (tests/conftest.py: xdist_group_of; "
                        "is --dist loadgroup working with this pytest?)", pytrace=False)
        yield


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm, started once for the session (or reused if already up)."""
    CHECKS["slurm"]()
    from scalelab.cluster.local import LocalCluster
    with one_worker_holds("slurm_cluster"):
        cluster = LocalCluster()
        cluster.up()
        if os.geteuid() == 0:
            import cluster_watch
            cluster_watch.clear_leftovers(cluster)  # an earlier, killed run's reservations and partitions
        yield cluster


@pytest.fixture(scope="session")
def nodes_cluster():
    """A real 2-node Slurm in network namespaces (2 stand-in GPUs per node), beside the 1-node one: started once
    for the session in its own state directory and ports, and brought down (namespaces, links, daemons) at the end."""
    CHECKS["slurm"]()
    CHECKS["netns"]()
    import tempfile
    from scalelab.cluster.nodes import NodesCluster
    with one_worker_holds("nodes_cluster"):
        cluster = NodesCluster(Path(tempfile.gettempdir()) / "scalelab-test-nodes", nodes=2, gpus_per_node=2)
        cluster.up()
        yield cluster
        cluster.down()


@pytest.fixture(scope="session")
def lab_gradings(request, tmp_path_factory):
    """The run's one grading of every lab the selected tests need (tests/labtests.py): graded under load in the
    sandbox, read by the grading, forgery, lab story and site tests instead of each executing the labs again."""
    from labtests import LabGradings, labs_needed
    with one_worker_holds("lab_gradings"), \
            LabGradings(labs_needed(request.session.items), tmp_path_factory.mktemp("lab-gradings")) as gradings:
        yield gradings


# -- running side by side (pytest-xdist, `make test`: -n 2 --dist loadgroup) -------------------------------------
# Tests that share a machine-wide part run on one worker, one after another: every test that starts or uses the
# local Slurm clusters, a hub or Unix accounts ("clusters": one LocalCluster state, one 2-node namespace cluster,
# useradd's lock), and every test that reads the run's one grading of the labs ("labs": a session fixture, so one
# worker holds it). Everything else is spread over the workers as they come free.
CLUSTER_MARKERS = ("slurm", "netns", "hub")
CLUSTER_FIXTURES = ("slurm_cluster", "nodes_cluster")
CLUSTER_MODULES = ("test_cluster", "test_course_workflow", "test_multinode", "test_resilience_nodes")


def xdist_group_of(item) -> str | None:
    """The group an item must share a worker with (None: any worker)."""
    module = item.path.stem
    if (any(item.get_closest_marker(m) for m in CLUSTER_MARKERS) or set(CLUSTER_FIXTURES) & set(item.fixturenames)
            or module in CLUSTER_MODULES or module.startswith("test_hub_")):
        return "clusters"
    if "lab_gradings" in item.fixturenames:
        return "labs"
    return None


GROUP_ORDER = {"labs": 0, "clusters": 1, None: 2}
"""The longest group first: xdist hands out work in collection order, and the labs' grading is the run's long pole."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    groups = {item: xdist_group_of(item) for item in items}
    for item, group in groups.items():
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False):  # a worker of -n N: sort; a plain run keeps the file order
        items.sort(key=lambda item: GROUP_ORDER[groups[item]])


# -- where the time goes: every run ends with the time per test file ---------------------------------------------
_FILE_TIMES: dict[str, list[float]] = {}  # file -> [seconds summed over its tests' phases, first start, last stop]


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # this run's findings only (tests/cluster_watch.py)
        (ROOT / "build" / "cluster-watch.txt").unlink(missing_ok=True)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    t = _FILE_TIMES.setdefault(path, [0.0, float("inf"), 0.0])
    t[0] += report.duration
    if getattr(report, "start", None) is not None:
        t[1], t[2] = min(t[1], report.start), max(t[2], report.stop)


def pytest_terminal_summary(terminalreporter, config):
    if not _FILE_TIMES or hasattr(config, "workerinput"):
        return
    import json
    rows = sorted(_FILE_TIMES.items(), key=lambda kv: -kv[1][0])
    total = sum(t[0] for _, t in rows)
    tr = terminalreporter
    tr.section(f"time per test file ({len(rows)} files, {total:.0f} s of test time in all)")
    tr.write_line(f"{'seconds':>8} {'share':>6} {'first start to last end':>24}  file")
    for path, (busy, start, stop) in rows:
        span = f"{stop - start:.0f} s" if stop >= start else "-"
        tr.write_line(f"{busy:8.1f} {busy / max(total, 1e-9):6.1%} {span:>24}  {path}")
    out = ROOT / "build" / "test-times.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({path: {"seconds": round(busy, 2), "span_s": round(max(stop - start, 0.0), 2)}
                               for path, (busy, start, stop) in rows}, indent=1) + "\n")
    tr.write_line(f"(as JSON: {out.relative_to(ROOT)})")
