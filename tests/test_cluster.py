"""The local single-node Slurm: slurm.conf as text (pure), then the real daemons (marked slurm)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalelab.cluster import local as cluster_mod
from scalelab.cli import main as cli_main
from scalelab.cluster.local import LocalCluster, default_state_dir, slurm_conf_text
from scalelab.cluster.conf import (detect_machine, gres_conf_text, memory_headroom_mb, node_usable, parse_scontrol,
                                   summarise)
from scalelab.errors import ClusterError

ROOT = Path(__file__).resolve().parent.parent


def conf(**kw) -> str:
    args = dict(cluster_name="scalelab", node_name="vm", cpus=2, real_memory_mb=24105, gpus=0,
                state_dir="/srv/slurmstate")
    return slurm_conf_text(**{**args, **kw})


def setting(text: str, key: str) -> str:
    m = re.search(rf"^{key}=(.*)$", text, re.M)
    assert m, f"{key} missing from slurm.conf"
    return m.group(1)


# -- slurm.conf as text -------------------------------------------------------------------------------------------

def test_cpu_machine_gets_one_default_cpu_partition_and_no_gres():
    text = conf(gpus=0)
    partitions = re.findall(r"^PartitionName=(\S+)(.*)$", text, re.M)
    assert [p[0] for p in partitions] == ["cpu", "grading"]
    assert "Default=YES" in partitions[0][1] and "Nodes=vm" in partitions[0][1]
    # grade --slurm's partition: never the default, root's only (a student's sbatch there is refused)
    assert "Default=NO" in partitions[1][1] and partitions[1][1].endswith(" AllowGroups=root")
    assert "GresTypes" not in text and "Gres=" not in text
    assert gres_conf_text(node_name="vm", gpus=0) == ""


def test_gpu_machine_gets_gpu_partition_gres_type_and_gres_conf():
    text = conf(gpus=4)
    assert setting(text, "GresTypes") == "gpu"
    assert re.search(r"^NodeName=vm .*Gres=gpu:4", text, re.M)
    gpu = re.search(r"^PartitionName=gpu (.*)$", text, re.M)
    assert gpu and "Default=NO" in gpu.group(1)
    assert re.search(r"^PartitionName=cpu .*Default=YES", text, re.M)
    files = [f"/dev/nvidia{i}" for i in range(4)]
    assert "NodeName=vm Name=gpu File=/dev/nvidia0,/dev/nvidia1,/dev/nvidia2,/dev/nvidia3\n" in gres_conf_text(
        node_name="vm", gpus=4, files=files)
    assert "NodeName=vm Name=gpu Count=2\n" in gres_conf_text(node_name="vm", gpus=2)  # device files not visible


@pytest.mark.parametrize("total, kept", [(24105, 24105 - 2410), (2048, 2048 - 512), (1024000, 1024000 - 8192)])
def test_node_memory_leaves_headroom_for_the_os(total, kept):
    assert memory_headroom_mb(total) == total - kept
    assert f"RealMemory={kept} " in conf(real_memory_mb=total)


def test_two_core_node_fits_ten_one_cpu_jobs_beside_a_two_task_job_without_overreporting_cpus():
    text = conf(cpus=2)
    node = re.search(r"^NodeName=.*$", text, re.M).group(0)
    assert "CPUs=2 " in node  # the hardware as it is
    assert setting(text, "SelectTypeParameters") == "CR_Core_Memory"
    ways = int(re.search(r"^PartitionName=cpu .*OverSubscribe=FORCE:(\d+)", text, re.M).group(1))
    assert 2 * ways >= 10 + 2
    memory = int(re.search(r"RealMemory=(\d+)", node).group(1))
    assert int(setting(text, "DefMemPerCPU")) * 2 * ways <= memory  # every slot's default memory fits


def test_every_path_in_the_conf_is_inside_the_state_dir():
    text = conf(state_dir="/srv/slurmstate")
    paths = re.findall(r"(?:=|socket=)(/[^\s,]+)", text)
    assert len(paths) >= 8  # socket, ctld state, spool, 2 pid files, 2 logs, jobcomp
    assert all(p.startswith("/srv/slurmstate/") for p in paths), paths
    assert setting(text, "AuthInfo") == "socket=/srv/slurmstate/munge/munge.socket"


def test_finished_jobs_stay_visible_and_scheduling_is_fast():
    text = conf()
    assert int(setting(text, "MinJobAge")) >= 300
    assert setting(text, "JobCompType") == "jobcomp/filetxt"
    assert "sched_interval=2" in setting(text, "SchedulerParameters")
    assert setting(text, "ProctrackType") == "proctrack/linuxproc" and setting(text, "TaskPlugin") == "task/none"


def test_unresolvable_host_is_reached_by_address():
    text = conf(node_addr="127.0.0.1")
    assert setting(text, "SlurmctldHost") == "vm(127.0.0.1)"
    assert re.search(r"^NodeName=vm NodeAddr=127.0.0.1 ", text, re.M)
    assert "NodeAddr" not in conf()


@pytest.mark.parametrize("state, usable", [("IDLE", True), ("MIXED", True), ("ALLOCATED+RESERVED", True),
                                           ("IDLE+DRAIN", False), ("DOWN*", False), ("IDLE*", False),
                                           ("DOWN", False), ("IDLE+NOT_RESPONDING", False)])
def test_node_state_reading(state, usable):
    assert node_usable(state) is usable


def test_scontrol_records_keep_values_with_spaces_and_summarise_gpus():
    nodes = parse_scontrol("NodeName=vm Arch=x86_64 CPUTot=2 CPUAlloc=1 RealMemory=900 State=MIXED CfgTRES=cpu=2,"
                           "mem=900M,gres/gpu=2 Reason=Not responding [root@12:00] Comment=x\n", "NodeName")
    assert nodes[0]["Reason"] == "Not responding [root@12:00]"
    parts = parse_scontrol("PartitionName=cpu Default=YES Nodes=vm TotalCPUs=2 TRES=cpu=2,gres/gpu=2\n"
                           "garbage\n", "PartitionName")
    s = summarise(nodes, parts)
    assert s["up"] is True
    assert s["partitions"] == [{"name": "cpu", "nodes": "vm", "cpus": 2, "gpus": 2, "default": True}]
    assert s["nodes"][0]["gpus"] == 2 and s["nodes"][0]["cpus_alloc"] == 1


def test_default_state_dir_follows_env_and_is_outside_the_repo(monkeypatch, tmp_path):
    monkeypatch.setenv("SCALELAB_CLUSTER_DIR", str(tmp_path / "c"))
    assert default_state_dir() == tmp_path / "c"
    assert LocalCluster().conf_path == tmp_path / "c" / "slurm.conf"
    monkeypatch.delenv("SCALELAB_CLUSTER_DIR")
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 0)
    assert default_state_dir() == Path("/var/lib/scalelab/cluster")  # students must be able to read it
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 1000)
    assert default_state_dir() == Path.home() / ".cache" / "scalelab" / "cluster"
    assert ROOT not in default_state_dir().parents


def test_not_root_is_told_to_use_sudo_or_an_existing_cluster(monkeypatch, tmp_path):
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(cluster_mod.shutil, "which", lambda *a, **k: "/usr/bin/x")
    with pytest.raises(ClusterError, match=r"need root.*SLURM_CONF"):
        LocalCluster(tmp_path).up()


def test_missing_slurm_names_the_apt_command(monkeypatch, tmp_path):
    monkeypatch.setattr(cluster_mod.shutil, "which", lambda *a, **k: None)
    with pytest.raises(ClusterError, match="apt-get install slurm-wlm munge"):
        LocalCluster(tmp_path).up()


def test_status_of_a_cluster_never_started_is_down_with_exit_3(tmp_path, capsys):
    st = LocalCluster(tmp_path).status()
    assert st == {"up": False, "conf": str(tmp_path / "slurm.conf"), "nodes": [], "partitions": [], "jobs": 0}
    assert cli_main(["cluster", "--state-dir", str(tmp_path), "status"]) == 3
    assert "down" in capsys.readouterr().out


def test_machine_detection_matches_this_machine():
    m = detect_machine()
    assert m.cpus == os.cpu_count() and m.sockets * m.cores_per_socket * m.threads_per_core == m.cpus
    assert m.memory_mb > 256 and m.hostname


# -- the real cluster -------------------------------------------------------------------------------------------

def submit(cluster: LocalCluster, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", "-J", "scalelab-test-cluster", *args).stdout.strip().split(";")[0]


def job(cluster: LocalCluster, jobid: str) -> dict:
    return parse_scontrol(cluster.run("scontrol", "show", "job", "-o", jobid).stdout, "JobId")[0]


def wait_for(cluster: LocalCluster, jobid: str, states: set[str], timeout: float = 20) -> dict:
    end = time.monotonic() + timeout
    while True:
        record = job(cluster, jobid)
        if record["JobState"] in states or time.monotonic() > end:
            return record
        time.sleep(0.2)


@pytest.mark.slurm
def test_up_again_is_quick_and_keeps_the_same_daemons(slurm_cluster):
    before = slurm_cluster._running()
    t0 = time.monotonic()
    slurm_cluster.up()
    assert time.monotonic() - t0 < 2
    assert slurm_cluster._running() == before and all(before.values())


@pytest.mark.slurm
def test_a_cluster_left_running_with_another_slurm_conf_is_restarted_with_this_one(slurm_cluster):
    # A cluster started by an older scalelab kept its slurm.conf (PrivateData missing, say) for as long as it ran.
    before = slurm_cluster._running()
    conf = slurm_cluster.conf_path
    conf.write_text(conf.read_text().replace("PrivateData=jobs,usage,users\n", ""))
    slurm_cluster.up()
    assert "PrivateData=jobs,usage,users" in conf.read_text()
    after = slurm_cluster._running()
    assert all(after.values()) and after["slurmctld"] != before["slurmctld"], (before, after)
    t0 = time.monotonic()
    slurm_cluster.up()  # now current: kept
    assert slurm_cluster._running() == after and time.monotonic() - t0 < 2


@pytest.mark.slurm
def test_two_task_batch_job_runs_srun_on_both_tasks(slurm_cluster, tmp_path):
    jobid = submit(slurm_cluster, "-n", "2", "-D", str(tmp_path), "-o", "out.txt",
                   "--wrap", "srun bash -c 'echo task=$SLURM_PROCID host=$(hostname -s)'")
    record = wait_for(slurm_cluster, jobid, {"COMPLETED", "FAILED", "CANCELLED"})
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert sorted((tmp_path / "out.txt").read_text().split("\n")[:2]) == [f"task=0 host={host}",
                                                                           f"task=1 host={host}"]


@pytest.mark.slurm
def test_the_job_completion_log_is_roots_alone_and_closed_again_on_up(slurm_cluster, tmp_path):
    """ATTACK: every account read the job completion log (each classmate's jobs, nodes, times and exit codes: what
    PrivateData hides from squeue). Now it is 0600 root's; one left open by an older release is closed by `cluster
    up`. The control: finished jobs are still written to it (root reads them)."""
    import stat
    log = slurm_cluster.paths.jobcomp_log
    jobid = submit(slurm_cluster, "-o", "/dev/null", "--wrap", "true")
    wait_for(slurm_cluster, jobid, {"COMPLETED", "FAILED", "CANCELLED"})
    deadline = time.monotonic() + 30
    while f"JobId={jobid} " not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert f"JobId={jobid} " in log.read_text()  # the control: accounting still written
    assert (stat.S_IMODE(log.stat().st_mode), log.stat().st_uid) == (0o600, 0)
    read = subprocess.run(["cat", str(log)], user=65534, capture_output=True, text=True)
    assert read.returncode != 0 and f"JobId={jobid}" not in read.stdout  # a classmate (uid 65534) reads nothing
    log.chmod(0o644)  # as an older release left it, the cluster still running
    slurm_cluster.up()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


@pytest.mark.slurm
def test_squeue_shows_a_job_and_scancel_removes_it(slurm_cluster):
    jobid = submit(slurm_cluster, "-o", "/dev/null", "--wrap", "sleep 120")
    try:
        shown = slurm_cluster.run("squeue", "-h", "-j", jobid, "-o", "%i %T").stdout.split()
        assert shown[0] == jobid and shown[1] in ("PENDING", "RUNNING", "CONFIGURING")
    finally:
        slurm_cluster.run("scancel", jobid)
    assert wait_for(slurm_cluster, jobid, {"CANCELLED"})["JobState"] == "CANCELLED"
    assert slurm_cluster.run("squeue", "-h", "-j", jobid, "-t", "PD,R").stdout.strip() == ""


@pytest.mark.slurm
def test_ten_one_cpu_jobs_run_at_once_on_the_node(slurm_cluster):
    jobs = [submit(slurm_cluster, "-n", "1", "-o", "/dev/null", "--wrap", "sleep 60") for _ in range(10)]
    try:
        states = [wait_for(slurm_cluster, j, {"RUNNING"}, timeout=15)["JobState"] for j in jobs]
        assert states == ["RUNNING"] * 10
    finally:
        slurm_cluster.run("scancel", *jobs)


@pytest.mark.slurm
def test_reservation_is_created_once_for_several_users_and_takes_jobs(slurm_cluster):
    name = f"scalelab-test-{os.getpid()}"
    slurm_cluster.ensure_user("scalelab-student")
    slurm_cluster.ensure_user("scalelab-student")
    try:
        slurm_cluster.ensure_reservation(name, users="scalelab-student", duration="00:05:00")
        slurm_cluster.ensure_reservation(name, users=["scalelab-student"], duration="00:05:00")
        shown = parse_scontrol(slurm_cluster.run("scontrol", "show", "reservation", "-o").stdout, "ReservationName")
        mine = [r for r in shown if r["ReservationName"] == name]
        assert len(mine) == 1 and set(mine[0]["Users"].split(",")) == {"root", "scalelab-student"}
        jobid = submit(slurm_cluster, f"--reservation={name}", "-o", "/dev/null", "--wrap", "true")
        record = wait_for(slurm_cluster, jobid, {"COMPLETED", "FAILED"})
        assert (record["JobState"], record["Reservation"]) == ("COMPLETED", name)
    finally:
        slurm_cluster.drop_reservation(name)
    assert slurm_cluster._reservation(name) is None


@pytest.mark.slurm
def test_status_reports_the_cpu_partition_of_this_machine(slurm_cluster):
    st = slurm_cluster.status()
    assert st["up"] is True and st["conf"] == str(slurm_cluster.conf_path)
    cpu = [p for p in st["partitions"] if p["name"] == "cpu"]
    assert cpu and cpu[0]["default"] is True and cpu[0]["cpus"] == detect_machine().cpus
    assert isinstance(st["jobs"], int) and st["nodes"][0]["name"] == detect_machine().hostname


@pytest.mark.slurm
def test_clients_need_only_the_env_and_the_cli_reports_json(slurm_cluster):
    bare = {"PATH": "/usr/bin:/bin", **slurm_cluster.env()}
    assert subprocess.run(["squeue", "-h"], env=bare, capture_output=True, timeout=30).returncode == 0
    env = {**os.environ, "SCALELAB_CLUSTER_DIR": str(slurm_cluster.state_dir)}
    r = subprocess.run([sys.executable, "-m", "scalelab.cli", "cluster", "status", "--json"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["up"] is True and st["conf"] == str(slurm_cluster.conf_path)


@pytest.mark.slurm
def test_a_node_a_test_left_drained_is_named_on_that_test_and_resumed(slurm_cluster, tmp_path):
    """The suite's watch (tests/cluster_watch.py, run after every test of the clusters group): a drained node and a
    base partition left DOWN are reported with Slurm's reason, then resumed, and a job runs again."""
    import cluster_watch
    node = detect_machine().hostname
    slurm_cluster.run("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=watch-test-drain")
    slurm_cluster.run("scontrol", "update", "PartitionName=grading", "State=DOWN")
    try:
        found = cluster_watch.after_test("the-test", log=tmp_path / "watch.txt")
    finally:  # whatever the watch did, the tests after this one get a working cluster
        slurm_cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        slurm_cluster.run("scontrol", "update", "PartitionName=grading", "State=UP")
    assert found and "after the-test" in found and "watch-test-drain" in found and "partition grading: DOWN" in found
    assert "; resumed" in found and (tmp_path / "watch.txt").read_text().count("after the-test") == 1
    assert cluster_watch.after_test("the-next-test", log=tmp_path / "watch.txt") is None
    jobid = submit(slurm_cluster, "-o", "/dev/null", "--wrap", "true")
    assert wait_for(slurm_cluster, jobid, {"COMPLETED", "FAILED"})["JobState"] == "COMPLETED"


@pytest.mark.slurm
def test_a_reservation_a_module_left_in_use_is_named_and_deleted_with_its_jobs(slurm_cluster, tmp_path):
    """The suite's module watch (a hub fixture once left its one-core class reservation in use: every later 2-CPU
    job pended until it ended): Slurm refuses to delete a reservation a job runs in; drop_reservation cancels the job
    and deletes it, and the watch names it."""
    import cluster_watch
    name = f"watch-test-{os.getpid()}"
    before = cluster_watch.reservations(slurm_cluster)
    slurm_cluster.run("scontrol", "create", "reservation", f"ReservationName={name}", "Users=root", "StartTime=now",
                      "Duration=10", f"Nodes={detect_machine().hostname}", "CoreCnt=1", "Flags=IGNORE_JOBS")
    jobid = submit(slurm_cluster, f"--reservation={name}", "-o", "/dev/null", "--wrap", "sleep 300")
    try:
        wait_for(slurm_cluster, jobid, {"RUNNING"}, timeout=30)
        busy = slurm_cluster.run("scontrol", "delete", f"ReservationName={name}", check=False)
        found = cluster_watch.after_module("the-module", before, log=tmp_path / "watch.txt")
    finally:
        slurm_cluster.run("scancel", jobid, check=False)
        slurm_cluster.drop_reservation(name, wait_s=30, cancel_jobs=True)
    assert busy.returncode != 0, busy  # in use: Slurm refuses to delete it
    assert found == f"after the-module: reservations it made were left on the local Slurm: {name} (deleted)"
    assert slurm_cluster._reservation(name) is None
    assert wait_for(slurm_cluster, jobid, {"CANCELLED"})["JobState"] == "CANCELLED"


@pytest.mark.slurm
def test_a_killed_runs_reservations_and_partitions_are_removed_at_the_next_start(slurm_cluster, tmp_path):
    """What a run killed mid-module leaves on the shared Slurm (slurmctld keeps it across restarts) is removed when
    the next run's cluster fixture starts (tests/cluster_watch.clear_leftovers); another reservation is kept."""
    import cluster_watch
    node, tag = detect_machine().hostname, os.getpid()
    for name in (f"hubtest-left-{tag}", f"kept-{tag}"):
        slurm_cluster.run("scontrol", "create", "reservation", f"ReservationName={name}", "Users=root",
                          "StartTime=now", "Duration=10", f"Nodes={node}", "CoreCnt=1", "Flags=IGNORE_JOBS,OVERLAP")
    slurm_cluster.run("scontrol", "create", f"PartitionName=hubdown-left-{tag}", f"Nodes={node}", "State=DOWN")
    try:
        removed = cluster_watch.clear_leftovers(slurm_cluster, log=tmp_path / "watch.txt")
    finally:
        slurm_cluster.drop_reservation(f"kept-{tag}")
    assert removed == [f"reservation hubtest-left-{tag}", f"partition hubdown-left-{tag}"]
    assert slurm_cluster._reservation(f"hubtest-left-{tag}") is None
    assert "before the run" in (tmp_path / "watch.txt").read_text()
