"""Shared test set-up.

Tests that need a real part (Slurm, Horovod, MPI, a browser, a hub) carry a marker. Outside CI they skip
with the command that installs what is missing; under CI=true a missing part FAILS the test, so CI can
never go green by skipping them.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
PY = sys.executable


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
    "slurm": lambda: require(shutil.which("slurmctld") is not None and shutil.which("sbatch") is not None,
                             "Slurm (slurmctld, sbatch)", "run `apt-get install slurm-wlm munge`"),
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


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm, started once for the session (or reused if already up)."""
    CHECKS["slurm"]()
    from scalelab.cluster.local import LocalCluster
    cluster = LocalCluster()
    cluster.up()
    yield cluster


@pytest.fixture(scope="session")
def nodes_cluster():
    """A real 2-node Slurm in network namespaces (2 stand-in GPUs per node), beside the 1-node one: started once
    for the session in its own state directory and ports, and brought down (namespaces, links, daemons) at the end."""
    CHECKS["slurm"]()
    CHECKS["netns"]()
    import tempfile
    from scalelab.cluster.nodes import NodesCluster
    cluster = NodesCluster(Path(tempfile.gettempdir()) / "scalelab-test-nodes", nodes=2, gpus_per_node=2)
    cluster.up()
    yield cluster
    cluster.down()
