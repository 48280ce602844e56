"""GPU use per student on the class dashboard (issue 36, item 4): the GPUs a student's server job holds, their
utilisation and memory from Slurm (sstat's gres/gpuutil and gres/gpumem), an idle flag, and on stand-in GPUs 0 with
"stand-in GPU, not measured", never a made-up number.

Plain functions on Slurm's own text first (scontrol, sstat, gres.conf), the idle flag with a scripted sstat (the
local clusters run no GPU accounting), then a real hub in Slurm mode on the shared 2-node namespace cluster, whose
GPUs are stand-ins. Attack tests: a student reading the dashboard's API gets 403 and nobody's GPU data; a TA sees the
course's students' GPU rows only.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from scalelab.hub.gpu_usage import (NOT_RECORDED, STAND_IN, IdleTracker, describe, expand_hostlist, gpu_rows,
                                    held_gpus, parse_sstat, stand_in_nodes, start_sampler)
from scalelab.hub.settings import load_settings
from scalelab.testing.hub import HubRunner, slurm_settings

# as `scontrol show job -o -d` prints them (Slurm 22.05), shortened: a GPU server, a CPU server, ...
SCONTROL = (
    "JobId=101 JobName=jupyter-ann UserId=ann(1001) JobState=RUNNING Partition=gpu NodeList=node1 "
    "NumNodes=1 NumCPUs=1 TRES=cpu=1,mem=512M,node=1,billing=1,gres/gpu=1 TresPerNode=gres:gpu:1\n"
    "JobId=102 JobName=jupyter-ben UserId=ben(1002) JobState=RUNNING Partition=cpu NodeList=node2 "
    "NumNodes=1 NumCPUs=1 TRES=cpu=1,mem=512M,node=1,billing=1\n"
    "JobId=103 JobName=train UserId=cy(1003) JobState=RUNNING NodeList=gpu[07-08] "
    "TRES=cpu=16,mem=64G,node=2,billing=16,gres/gpu:a100=8,gres/gpu=8\n"
    # no accounting of GPUs (the local clusters): TRES has none, -d's allocated GRES says it
    "JobId=104 JobName=jupyter-dee UserId=root(0) JobState=RUNNING NodeList=node1 TRES=cpu=1,mem=100M,node=1,"
    "billing=1 JOB_GRES=gpu:2   Nodes=node1 CPU_IDs=0 Mem=100 GRES=gpu:2(IDX:0-1) TresPerNode=gres:gpu:2\n")
# as `sstat -n -P -a -o JobID,TRESUsageInAve` prints them where the gpu/nvml plugin runs
SSTAT = ("101.extern|cpu=00:00:00,energy=0,fs/disk=5273,gres/gpumem=0,gres/gpuutil=0,mem=262144,pages=0,vmem=0\n"
         "101.batch|cpu=00:56:24,energy=0,fs/disk=350130624578,gres/gpumem=40777023488,gres/gpuutil=87,"
         "mem=10621726720,pages=3465,vmem=10439041024\n"
         "101.0|cpu=00:01:00,gres/gpumem=2048M,gres/gpuutil=3\n"
         "102.batch|cpu=00:10:00,energy=0,mem=1000,pages=0,vmem=0\n")


def test_what_slurm_says_a_job_holds_and_measured():
    held = held_gpus(SCONTROL)
    assert held == {"101": {"gpus": 1, "nodes": "node1"}, "103": {"gpus": 8, "nodes": "gpu[07-08]"},
                    "104": {"gpus": 2, "nodes": "node1"}}
    assert expand_hostlist("gpu[07-08],node1") == ["gpu07", "gpu08", "node1"]
    got = parse_sstat(SSTAT)
    assert got["101"] == {"util": 90.0, "mem_bytes": 40777023488 + 2048 * 2**20}  # the job's steps summed
    assert "102" not in got  # no gres/gpuutil recorded: left out, not 0


def test_stand_in_gpus_are_those_without_a_device():
    conf = ("# Written by scalelab\nNodeName=node[1-2] Name=gpu File=/tmp/scalelab-test-nodes/dev/nvidia0\n"
            "NodeName=vm Name=gpu Count=2\nNodeName=real1 Name=gpu File=/dev/nvidia[0-3]\n"
            "AutoDetect=nvml NodeName=auto1 Name=gpu\n")
    assert stand_in_nodes(conf) == {"node1", "node2", "vm"}


def _fake_slurm(tmp_path: Path, sstat: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, text in (("scontrol", SCONTROL), ("sstat", sstat)):
        (bin_dir / tool).write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}EOF\n")
        (bin_dir / tool).chmod(0o755)
    return str(bin_dir)


def test_a_gpu_measured_at_zero_for_longer_than_the_setting_is_flagged_idle(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("")
    (tmp_path / "gres.conf").write_text("NodeName=node1 Name=gpu File=/dev/nvidia0\n")  # a real device
    cfg = load_settings(overrides={"mode": "slurm", "hub": {"state_dir": str(tmp_path / "state")},
                                   "dashboard": {"gpu_idle_after_s": 600},
                                   "slurm": {"conf": str(conf), "bin_dir": _fake_slurm(tmp_path, SSTAT)}})
    jobs = {"ann": {"job": "101", "state": "running"}, "ben": {"job": "102", "state": "running"}}
    busy = gpu_rows(cfg, jobs, now=0, tracker=(tracker := IdleTracker()))
    assert set(busy) == {"ann"}  # ben's server holds no GPU
    assert (busy["ann"]["util"], busy["ann"]["measured"], busy["ann"]["idle"]) == (90.0, True, False)
    idle_text = SSTAT.replace("gres/gpuutil=87", "gres/gpuutil=0").replace("gres/gpuutil=3", "gres/gpuutil=0")
    cfg["slurm"]["bin_dir"] = _fake_slurm(tmp_path, idle_text)
    assert gpu_rows(cfg, jobs, now=100, tracker=tracker)["ann"]["idle"] is False  # at 0 since 100
    later = gpu_rows(cfg, jobs, now=701, tracker=tracker)["ann"]
    assert later["idle"] is True and later["idle_s"] == 601.0 and "IDLE for 10 min" in describe(later)
    cfg["slurm"]["bin_dir"] = _fake_slurm(tmp_path, SSTAT)  # busy again: the flag goes
    assert gpu_rows(cfg, jobs, now=800, tracker=tracker)["ann"]["idle"] is False
    # the service's background reading: the tracker learns of the idle GPU with nobody loading the page
    cfg["slurm"]["bin_dir"] = _fake_slurm(tmp_path, idle_text)
    background = IdleTracker()
    stop = start_sampler(dict(cfg), lambda: jobs, every=0.05, tracker=background)
    try:
        deadline = time.monotonic() + 20
        while "101" not in background.zero_since and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
    assert "101" in background.zero_since
    # a real GPU Slurm does not measure (no gres/gpuutil): no number at all, and why
    cfg["slurm"]["bin_dir"] = _fake_slurm(tmp_path, "")
    row = gpu_rows(cfg, jobs, now=900, tracker=tracker)["ann"]
    assert (row["util"], row["mem_bytes"], row["note"]) == (None, None, NOT_RECORDED)
    assert "%" not in describe(row) and "GiB" not in describe(row)


# -- on a real hub, on the 2-node cluster's stand-in GPUs ----------------------------------------------------------

PROFILES = [{"name": "cpu", "display_name": "CPU", "partition": "cpu", "cpus_per_task": 1, "memory": "512M",
             "walltime": "0:30:00"},
            {"name": "gpu1", "display_name": "1 GPU", "partition": "gpu", "gpus_per_node": 1, "cpus_per_task": 1,
             "memory": "512M", "walltime": "0:30:00"}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, nodes_cluster):
    from scalelab.cluster.netns import host_addr
    settings = slurm_settings(nodes_cluster, "", PROFILES)
    settings["slurm"].update(server_ip="0.0.0.0", node_address="")  # each server on its node's address
    settings["hub"] = {"hub_ip": host_addr()}  # the nodes reach the hub's API over the bridge
    runner = HubRunner(tmp_path_factory.mktemp("hub-gpu"), mode="slurm", settings=settings, admins=["prof"])
    u = runner.user
    runner.settings["auth"]["allowed_users"] = [u("ann"), u("ben"), u("tom")]
    runner.settings["dashboard"]["tas"] = [u("tom")]
    import yaml
    runner.config_path.write_text(yaml.safe_dump(runner.settings, sort_keys=False), encoding="utf-8")
    runner.start()
    yield runner
    runner.cleanup()


def _rows(data: dict) -> dict:
    return {s["name"]: s for s in data["students"]}


@pytest.mark.netns
@pytest.mark.hub
@pytest.mark.slow
def test_stand_in_gpus_show_zero_said_so_and_only_staff_see_them(hub):
    u = hub.user
    ann, ben = hub.login("ann"), hub.login("ben")
    assert ann.spawn(options={"profile": "gpu1"}).status_code in (201, 202)
    assert ben.spawn(options={"profile": "cpu"}).status_code in (201, 202)
    ann.wait_ready(timeout=180)
    ben.wait_ready(timeout=180)
    dash = f"{hub.url}/services/dashboard/"
    prof = hub.login("prof")
    rows = _rows(requests.get(dash + "api/class", headers={"Authorization": f"token {prof.token}"},
                              timeout=60).json())
    gpu = rows[u("ann")]["gpu"]
    assert gpu and (gpu["gpus"], gpu["util"], gpu["mem_bytes"], gpu["note"]) == (1, 0.0, 0, STAND_IN), gpu
    assert gpu["measured"] is False and gpu["idle"] is False  # 0 on a stand-in is not a measurement
    assert gpu["nodes"] in ("node1", "node2") and rows[u("ann")]["node"]
    assert rows[u("ben")]["gpu"] is None  # a CPU server holds no GPU
    page = prof.session.get(dash, timeout=60).text
    assert "1 GPU: 0 %, 0.0 GiB (stand-in GPU, not measured)" in page
    # the TA: the course's students' GPU rows, nobody else's
    tom = hub.login("tom")
    ta = _rows(requests.get(dash + "api/class", headers={"Authorization": f"token {tom.token}"}, timeout=60).json())
    assert set(ta) == {u("ann"), u("ben")} and ta[u("ann")]["gpu"]["note"] == STAND_IN
    # a student: 403, and no GPU data of anyone (her own included) in the answer, by token and by cookie
    for r in (requests.get(dash + "api/class", headers={"Authorization": f"token {ann.token}"}, timeout=60,
                           allow_redirects=False),
              ben.session.get(dash + "api/class", timeout=60), ben.session.get(dash, timeout=60)):
        assert r.status_code == 403, (r.status_code, r.url)
        assert STAND_IN not in r.text and "gres" not in r.text and u("ann") not in r.text
