"""A real N-node Slurm on one machine (issue 13): each node its own network namespace and hostname, so ranks on
two nodes talk TCP between two hosts. No mocks: real namespaces, slurmd per node, gloo, Open MPI, Horovod.

One 2-node cluster (2 stand-in GPUs per node) serves the whole session (`nodes_cluster` in conftest.py); tests
that break it (node loss, kill -9, down) bring it back before they end.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalelab.cluster import netns
from scalelab.cluster.conf import hosts_text, multinode_conf_text
from scalelab.cluster.nodes import NodesCluster
from scalelab.errors import ClusterError, LaunchError
from scalelab.launch import launch
from scalelab.launch.srun import allocation, check_fits

from helpers import loss_curve, processes_of, tiny

ROOT = Path(__file__).resolve().parent.parent
NODES = [("node1", "10.213.0.11"), ("node2", "10.213.0.12")]


# -- text: the configuration and the checks, on any machine ------------------------------------------------------

def _conf(**kw):
    args = dict(cluster_name="t", ctld_host="host", ctld_addr="10.213.0.1", nodes=NODES, cpus=2,
                real_memory_mb=24000, gpus=0, state_dir="/s", ctld_port=6827, slurmd_port=6828)
    return multinode_conf_text(**{**args, **kw})


def test_each_node_is_its_own_host_on_the_bridge_with_its_own_files():
    text = _conf()
    assert "SlurmctldHost=host(10.213.0.1)" in text and "SlurmctldPort=6827" in text and "SlurmdPort=6828" in text
    assert "NodeName=node1 NodeAddr=10.213.0.11 NodeHostname=node1 CPUs=2" in text
    assert "NodeName=node2 NodeAddr=10.213.0.12 NodeHostname=node2 CPUs=2" in text
    # one slurmd per node on one file system: pid, log and spool must differ per node
    assert "SlurmdPidFile=/s/run/slurmd-%n.pid" in text and "SlurmdSpoolDir=/s/spool/%n" in text
    assert "SlurmdLogFile=/s/log/slurmd-%n.log" in text
    assert "PartitionName=cpu Nodes=node1,node2 Default=YES" in text and "gres" not in text.lower()
    # the machine's memory (minus headroom) is shared between the nodes, not promised twice
    assert "RealMemory=10800" in text


def test_gpu_nodes_get_gres_and_a_gpu_partition_and_lost_nodes_show_quickly():
    text = _conf(gpus=2)
    assert "GresTypes=gpu" in text and text.count("Gres=gpu:2") == 2
    assert "PartitionName=gpu Nodes=node1,node2 Default=NO" in text
    assert "SlurmdTimeout=15" in text  # a lost node shows DOWN in seconds, not minutes


def test_every_node_resolves_every_other_and_the_controller():
    text = hosts_text("host", "10.213.0.1", NODES)
    assert "10.213.0.1 host\n" in text and "10.213.0.11 node1\n" in text and "10.213.0.12 node2\n" in text
    assert "127.0.0.1 localhost" in text


@pytest.mark.parametrize("rate, bits", [("1gbit", 1e9), ("100mbit", 1e8), ("500kbit", 5e5), ("1mbps", 8e6)])
def test_link_rates_read_as_tc_reads_them(rate, bits):
    assert netns.rate_bits(rate) == bits


@pytest.mark.parametrize("rate", ["1x", "fast", "0gbit", "-1mbit", "1 gbit"])
def test_a_bad_link_rate_is_refused_naming_it_and_the_units(rate):
    with pytest.raises(ClusterError, match="--link-rate .*1gbit, 100mbit"):
        NodesCluster("/nonexistent-state", nodes=2, link_rate=rate)


def test_not_root_is_told_why_and_gets_the_one_node_cluster(monkeypatch, tmp_path, capsys):
    from scalelab.cli import cluster as cli
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "need root (you are uid 1000)" in netns.unavailable()
    args = type("A", (), dict(nodes=2, gpus_per_node=0, link_rate=None, timeout=1, state_dir=str(tmp_path)))
    # the fallback is the 1-node cluster, which itself needs root and says how to get it
    with pytest.raises(ClusterError, match="sudo scalelab cluster up"):
        cli._cli_up(args)
    assert "needs network namespaces, but network namespaces need root" in capsys.readouterr().err


def test_the_allocation_is_read_from_slurm_variables_and_too_much_is_refused_naming_it():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
    alloc = allocation(env)
    assert alloc == {"job_id": "42", "nodes": 2, "nodelist": "node[1-2]", "cpus_per_node": [2, 2]}
    assert allocation({"PATH": "/bin"}) is None
    check_fits(tiny(Path("/tmp"), workers=2, launcher="slurm", **{"world.nodes": 2}), alloc)  # fits
    with pytest.raises(LaunchError, match=r"world.nodes=3 .*job 42: 2 node\(s\) node\[1-2\]"):
        check_fits(tiny(Path("/tmp"), workers=1, launcher="slurm", **{"world.nodes": 3}), alloc)
    with pytest.raises(LaunchError, match=r"workers_per_node=3 .*2 on its smallest node"):
        check_fits(tiny(Path("/tmp"), workers=3, launcher="slurm", **{"world.nodes": 2}), alloc)


# -- the live 2-node cluster ------------------------------------------------------------------------------------

def _srun(cluster, *args, timeout=60):
    return cluster.run("srun", *args, timeout=timeout)


@pytest.mark.slurm
@pytest.mark.netns
def test_two_nodes_are_two_hosts_with_their_own_names_and_addresses(nodes_cluster):
    r = _srun(nodes_cluster, "-N2", "-n2", "-l", "sh", "-c", "echo $(hostname) $(hostname -i) "
              "$(ip -o -4 addr show dev eth0 | awk '{print $4}')")
    lines = sorted(line.split(":", 1)[1].split() for line in r.stdout.strip().splitlines())
    assert lines == [["node1", "10.213.0.11", "10.213.0.11/24"], ["node2", "10.213.0.12", "10.213.0.12/24"]]
    st = nodes_cluster.status()
    assert st["up"] and [(n["name"], n["addr"], n["gpus"]) for n in st["nodes"]] == [
        ("node1", "10.213.0.11", 2), ("node2", "10.213.0.12", 2)]
    # nothing of the cluster is routed anywhere but the bridge: a node has no default route out of the machine
    routes = subprocess.run(["ip", "-n", netns.ns_name("node1"), "route"], capture_output=True, text=True).stdout
    assert "default" not in routes and "10.213.0.0/24 dev eth0" in routes


@pytest.mark.slurm
@pytest.mark.netns
def test_stand_in_gpus_are_scheduled_and_bound_and_compute_falls_back_to_cpu(nodes_cluster, tmp_path):
    r = _srun(nodes_cluster, "-p", "gpu", "-N2", "-n2", "--gres=gpu:1", "sh", "-c",
              "echo $(hostname)=$CUDA_VISIBLE_DEVICES")
    assert sorted(r.stdout.split()) == ["node1=0", "node2=0"]
    spec = tiny(tmp_path, workers=1, launcher="slurm", steps=3,
                **{"world.nodes": 2, "slurm.partition": "gpu", "slurm.gpus_per_node": 1})
    run = launch(spec, env={**os.environ, **nodes_cluster.env()})
    run.wait(timeout=120)
    starts = [e for e in run.events() if e["type"] == "start"]
    assert {(e["host"], e["cuda_visible_devices"], e["device"]) for e in starts} == {
        ("node1", "0", "cpu"), ("node2", "0", "cpu")}
    assert "torch sees no CUDA device: computing on the CPU" in run.logs(rank=0)


@pytest.fixture(scope="module")
def one_node_two_ranks(tmp_path_factory):
    """The tiny preset as 1 node x 2 ranks (local DDP): what 2 nodes x 1 rank must reproduce."""
    return launch(tiny(tmp_path_factory.mktemp("ref"))).wait(timeout=120)


@pytest.mark.slurm
@pytest.mark.netns
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("horovod", marks=[pytest.mark.horovod, pytest.mark.mpi])])
def test_two_nodes_one_rank_each_reach_the_loss_of_one_node_two_ranks(strategy, nodes_cluster, one_node_two_ranks,
                                                                      tmp_path):
    spec = tiny(tmp_path, workers=1, launcher="slurm", strategy=strategy, **{"world.nodes": 2})
    run = launch(spec, env={**os.environ, **nodes_cluster.env()})
    summary = run.wait(timeout=180)
    starts = {e["rank"]: e for e in run.events() if e["type"] == "start"}
    assert {r: e["host"] for r, e in starts.items()} == {0: "node1", 1: "node2"}  # two hosts, really
    if strategy == "ddp":  # the gloo interface came from the allocation: the link towards MASTER_ADDR (node1)
        assert {e["interface"] for e in starts.values()} == {"eth0"}
    assert spec.global_batch == tiny(tmp_path, name="ref").global_batch and summary["world_size"] == 2
    assert loss_curve(summary) == pytest.approx(loss_curve(one_node_two_ranks), rel=1e-3)


_IN_ALLOCATION = """
import json, sys
sys.path.insert(0, {tests!r})
from helpers import tiny
from scalelab.launch import launch
from pathlib import Path
spec = tiny(Path({out!r}), workers=1, launcher="slurm", strategy={strategy!r}, **{{"world.nodes": {nodes}}})
try:
    run = launch(spec)
except Exception as e:
    print(json.dumps({{"error": f"{{type(e).__name__}}: {{e}}"}})); sys.exit(0)
summary = run.wait(timeout=150)
hosts = sorted(e["host"] for e in run.events() if e["type"] == "start")
print(json.dumps({{"run": type(run).__name__, "hosts": hosts, "loss": summary["loss_curve"]}}))
"""


def _in_allocation(cluster, tmp_path, nodes_asked, salloc_nodes, strategy="ddp"):
    code = _IN_ALLOCATION.format(tests=str(ROOT / "tests"), out=str(tmp_path), strategy=strategy, nodes=nodes_asked)
    r = subprocess.run(["salloc", f"-N{salloc_nodes}", "--ntasks-per-node=1", "-t", "5", sys.executable, "-c", code],
                       env={**os.environ, **cluster.env()}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.slurm
@pytest.mark.netns
def test_inside_an_allocation_slurm_runs_steps_on_its_nodes_and_submits_no_job(nodes_cluster, one_node_two_ranks,
                                                                              tmp_path):
    out, err = _in_allocation(nodes_cluster, tmp_path, nodes_asked=2, salloc_nodes=2)
    job = err.split("Granted job allocation ")[1].split()[0]
    assert out["run"] == "SrunRun" and out["hosts"] == ["node1", "node2"]
    assert not (tmp_path / "run" / "job.sh").exists()  # no batch script: nothing was submitted
    assert (tmp_path / "run" / "logs" / "launcher.log").read_text().startswith(f"# job {job}: ")
    assert out["loss"] == pytest.approx(loss_curve(one_node_two_ranks), rel=1e-3)


@pytest.mark.slurm
@pytest.mark.netns
def test_asking_for_more_nodes_than_the_allocation_has_names_what_it_has(nodes_cluster, tmp_path):
    out, _ = _in_allocation(nodes_cluster, tmp_path, nodes_asked=2, salloc_nodes=1)
    assert out["error"].startswith("LaunchError: world.nodes=2 asks for more nodes than the allocation you are in")
    # the allocation's one node is whichever Slurm picked (node2 in a CI run)
    assert re.search(r"1 node\(s\) node[12]\b", out["error"]) and "salloc -N 2" in out["error"]


@pytest.mark.slurm
@pytest.mark.netns
def test_a_node_lost_mid_run_fails_it_naming_node_and_rank_and_comes_back(nodes_cluster, tmp_path):
    spec = tiny(tmp_path, workers=1, launcher="slurm", steps=100000, **{"world.nodes": 2})
    run = launch(spec, env={**os.environ, **nodes_cluster.env()})
    deadline = time.monotonic() + 120
    while not any(e["type"] == "step" for e in run.events()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.status == "running"
    lost = time.monotonic()
    nodes_cluster.kill_node("node2")  # its slurmd and rank 1 die with SIGKILL, as on a crashed node
    summary = run.wait(timeout=60, check=False)
    assert time.monotonic() - lost < 30
    assert summary["status"] == "failed" and summary["failed_rank"] == 1
    assert "node node2 was lost" in summary["error"] and "rank 1" in summary["error"]
    while processes_of(run.run_dir) and time.monotonic() - lost < 30:
        time.sleep(0.25)
    assert processes_of(run.run_dir) == []
    # slurmctld's own view: the node shows down once it misses its pings (SlurmdTimeout=15)
    while time.monotonic() - lost < 90:
        states = {n["name"]: n["state"] for n in nodes_cluster.status()["nodes"]}
        if states["node2"].startswith("down"):
            break
        time.sleep(1)
    assert states["node2"].startswith("down") and not states["node1"].startswith("down")
    nodes_cluster.up()  # brings node2 back (its namespace and slurmd only)
    assert sorted(_srun(nodes_cluster, "-N2", "-n2", "hostname").stdout.split()) == ["node1", "node2"]


def _daemon_pids(cluster) -> list[int]:
    return [pid for pid in cluster._running().values() if pid]


@pytest.mark.slurm
@pytest.mark.netns
def test_kill_9_of_every_daemon_then_up_repairs_and_down_leaves_nothing(nodes_cluster):
    pids = _daemon_pids(nodes_cluster)
    assert len(pids) == 4  # munged, slurmctld, slurmd on node1 and node2
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    nodes_cluster.up()
    assert sorted(_srun(nodes_cluster, "-N2", "-n2", "hostname").stdout.split()) == ["node1", "node2"]
    assert set(_daemon_pids(nodes_cluster)).isdisjoint(pids)
    nodes_cluster.down()
    assert nodes_cluster.leftovers() == []
    assert not [p for p in netns.namespaces()] and not netns.links() and not netns.mounts()
    # and up again with a shaped link, for the rest of the session: tc's own reading of each node's link
    shaped = NodesCluster(nodes_cluster.state_dir, nodes=2, gpus_per_node=2, link_rate="1gbit").up()
    assert [netns.link_rate(n) for n in shaped.node_names] == ["1Gbit", "1Gbit"]
    assert sorted(_srun(shaped, "-N2", "-n2", "hostname").stdout.split()) == ["node1", "node2"]


@pytest.mark.slurm
@pytest.mark.netns
def test_cli_status_lists_the_nodes_with_their_addresses(nodes_cluster):
    r = subprocess.run([sys.executable, "-m", "scalelab.cli", "cluster", "--state-dir", str(nodes_cluster.state_dir),
                        "status", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["kind"] == "namespaces" and [n["name"] for n in st["nodes"]] == ["node1", "node2"]
    assert st["namespaces"] == ["scalelab-node1", "scalelab-node2"]


# -- the ClusterStatus widget (headless) --------------------------------------------------------------------------

def test_cluster_status_says_when_slurm_does_not_answer(tmp_path):
    from scalelab.widgets import ClusterStatus
    status = ClusterStatus(env={"PATH": str(tmp_path), "SLURM_CONF": str(tmp_path / "none.conf")})  # no scontrol
    assert "scontrol not found" in status.snapshot["error"] and status.snapshot["nodes"] == []
    assert "cluster not reachable" in status.view.value and "none.conf" in status.view.value


@pytest.mark.slurm
@pytest.mark.netns
def test_cluster_status_shows_nodes_partitions_my_job_my_allocation_and_the_queue(nodes_cluster):
    from scalelab.widgets import ClusterStatus
    job = nodes_cluster.run("sbatch", "--parsable", "-N2", "-J", "status-probe", "-t", "2", "-o", "/dev/null",
                            "--wrap", "sleep 60").stdout.strip()
    try:
        inside = {**os.environ, **nodes_cluster.env(), "SLURM_JOB_ID": job, "SLURM_JOB_NUM_NODES": "2",
                  "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_CPUS_PER_NODE": "1(x2)"}
        status = ClusterStatus(env=inside)
        snap = status.snapshot
        assert snap["error"] is None
        assert [(n["name"], n["addr"]) for n in snap["nodes"]] == [("node1", "10.213.0.11"), ("node2", "10.213.0.12")]
        assert {p["name"] for p in snap["partitions"]} == {"cpu", "gpu"}
        ours = [j for j in snap["mine"] if j["job_id"] == job]
        assert ours and ours[0]["name"] == "status-probe" and ours[0]["nodes"] == "2"
        assert any(j["job_id"] == job for j in snap["queue"])
        assert snap["allocation"]["job_id"] == job
        text = status.view.value
        assert f"job {job}: 2 node(s) node[1-2]" in text and "status-probe" in text and "10.213.0.12" in text
        assert "<h4>My jobs</h4>" in text and "you have no jobs" not in text
        # outside an allocation the widget says so, and a fresh look shows the job gone after scancel
        nodes_cluster.run("scancel", job)
        status = ClusterStatus(env={**os.environ, **nodes_cluster.env()})
        deadline = time.monotonic() + 20
        while any(j["job_id"] == job and j["state"] != "COMPLETING" for j in status.snapshot["queue"]) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            status.refresh()
        assert "none (runs with launcher slurm submit a new job)" in status.view.value
        assert not any(j["job_id"] == job and j["state"] in ("RUNNING", "PENDING") for j in status.snapshot["queue"])
    finally:
        nodes_cluster.run("scancel", job, check=False)


@pytest.mark.slurm
@pytest.mark.netns
def test_a_notebook_inside_a_two_node_allocation_launches_steps_on_both_nodes(nodes_cluster, tmp_path):
    import nbformat
    from scalelab.record import read_records
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from scalelab import launch, preset\nfrom scalelab.record import record\n"
        f"spec = preset('tiny').with_overrides({{'world.nodes': 2, 'world.workers_per_node': 1, "
        f"'launcher': 'slurm', 'output_dir': {str(tmp_path / 'run')!r}}})\n"
        "run = launch(spec)\nsummary = run.wait(timeout=150)\n"
        "record('launcher', type(run).__name__)\n"
        "record('hosts', sorted(e['host'] for e in run.events() if e['type'] == 'start'))")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    r = subprocess.run(["salloc", "-N2", "--ntasks-per-node=1", "-t", "5", sys.executable, "-m", "papermill",
                        "-k", "python3", str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb")],
                       env={**os.environ, **nodes_cluster.env()}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_records(nbformat.read(tmp_path / "out.ipynb", as_version=4))
    assert records["launcher"] == "SrunRun" and records["hosts"] == ["node1", "node2"]
    assert not (tmp_path / "run" / "job.sh").exists()  # steps of the notebook's allocation, no new job


# -- the hub on the namespace cluster: a 2-node profile and a GPU profile -----------------------------------------

@pytest.fixture(scope="module")
def nodes_hub(tmp_path_factory, nodes_cluster):
    """A real hub in slurm mode on the 2-node cluster: it listens on the bridge (10.213.0.1) so servers on the
    nodes reach it, and reaches each server by the node's NodeAddr."""
    from scalelab.testing.hub import HubRunner, slurm_settings
    work = tmp_path_factory.mktemp("hub-nodes")
    (work / "labs" / "01_intro").mkdir(parents=True)
    (work / "labs" / "01_intro" / "lab.ipynb").write_text(
        '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    profiles = [{"name": "nodes2", "display_name": "2 nodes", "partition": "cpu", "nodes": 2, "tasks_per_node": 1,
                 "cpus_per_task": 1, "memory": "1G", "walltime": "0:30:00"},
                {"name": "gpu1", "display_name": "1 GPU", "partition": "gpu", "gpus_per_node": 1,
                 "cpus_per_task": 1, "memory": "1G", "walltime": "0:30:00"}]
    settings = slurm_settings(nodes_cluster, "", profiles, server_ip="0.0.0.0", node_address="")
    settings["hub"] = {"hub_ip": netns.host_addr()}
    runner = HubRunner(work, mode="slurm", settings=settings)
    runner.start()
    yield runner, work
    runner.cleanup()


def hub_on_nodes(test):
    """The marks of a test of the hub on the 2-node cluster."""
    for mark in (pytest.mark.slow, pytest.mark.hub, pytest.mark.netns, pytest.mark.slurm):
        test = mark(test)
    return test


@hub_on_nodes
def test_hub_two_node_profile_serves_on_node1_and_a_cell_there_trains_across_both_nodes(nodes_hub):
    hub, work = nodes_hub
    alice, job = hub.spawned("alice", "nodes2")
    assert job["nodes"] == "2" and job["state"] == "RUNNING"
    assert f"Job {job['id']} of {alice.name} serves at 10.213.0.11:" in hub.log_tail(200)  # JupyterLab on node1
    out = alice.run_cell(
        "import os\nfrom scalelab import launch, preset\n"
        "run = launch(preset('tiny').with_overrides({'world.nodes': 2, 'world.workers_per_node': 1, "
        f"'launcher': 'slurm', 'output_dir': {str(work / 'alice-run')!r}}}))\n"
        "summary = run.wait(timeout=150)\n"
        "hosts = sorted(e['host'] for e in run.events() if e['type'] == 'start')\n"
        "print('RESULT', os.environ['SLURM_JOB_ID'], type(run).__name__, ','.join(hosts), summary['status'])")
    assert f"RESULT {job['id']} SrunRun node1,node2 succeeded" in out  # steps of the server's own allocation
    alice.stop()
    alice.wait_gone(timeout=60)


@hub_on_nodes
def test_hub_gpu_profile_spawns_on_the_gpu_partition_with_cuda_visible_devices(nodes_hub):
    hub, _ = nodes_hub
    bob, job = hub.spawned("bob", "gpu1")
    assert job["partition"] == "gpu" and "gpu:1" in job["gres"]
    out = bob.run_cell("import os, torch\nprint('CVD', os.environ.get('CUDA_VISIBLE_DEVICES'), "
                       "torch.cuda.is_available())")
    assert "CVD 0 False" in out  # bound by Slurm for real; a stand-in GPU, so compute falls back to the CPU
    bob.stop()
    bob.wait_gone(timeout=60)
