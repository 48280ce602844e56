"""The local cluster's per-student QOS (scalelab/cluster/accounting.py): what a centre's slurmdbd holds.

Attack: a course account submits jobs itself from a terminal in its JupyterLab (sbatch, the way the hub's Slurm
commands reach the account: `sudo -E -u <account>`), past the hub's spawn form and its per-student check. Before
the change the local cluster had no accounting (AccountingStorageType=accounting_storage/none): the student's
second job over the cap ran beside the first. Now its QOS's MaxTRESPerUser (the hub's `slurm.per_student`, set the
way `scalelab hub` sets it) keeps it PENDING with Slurm's reason. Controls: a classmate's job runs at the same
time (the cap is per student), and a person's account outside the course is not limited."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from scalelab.cluster import accounting
from scalelab.cluster.accounting import COURSE_ACCOUNT, STUDENT_QOS, missing_commands, qos_limit_command
from scalelab.cluster.conf import slurm_conf_text
from scalelab.cluster.job_end import COURSE_GROUP
from scalelab.hub.options import Profile, student_limits

from helpers import remove_accounts, wait_until

CAP = 2  # CPUs one student may hold at once in this test: each job asks for all of them


# -- the text of it (no cluster) --------------------------------------------------------------------------------------
def test_slurm_conf_enforces_associations_and_qos_limits_only_with_accounting(tmp_path):
    shape = dict(cluster_name="c", node_name="n", cpus=2, real_memory_mb=4000, gpus=1, state_dir=tmp_path)
    on = slurm_conf_text(**shape, dbd_port=6819)
    assert "AccountingStorageType=accounting_storage/slurmdbd" in on and "AccountingStoragePort=6819" in on
    assert "AccountingStorageEnforce=associations,limits,qos" in on and "AccountingStorageTRES=gres/gpu" in on
    assert f"AccountingStoragePass={tmp_path}/munge/munge.socket" in on  # our munged, not the system's
    off = slurm_conf_text(**shape)
    assert "AccountingStorageType=accounting_storage/none" in off and "AccountingStorageEnforce" not in off


def test_slurmdbd_conf_and_mariadb_are_private():
    text = accounting.slurmdbd_conf_text(state_dir="/s", dbd_port=6819, munge_socket="/s/munge/munge.socket",
                                         log_file="/s/db/slurmdbd.log", pid_file="/s/db/slurmdbd.pid")
    assert "PrivateData=accounts,events,jobs,reservations,usage,users" in text  # sacct shows a student their own
    # no listen address in slurmdbd.conf: it binds its host name's address, "localhost" in its own UTS namespace
    assert "CommunicationParameters=NoInAddrAny" in text.splitlines()
    assert accounting.slurmdbd_command()[:2] == ["unshare", "--uts"] and \
        accounting.slurmdbd_command()[-1] == "hostname localhost && exec slurmdbd"
    args = accounting.mariadb_args(datadir=Path("/s/db/data"), socket=Path("/s/db/mysqld.sock"),
                                   pid_file=Path("/s/db/p"), log_file=Path("/s/db/l"))
    assert "--skip-networking" in args and "--no-defaults" in args  # a socket in a 0700 folder, no TCP


def test_the_qos_cap_is_the_hubs_per_student_number():
    shape = dict(partition="cpu", walltime="1:00:00")
    profiles = [Profile("small", "Small", cpus_per_task=1, **shape),
                Profile("big", "Big", cpus_per_task=4, gpus_per_node=1, **shape)]
    assert student_limits(profiles) == (4, 1)          # 0 = what the largest profile needs
    assert student_limits(profiles, 2, 0) == (2, 1)    # the setting wins where given
    assert qos_limit_command(2, 1)[-1] == "MaxTRESPerUser=cpu=2,gres/gpu=1"
    assert qos_limit_command(0, None)[-1] == "MaxTRESPerUser=cpu=-1"  # no cap; no GPU TRES on a node without GPUs


def test_only_what_is_missing_is_added_course_accounts_with_the_student_qos_alone():
    fresh = missing_commands("", "normal\n", cluster_name="c", people=["root"], students=["s1"])
    assert [c[2:4] for c in fresh] == [["add", "cluster"], ["add", "account"], ["add", "qos"], ["add", "user"],
                                       ["add", "user"]]
    assert f"qos={STUDENT_QOS}" in fresh[4] and f"defaultqos={STUDENT_QOS}" in fresh[4]
    assert not any(a.startswith("qos=") for a in fresh[3])  # a person: the default QOS, no cap
    assoc = f"c|root||normal\nc|{COURSE_ACCOUNT}||normal\nc|{COURSE_ACCOUNT}|root|normal\nc|{COURSE_ACCOUNT}|s1|normal\n"
    again = missing_commands(assoc, f"normal\n{STUDENT_QOS}\n", cluster_name="c", people=["root"], students=["s1"])
    assert again == [accounting.student_qos_command(["s1"], "c")]  # made as a person's before: moved to the QOS
    assoc = assoc.replace("|s1|normal", f"|s1|{STUDENT_QOS}")
    assert missing_commands(assoc, f"normal\n{STUDENT_QOS}\n", cluster_name="c", people=["root"],
                            students=["s1"]) == []  # a restart with nothing new: no command


def test_a_centres_slurm_gets_no_association_from_scalelab(tmp_path):
    centre = tmp_path / "slurm.conf"
    centre.write_text("ClusterName=big\nAccountingStorageType=accounting_storage/slurmdbd\n")
    assert accounting.accounting_conf(centre) is None  # not written by scalelab: its administrators' to do
    assert accounting.register_user("root", centre) is False
    local = tmp_path / "local.conf"
    local.write_text(slurm_conf_text(cluster_name="scalelab", node_name="n", cpus=2, real_memory_mb=4000, gpus=0,
                                     state_dir=tmp_path, dbd_port=6819))
    assert accounting.accounting_conf(local) == {"cluster": "scalelab"}
    local.write_text(slurm_conf_text(cluster_name="scalelab", node_name="n", cpus=2, real_memory_mb=4000, gpus=0,
                                     state_dir=tmp_path))
    assert accounting.accounting_conf(local) is None  # a local cluster without accounting: nothing to register


# -- on the real cluster --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accounts(slurm_cluster):
    """Two course accounts (group COURSE_GROUP) and a person's account, throwaway, each with its association made
    the way the hub makes a course account's (`accounting.register_user`)."""
    tag = secrets.token_hex(3)
    s1, s2, person = f"sl-qos-a{tag}", f"sl-qos-b{tag}", f"sl-qos-p{tag}"
    subprocess.run(["groupadd", "-f", "-r", COURSE_GROUP], check=True)
    for name in (s1, s2):
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "--groups", COURSE_GROUP, name],
                       check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", person], check=True)
    try:
        for name in (s1, s2, person):
            accounting.register_user(name, slurm_cluster.conf_path)
        yield s1, s2, person
    finally:
        remove_accounts(slurm_cluster, (s1, s2, person))


def _listening_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at `port` (IPv4 and IPv6), whoever owns them."""
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
            and c.laddr.port == port}


def _outside_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (where another machine would reach a daemon)."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


@pytest.mark.slurm
def test_slurmdbd_listens_on_loopback_only(slurm_cluster):
    """Attack: a machine on the network reaches slurmdbd's port (6819) on the course machine's own address and
    talks to the daemon that holds every job's accounting and the associations. Before the change slurmdbd bound
    0.0.0.0 (slurmdbd.conf has no listen address: it binds any unless CommunicationParameters=NoInAddrAny)."""
    port = slurm_cluster.dbd_port
    assert slurm_cluster.pids()["slurmdbd"], "the 1-node cluster runs slurmdbd (accounting)"
    assert _listening_addresses(port) == {"127.0.0.1"}, \
        f"slurmdbd listens on {sorted(_listening_addresses(port))} at port {port}: it must be 127.0.0.1 only"
    for address in _outside_addresses():  # the control: this machine's own address does not answer
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, port)) != 0, f"slurmdbd answers on {address}:{port}"
    with socket.socket() as s:  # and the cluster's own clients still reach it on loopback
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def student_cap(slurm_cluster):
    """The hub's per-student cap set to CAP CPUs the way `scalelab hub` sets it (cli.hub.apply_student_qos from
    the hub settings' slurm.per_student); the cap before is put back afterwards."""
    from scalelab.cli.hub import apply_student_qos
    from scalelab.hub.settings import load_settings
    r = slurm_cluster.run("sacctmgr", "-n", "-P", "show", "qos", STUDENT_QOS, "format=MaxTRESPerUser", check=False)
    before = r.stdout.strip()
    cfg = load_settings(None, {"mode": "slurm", "slurm": {"conf": str(slurm_cluster.conf_path),
                                                          "per_student": {"cpus": CAP, "gpus": 0}}})
    applied = apply_student_qos(cfg)
    yield applied
    if applied:
        slurm_cluster.run("sacctmgr", "-i", "modify", "qos", "where", f"name={STUDENT_QOS}", "set",
                          f"MaxTRESPerUser={before or 'cpu=-1'}", check=False)


def _submit(cluster, user: str, folder: Path) -> str:
    """sbatch as `user` through sudo, as the hub's Slurm commands and a student's terminal do."""
    r = subprocess.run(["sudo", "-E", "-u", user, "sbatch", "--parsable", f"--chdir={folder}", "--output=/dev/null",
                        f"--cpus-per-task={CAP}", "--mem=50", "--time=5", "-J", "qos-test", "--wrap", "sleep 300"],
                       env={**os.environ, **cluster.env()}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"sbatch as {user} refused: {r.stderr.strip()}"
    return r.stdout.strip().split(";")[0]


def _queue(cluster, job: str) -> tuple[str, str]:
    out = cluster.run("squeue", "-h", "-j", job, "-o", "%T|%r", check=False).stdout.strip()
    state, _, reason = out.partition("|")
    return state or "GONE", reason


@pytest.mark.slurm
def test_a_students_second_job_over_the_cap_waits_on_the_qos_a_classmate_and_a_person_run(
        slurm_cluster, accounts, student_cap):
    s1, s2, person = accounts
    if slurm_cluster.status()["nodes"][0]["cpus"] < CAP:
        pytest.skip(f"the node has fewer than {CAP} CPUs: a job of the whole cap could never start")
    folder = Path(tempfile.mkdtemp(prefix="sl-qos-"))
    folder.chmod(0o777)
    first = _submit(slurm_cluster, s1, folder)
    wait_until(lambda: _queue(slurm_cluster, first)[0] == "RUNNING", 30, f"{s1}'s first job runs")
    second = _submit(slurm_cluster, s1, folder)  # the attack: one more job of the full cap, from a terminal
    classmate = _submit(slurm_cluster, s2, folder)
    own = [_submit(slurm_cluster, person, folder) for _ in range(2)]
    # the controls first: the cap is per student, and a person's jobs are not held to it
    for job, who in [(classmate, s2), *((j, person) for j in own)]:
        wait_until(lambda: _queue(slurm_cluster, job)[0] == "RUNNING", 30, f"{who}'s job {job} runs")
    state, reason = wait_until(lambda: (lambda q: q if q[1].startswith("QOS") or q[0] != "PENDING" else None)(
        _queue(slurm_cluster, second)), 20, f"{s1}'s second job gets a reason")
    assert (state, reason) == ("PENDING", "QOSMaxCpuPerUserLimit"), \
        f"{s1}'s second job of {CAP} CPUs is {state} ({reason}) while the first holds the per-student cap " \
        f"(QOS {STUDENT_QOS}, set to {student_cap}): no per-student limit in Slurm"
    assert _queue(slurm_cluster, first)[0] == "RUNNING"
    # it was the cap alone: when the first job ends, the second starts
    slurm_cluster.run("scancel", first)
    wait_until(lambda: _queue(slurm_cluster, second)[0] == "RUNNING", 30, f"{s1}'s second job runs once the first ended")
