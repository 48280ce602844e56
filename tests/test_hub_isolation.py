"""No student code runs as root: on a root hub each student's server runs as a course account of their own, in
local mode and on Slurm, and from that account nothing of the hub or of a classmate can be read.

What a student's notebook can do is what their account can do, so each attack runs as that account (`runuser`),
the way code in their kernel would. Each refusal is paired with a positive control (the same read of the student's
own things succeeds), so a check cannot pass because the command itself was broken. Needs root.
"""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
import requests

from scalelab.hub.posture import COURSE_GROUP
from scalelab.paths import checkout_root
from scalelab.testing.hub import HubRunner, slurm_settings

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

pytestmark = [pytest.mark.hub, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _root():
    if os.geteuid() != 0:
        (pytest.fail if CI else pytest.skip)("needs root: the hub creates course accounts and switches to them")


@pytest.fixture(scope="module")
def open_dir():
    """A working folder other users may traverse (pytest's own tmp folders are root-only, which would hide the
    hub's state dir from students whatever its own permissions): the state dir's 0700 must do the protecting."""
    d = Path(tempfile.mkdtemp(prefix="hubiso-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_student(name: str, *argv: str) -> subprocess.CompletedProcess:
    """Run `argv` as the student's account, as their notebook would."""
    return subprocess.run(["runuser", "-u", name, "--", *argv], capture_output=True, text=True, timeout=60)


def server_processes(hub: HubRunner, name: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("JUPYTERHUB_USER") == name and f":{hub.hub_port}/" in env.get("JUPYTERHUB_API_URL", ""):
            found.append(p)
    return found


def start_servers(hub: HubRunner, shorts, options=None) -> dict:
    users = {}
    for short in shorts:
        user = hub.login(short)
        r = user.spawn(options=options)
        assert r.status_code in (201, 202), (r.status_code, r.text, hub.log_tail())
        user.wait_ready(timeout=120)
        users[short] = user
    return users


def assert_isolated(hub: HubRunner, users: dict) -> None:
    """Every server runs as its student's own course account; a student reads none of the hub's secrets and
    nothing of a classmate (files, server environment, token)."""
    alice, bob = users["alice"].name, users["bob"].name
    for name in (alice, bob):
        pw = pwd.getpwnam(name)
        assert pw.pw_uid >= 1000, f"{name} is not a regular account"
        assert name in grp.getgrnam(COURSE_GROUP).gr_mem
        assert os.stat(pw.pw_dir).st_mode & 0o777 == 0o700
        procs = server_processes(hub, name)
        assert procs, f"no server process of {name} found"
        assert {p.uids().real for p in procs} == {pw.pw_uid}, f"{name}'s server runs as {[p.uids() for p in procs]}"
        assert as_student(name, "id", "-u").stdout.strip() == str(pw.pw_uid)
    for short, user in users.items():  # what the student's server writes (a notebook, a file) is theirs
        r = requests.put(f"{hub.url}/user/{user.name}/api/contents/probe.txt", timeout=30,
                         headers={"Authorization": f"token {user.token}"},
                         json={"type": "file", "format": "text", "content": "written by the server"})
        assert r.status_code in (200, 201), (r.status_code, r.text[:200])
        written = Path(pwd.getpwnam(user.name).pw_dir) / "probe.txt"
        assert written.stat().st_uid == pwd.getpwnam(user.name).pw_uid != 0
    state = hub.workdir / "state"
    assert state.stat().st_mode & 0o777 == 0o700
    assert (state / "jupyterhub.sqlite").stat().st_mode & 0o077 == 0, "the hub database is readable by others"
    for secret in ("jupyterhub_cookie_secret", "jupyterhub.sqlite", "password"):
        r = as_student(alice, "cat", str(state / secret))
        assert r.returncode != 0 and "Permission denied" in r.stderr, (secret, r.returncode, r.stdout[:80])
    bob_server = server_processes(hub, bob)[0]
    bob_token = bob_server.environ()["JUPYTERHUB_API_TOKEN"]
    alice_uid = pwd.getpwnam(alice).pw_uid
    hub_family = [p for p in psutil.Process(hub.proc.pid).children(True) if p.uids().real != alice_uid]
    for target in [bob_server.pid, hub.proc.pid, *[p.pid for p in hub_family]]:
        r = as_student(alice, "cat", f"/proc/{target}/environ")
        assert r.returncode != 0 and bob_token not in r.stdout and "CONFIGPROXY_AUTH_TOKEN" not in r.stdout, target
    r = as_student(alice, "ls", pwd.getpwnam(bob).pw_dir)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # the checkout her server runs from: its reference solutions, hidden checks, the tests' solved lab and the
    # history are closed to her; the scalelab package she imports is not
    root = checkout_root()
    for private in ("labs/01_single_device/hidden_checks.py", "labs/01_single_device/lab.ipynb",
                    "tests/fixtures/legacy/05_data_pipeline/lab.ipynb", ".git/HEAD"):
        r = as_student(alice, "cat", str(root / private))
        assert r.returncode != 0 and "Permission denied" in r.stderr, (private, r.stdout[:80])
    assert as_student(alice, "cat", str(root / "scalelab" / "__init__.py")).returncode == 0
    # positive controls: the same reads of her own things work
    own = server_processes(hub, alice)[0].pid
    assert "JUPYTERHUB_API_TOKEN" in as_student(alice, "cat", f"/proc/{own}/environ").stdout
    assert as_student(alice, "ls", pwd.getpwnam(alice).pw_dir).returncode == 0
    # bob's token does not open bob's server for alice, and alice's own token does not either
    r = requests.get(f"{hub.url}/user/{bob}/api/status", headers={"Authorization": f"token {users['alice'].token}"},
                     timeout=30, allow_redirects=False)
    assert r.status_code == 403


# -- local mode (what `make hub` runs as root) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_hub(open_dir):
    runner = HubRunner(open_dir / "local", mode="local", accounts=["alice", "bob", "carol"],
                       settings={"auth": {"throttle": {"failures_per_name": 3, "lockout_s": 5}}})
    os.chmod(runner.workdir, 0o755)
    runner.start()
    yield runner
    runner.cleanup()


def test_local_servers_run_as_course_accounts_and_cannot_read_the_hub_or_each_other(local_hub):
    assert_isolated(local_hub, start_servers(local_hub, ("alice", "bob")))


def _commands_of(uid: int) -> list[list[str]]:
    return [p.info["cmdline"] or [] for p in psutil.process_iter(["uids", "cmdline"])
            if p.info["uids"] and p.info["uids"].real == uid]


def test_what_a_students_terminal_left_running_ends_with_their_last_server(local_hub):
    # From a terminal in JupyterLab a student can leave a process outside the server's tree (setsid, nohup, a
    # double fork): stopping the server signalled only the server. Now the course account's processes go with its
    # last server.
    import time
    user = start_servers(local_hub, ("carol",))["carol"]
    uid = pwd.getpwnam(user.name).pw_uid
    as_student(user.name, "sh", "-c", "setsid -f sleep 300 </dev/null >/dev/null 2>&1")
    deadline = time.monotonic() + 10
    while ["sleep", "300"] not in _commands_of(uid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ["sleep", "300"] in _commands_of(uid), "the control: the daemon runs, outside the server's tree"
    assert user.stop().status_code in (202, 204)
    deadline = time.monotonic() + 30
    while _commands_of(uid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _commands_of(uid) == [], local_hub.log_tail()


def login_status(hub: HubRunner, name: str, password: str) -> int:
    s = requests.Session()
    s.get(f"{hub.url}/hub/login", timeout=30)
    r = s.post(f"{hub.url}/hub/login", data={"username": name, "password": password,
                                             "_xsrf": s.cookies.get("_xsrf", "")}, allow_redirects=False, timeout=30)
    return r.status_code


def test_system_names_and_names_off_the_list_cannot_sign_in(local_hub):
    for name in ("root", "nobody", "daemon", "slurm", local_hub.user("eve")):
        assert login_status(local_hub, name, local_hub.password) == 403, name
    with pytest.raises(KeyError):
        pwd.getpwnam(local_hub.user("eve"))  # no account was made for a name off the list
    carol = local_hub.user("carol")
    assert login_status(local_hub, carol, local_hub.password_of(carol)) == 302  # the control


def test_a_student_cannot_sign_in_as_a_classmate(local_hub):
    # One password for the class let any student sign in as any other (their files, server and tokens): each
    # listed student now has a password of their own, and neither the shared one nor a classmate's opens theirs.
    alice, bob = local_hub.user("alice"), local_hub.user("bob")
    assert login_status(local_hub, alice, local_hub.password_of(bob)) == 403
    assert login_status(local_hub, alice, local_hub.password) == 403
    assert login_status(local_hub, alice, local_hub.password_of(alice)) == 302  # the control
    assert len({local_hub.password_of(n) for n in (alice, bob, local_hub.user("carol"))} | {local_hub.password}) == 4
    banner = local_hub.log_path.read_text(errors="replace")
    assert "student_passwords.csv" in banner and local_hub.password_of(alice) not in banner


def test_repeated_wrong_passwords_lock_the_name_then_the_lock_ends(local_hub):
    import time
    name = local_hub.user("carol")
    assert [login_status(local_hub, name, "wrong") for _ in range(3)] == [403, 403, 403]
    assert login_status(local_hub, name, local_hub.password_of(name)) == 429, "locked: even the right password is " \
                                                                               "refused"
    time.sleep(5.5)
    assert login_status(local_hub, name, local_hub.password_of(name)) == 302


def test_oversized_options_are_refused_before_they_are_stored_or_logged(local_hub):
    user = local_hub.login("carol")
    flood = "A" * 20_000
    r = user.api("POST", f"/users/{user.name}/servers/big", json={"profile": flood})
    assert r.status_code == 413 and flood not in r.text
    assert "big" not in user.model().get("servers", {})
    assert flood[:200] not in (local_hub.workdir / "hub.log").read_text(errors="replace")


def test_a_token_note_and_the_number_of_tokens_are_bounded(local_hub):
    """ATTACK: a token's note was stored as sent (any size, in the database and on every token page) and a loop
    could add tokens without end. The control: a token with a short note is made and listed."""
    from scalelab.hub.api import MAX_TOKEN_NOTE_CHARS
    user = local_hub.login("alice")
    flood = "N" * 50_000
    r = user.api("POST", f"/users/{user.name}/tokens", json={"note": flood})
    assert r.status_code == 413 and flood not in r.text
    r = user.api("POST", f"/users/{user.name}/tokens", json={"note": "N" * (MAX_TOKEN_NOTE_CHARS + 1)})
    assert r.status_code == 400, r.text
    r = user.api("POST", f"/users/{user.name}/tokens", json={"note": "for my script", "expires_in": 3600})
    assert r.status_code == 201, r.text
    notes = [t["note"] for t in user.api("GET", f"/users/{user.name}/tokens").json()["api_tokens"]]
    assert "for my script" in notes and not any(n and len(n) > MAX_TOKEN_NOTE_CHARS for n in notes)
    assert flood[:200] not in (local_hub.workdir / "hub.log").read_text(errors="replace")
    codes = {user.api("POST", f"/users/{user.name}/tokens", json={"note": f"n{i}"}).status_code for i in range(110)}
    assert codes == {201, 403}
    assert len(user.api("GET", f"/users/{user.name}/tokens").json()["api_tokens"]) <= 100


def test_a_roster_signs_students_in_with_their_own_passwords_only(open_dir):
    roster = open_dir / "class.csv"
    roster.write_text("name,password\nann,ann-own-pass-1\nbob,\n")
    roster.chmod(0o600)
    hub = HubRunner(open_dir / "roster", settings={"auth": {"roster": str(roster), "any_name": False}})
    with hub:
        assert login_status(hub, "ann", "ann-own-pass-1") == 302
        assert login_status(hub, "ann", hub.password) == 403  # the shared password is not hers
        assert login_status(hub, "bob", hub.password) == 403  # no roster password: a generated one, not the shared
        assert login_status(hub, "bob", hub.password_of("bob")) == 302
        assert hub.password_of("bob") not in (hub.password, "ann-own-pass-1")
        assert (hub.workdir / "state" / "student_passwords.csv").stat().st_mode & 0o777 == 0o600
        assert login_status(hub, "cy", hub.password) == 403  # not on the roster


# -- slurm mode ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm_hub(open_dir, slurm_cluster):
    profiles = [{"name": "cpu-1h", "display_name": "CPU, 1 h", "partition": "cpu", "cpus_per_task": 1,
                 "memory": "1G", "walltime": "1:00:00"},
                {"name": "gpu-16", "display_name": "16 GPUs", "partition": "cpu", "gpus_per_node": 16,
                 "walltime": "1:00:00"}]  # no node of the local cluster has them
    settings = slurm_settings(slurm_cluster, "", profiles)
    runner = HubRunner(open_dir / "slurm", mode="slurm", accounts=["alice", "bob", "dan"], settings=settings)
    os.chmod(runner.workdir, 0o755)
    runner.start()
    yield runner
    runner.cleanup()


@pytest.mark.slurm
def test_slurm_jobs_run_as_course_accounts_and_cannot_read_the_hub_or_each_other(slurm_hub):
    users = start_servers(slurm_hub, ("alice", "bob"), options={"profile": "cpu-1h"})
    jobs = {j["user"] for j in slurm_hub.jobs()}
    assert jobs == {users["alice"].name, users["bob"].name}, f"jobs were submitted as {jobs}"
    assert_isolated(slurm_hub, users)
    # PrivateData: bob's squeue shows his own job (the control) and not alice's, whose name, node and start time
    # would tell him where and when to aim
    env = [f"{k}={v}" for k, v in slurm_hub.slurm_env().items() if k in ("SLURM_CONF", "PATH")]
    seen = as_student(users["bob"].name, "env", *env, "squeue", "-h", "-o", "%u|%j").stdout.split()
    assert users["bob"].name in {line.split("|")[0] for line in seen}, seen
    assert not [line for line in seen if users["alice"].name in line], seen


@pytest.mark.slurm
def test_a_spawn_link_starts_no_job(slurm_hub):
    user = slurm_hub.login("bob")
    user.stop()
    user.wait_gone(timeout=60)
    before = {j["id"] for j in slurm_hub.jobs()}  # the stopped server's job may still be COMPLETING
    r = user.session.get(f"{slurm_hub.url}/hub/spawn/{user.name}?profile=cpu-1h", timeout=30)
    assert "turned off on this hub" in r.text
    assert user.server_model() is None
    assert [j for j in slurm_hub.jobs() if j["id"] not in before] == [], "a job was submitted from the link"


@pytest.mark.slurm
def test_at_a_first_start_a_gpu_profile_the_cluster_lacks_is_a_clear_refusal(slurm_hub):
    # dan signs in for the first time: his course account does not exist until his first start. The hub asked sinfo
    # as that account (sudo -u dan: "unknown user"), so every profile looked available, and the GPU profile went on
    # to sbatch and a failed spawn (a 500). Now the form disables it with why, and choosing it anyway is a 400 that
    # says why, before an account or a job is made.
    user = slurm_hub.login("dan")
    with pytest.raises(KeyError):
        pwd.getpwnam(user.name)  # the account is not made yet
    page = user.session.get(f"{slurm_hub.url}/hub/spawn", timeout=30)
    assert page.status_code == 200
    assert 'value="gpu-16" disabled' in page.text and "no node of partition &#x27;cpu&#x27; has 16 GPUs" in page.text
    before = {j["id"] for j in slurm_hub.jobs()}
    xsrf = user.session.cookies.get("_xsrf", path="/hub/")
    r = user.session.post(f"{slurm_hub.url}/hub/spawn/{user.name}", timeout=60, allow_redirects=False,
                          data={"profile": "gpu-16", "_xsrf": xsrf})
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert "no node of partition &#x27;cpu&#x27; has 16 GPUs" in r.text or "no node of partition 'cpu' has 16" in r.text
    r = user.spawn(options={"profile": "gpu-16"})  # the REST API too
    assert r.status_code == 400 and "has 16 GPUs" in r.text, (r.status_code, r.text[:500])
    assert [j for j in slurm_hub.jobs() if j["id"] not in before] == [], "a job was submitted"
    # the control: the CPU profile starts his first server, as his new course account
    start_servers(slurm_hub, ("dan",), options={"profile": "cpu-1h"})
    assert {j["user"] for j in slurm_hub.jobs() if j["id"] not in before} == {user.name}
    user.stop()
    user.wait_gone(timeout=60)
