"""The local cluster's Epilog and TaskProlog (scalelab/cluster/job_end.py): what a centre's cgroups do.

Attack: a course account's job daemonises a process (setsid, out of the job's process tree); under
proctrack/linuxproc it survived the job's end and scancel. Controls: a process of the same account under another
live job, and a process of an account outside the course, are left alone."""
from __future__ import annotations

import os
import pwd
import secrets
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from scalelab.cluster import job_end
from scalelab.cluster.job_end import COURSE_GROUP, leftovers

from helpers import remove_accounts, wait_until

pytestmark = pytest.mark.slurm


# -- which processes are leftovers (no cluster) -------------------------------------------------------------------
def test_leftovers_are_what_hangs_from_nothing_but_the_account_or_this_jobs_step():
    uid, other = 5001, 5002
    procs = {
        10: (1, 0, "slurmstepd: [7.batch]"),        # this job's step daemon (root)
        11: (10, uid, "bash /spool/job7/script"),   # the job's script: under this job's step
        12: (11, uid, "python train.py"),           # and its child, through the account's own process
        20: (1, uid, "sleep 600"),                  # daemonised: hangs from init
        21: (20, uid, "sleep 600"),                 # its child, through the account's own process
        30: (1, 0, "slurmstepd: [8.batch]"),        # another live job of the account
        31: (30, uid, "jupyterhub-singleuser"),     # held by that job
        40: (1, 0, "/venv/bin/jupyterhub"),         # the hub (local mode)
        41: (40, uid, "jupyterhub-singleuser"),     # held by the hub
        50: (1, other, "sshd: other"),              # another account's process
        51: (50, uid, "sleep 1"),                   # held by it
        60: (1, other, "sleep 600"),                # another account's orphan: never ours to end
        70: (999, uid, "sleep 3"),                  # parent gone meanwhile: nothing holds it
    }
    assert leftovers(uid, 7, procs) == [11, 12, 20, 21, 70]
    assert leftovers(uid, 8, procs) == [20, 21, 31, 70]
    assert leftovers(other, 7, procs) == [50, 60]


def test_the_epilog_ends_nothing_of_root_or_of_an_account_outside_the_course():
    assert job_end.epilog({"SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root", "SLURM_JOB_ID": "1"}) == 0
    assert not job_end.is_course_account("root")
    assert not job_end.is_course_account("no-such-account-" + secrets.token_hex(3))


# -- on the real cluster --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accounts(slurm_cluster):
    """A course account (group COURSE_GROUP) and an account outside the course, both throwaway, each with its
    association in the cluster's accounting (a course account's with the student QOS)."""
    tag = secrets.token_hex(3)
    student, person = f"sl-epi-s{tag}", f"sl-epi-p{tag}"
    subprocess.run(["groupadd", "-f", "-r", COURSE_GROUP], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "--groups", COURSE_GROUP, student], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", person], check=True)
    # These tests hold several jobs of the one course account at once: the student QOS's cap, whatever the last
    # hub on this cluster set it to (its profiles' largest: one CPU in some hub tests), is lifted meanwhile.
    cap = slurm_cluster.student_limits() if slurm_cluster.accounting else None
    try:
        for name in (student, person):
            slurm_cluster.register_user(name)
        if cap is not None:
            slurm_cluster.set_student_limits(0, 0)
        yield student, person
    finally:
        remove_accounts(slurm_cluster, (student, person))
        if cap is not None:
            slurm_cluster.run("sacctmgr", "-i", "modify", "qos", "where", "name=course-student", "set",
                              f"MaxTRESPerUser={cap or 'cpu=-1'}", check=False)


def _submit(cluster, user: str, script: str, folder: Path, *extra: str) -> str:
    r = subprocess.run(["runuser", "-u", user, "--", "sbatch", "--parsable", f"--chdir={folder}",
                        f"--output={folder}/%j.out", *(extra or ("--time=5",)), "--wrap", script],
                       env={**os.environ, **cluster.env()}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _state(cluster, job: str) -> str:
    out = cluster.run("scontrol", "show", "job", job, "-o", check=False).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "GONE")


def _procs_of(user: str, marker: str) -> list[int]:
    uid = pwd.getpwnam(user).pw_uid
    found = []
    for p in psutil.process_iter(["uids", "cmdline"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid and marker in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.fixture
def folder(accounts):
    d = Path(tempfile.mkdtemp(prefix="sl-epi-"))
    d.chmod(0o777)
    yield d


def test_a_daemon_a_course_job_leaves_is_ended_but_another_live_job_and_a_person_keep_theirs(
        slurm_cluster, accounts, folder):
    student, person = accounts
    # the account's other live job (its server, say), and a person's job outside the course, each daemonising too
    keep = _submit(slurm_cluster, student, "sleep 300", folder)
    wait_until(lambda: _state(slurm_cluster, keep) == "RUNNING", 60, "the student's long job to start")
    persons = _submit(slurm_cluster, person, "setsid -f sleep 3600.5; sleep 1", folder)
    job = _submit(slurm_cluster, student, "setsid -f sleep 3600.25; setsid -f sh -c 'sleep 3600.75'; sleep 1", folder)
    wait_until(lambda: _procs_of(student, "sleep 3600.25"), 60, "the student's daemon to start")
    for j in (job, persons):
        wait_until(lambda: _state(slurm_cluster, j) in ("COMPLETED", "GONE"), 60, f"job {j} to end")
    # the Epilog runs as the job completes: the daemons the job left are ended
    wait_until(lambda: not _procs_of(student, "sleep 3600.25") and not _procs_of(student, "sleep 3600.75"), 30,
          f"the daemons of job {job} to be ended; still there: {_procs_of(student, 'sleep 3600')}")
    # controls: the account's other job runs on, and a person's own daemon is not the Epilog's to end
    assert _state(slurm_cluster, keep) == "RUNNING" and _procs_of(student, "sleep 300")
    assert _procs_of(person, "sleep 3600.5"), "the Epilog ended a process of an account outside the course"
    slurm_cluster.run("scancel", keep)


def test_a_job_that_asked_for_no_gpu_sees_none(slurm_cluster, accounts, folder):
    student, _ = accounts
    job = _submit(slurm_cluster, student, 'echo "batch [${CUDA_VISIBLE_DEVICES-unset}]"; '
                                          'srun sh -c \'echo "step [${CUDA_VISIBLE_DEVICES-unset}]"\'', folder)
    wait_until(lambda: _state(slurm_cluster, job) in ("COMPLETED", "FAILED", "GONE"), 60, f"job {job} to end")
    out = (folder / f"{job}.out").read_text()
    assert "batch []" in out and "step []" in out, out


@pytest.mark.netns
def test_a_job_that_asked_for_a_gpu_sees_only_its_own(nodes_cluster, accounts, folder):
    # positive control on the 2-node cluster with stand-in GPUs: the TaskProlog leaves Slurm's binding alone
    student, _ = accounts
    r = subprocess.run(["runuser", "-u", student, "--", "srun", "-N1", "-n1", "--gres=gpu:1", "--time=2", "sh", "-c",
                        'echo "[${CUDA_VISIBLE_DEVICES-unset}]"'], cwd=folder,
                       env={**os.environ, **nodes_cluster.env()}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[0]", r.stdout


def test_a_job_past_the_partitions_time_limit_is_refused_at_submission(slurm_cluster, accounts, folder):
    from scalelab.cluster.conf import MAX_TIME
    student, _ = accounts
    for limit in ("UNLIMITED", "13:00:00"):
        r = subprocess.run(["runuser", "-u", student, "--", "sbatch", f"--chdir={folder}", "--output=/dev/null",
                            f"--time={limit}", "--wrap", "true"],
                           env={**os.environ, **slurm_cluster.env()}, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "time limit" in r.stderr.lower(), (limit, r.stdout, r.stderr)
    ok = _submit(slurm_cluster, student, "true", folder, f"--time={MAX_TIME}")  # control: at the limit it runs
    wait_until(lambda: _state(slurm_cluster, ok) in ("COMPLETED", "GONE"), 60, f"job {ok} to run")
