"""The hub's security posture and the parts of it that need no running hub: run_as resolution, unsafe combinations
refused with the setting that fixes them, sign-in throttling, spawn links, and job logs read without following a
student's links."""
from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from tornado import web

from scalelab.hub.authenticator import CourseSharedPasswordAuthenticator
from scalelab.hub.posture import (INSTRUCTOR_ONLY, format_posture, problems, resolve_run_as,
                                  seal_instructor_files, system_account, warnings)
from scalelab.hub.settings import SettingsError, load_settings, read_roster


@pytest.fixture
def cfg(tmp_path):
    return load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state")}})


def settings(cfg, **servers):
    out = copy.deepcopy(cfg)
    out["servers"].update(servers)
    return out


def test_auto_gives_course_accounts_to_a_root_hub_and_the_hub_account_otherwise(cfg):
    root = resolve_run_as(settings(cfg, run_as="auto"), euid=0)
    assert root["servers"]["run_as"] == "student-accounts" and root["servers"]["create_accounts"] is True
    user = resolve_run_as(settings(cfg, run_as="auto", create_accounts=False), euid=1000)
    assert user["servers"]["run_as"] == "hub-account" and user["servers"]["create_accounts"] is False


def test_hub_account_on_a_root_hub_is_refused_with_the_fix(cfg):
    unsafe = problems(settings(cfg, run_as="hub-account"), euid=0)
    assert len(unsafe) == 1 and "runs every student's code as root" in unsafe[0]
    assert "student-accounts" in unsafe[0] and "create_accounts" in unsafe[0]
    allowed = settings(cfg, run_as="hub-account", allow_root_servers=True)
    assert problems(allowed, euid=0) == [] and any("root" in w for w in warnings(allowed))


def test_shared_password_never_reaches_real_unix_accounts(cfg):
    pam_less = settings(cfg, run_as="student-accounts", create_accounts=False)
    assert any("sign in as any existing Unix account" in p for p in problems(pam_less, euid=0))
    pam = copy.deepcopy(pam_less)
    pam["auth"]["type"] = "pam"
    assert problems(pam, euid=0) == []


def test_course_accounts_need_a_list_of_students_and_no_system_names(cfg):
    made = settings(cfg, run_as="student-accounts", create_accounts=True)
    made["auth"]["allowed_users"] = []
    assert any("auth.allowed_users: empty" in p for p in problems(made, euid=0))
    made["auth"]["allowed_users"] = ["alice", "root", "nobody"]
    [bad] = problems(made, euid=0)
    assert "['nobody', 'root'] are system account names" in bad
    made["auth"]["allowed_users"] = ["alice", "bob"]
    assert problems(made, euid=0) == []


def test_system_names_are_recognised():
    assert system_account("root") and system_account("nobody") and system_account("daemon")
    assert not system_account("alice-not-a-user-here")


def test_the_posture_table_says_who_runs_servers_and_who_signs_in(cfg):
    made = settings(cfg, run_as="student-accounts", create_accounts=True)
    made["auth"]["allowed_users"] = ["alice", "bob"]
    text = format_posture(made, euid=0)
    assert "each student's own Unix account (course accounts the hub creates" in text
    assert "shared password, 2 names on the list" in text and "form POST only" in text
    assert "UNSAFE" not in text
    mode = cfg["mode"]
    own = "per student with their servers (slurm.per_student): held by the local cluster's QOS course-student"
    assert (own in text) if mode == "slurm" else ("no Slurm: servers are processes on this machine" in text), text
    other = copy.deepcopy(made)
    other["mode"] = "local" if mode == "slurm" else "slurm"
    other["slurm"]["per_student"] = {"cpus": 3, "gpus": 1}
    flipped = format_posture(other, euid=0)
    assert ("3 CPUs, 1 GPUs per student" in flipped) if other["mode"] == "slurm" else ("no Slurm" in flipped), flipped
    unsafe = format_posture(settings(cfg, run_as="hub-account"), euid=0)
    assert "the hub's account (root)" in unsafe and "UNSAFE: servers.run_as: hub-account" in unsafe


# -- sign-in throttling -------------------------------------------------------------------------------------------

def _auth(**kw):
    return CourseSharedPasswordAuthenticator(user_password="right-password-123", allow_all=True, **kw)


def _handler(ip="10.9.8.7", headers=None, forged=None):
    """A handler whose request came over a connection from `ip` (Tornado's remote_ip is what a header made it)."""
    from tornado.httputil import HTTPHeaders
    conn = SimpleNamespace(context=SimpleNamespace(address=(ip, 40000)))
    return SimpleNamespace(request=SimpleNamespace(remote_ip=forged or ip, connection=conn,
                                                   headers=HTTPHeaders(headers or {})))


def test_repeated_failures_lock_the_name_even_for_the_right_password():
    auth = _auth(max_failures=3, lockout_s=30)
    for _ in range(3):
        assert asyncio.run(auth.authenticate(_handler(), {"username": "alice", "password": "guess"})) is None
    with pytest.raises(web.HTTPError) as e:
        asyncio.run(auth.authenticate(_handler("10.0.0.2"), {"username": "alice", "password": "right-password-123"}))
    assert e.value.status_code == 429 and "wait" in e.value.log_message
    # another name from another address is not affected
    ok = asyncio.run(auth.authenticate(_handler("10.0.0.3"), {"username": "bob", "password": "right-password-123"}))
    assert ok["name"] == "bob"


def test_one_address_guessing_many_names_is_locked_too():
    auth = _auth(max_failures=3, max_address_failures=3, lockout_s=30)
    for name in ("a1", "a2", "a3"):
        asyncio.run(auth.authenticate(_handler("10.1.1.1"), {"username": name, "password": "x"}))
    with pytest.raises(web.HTTPError, match="for this address"):
        asyncio.run(auth.authenticate(_handler("10.1.1.1"), {"username": "carol", "password": "right-password-123"}))


def test_a_classroom_behind_one_address_survives_a_few_typos():
    auth = _auth(max_failures=3, max_address_failures=50, lockout_s=30)
    for i in range(10):  # ten students, one typo each
        asyncio.run(auth.authenticate(_handler("10.2.2.2"), {"username": f"s{i}", "password": "typo"}))
    assert asyncio.run(auth.authenticate(_handler("10.2.2.2"), {"username": "s0", "password": "right-password-123"}))


def test_a_success_clears_the_count_and_locks_expire():
    auth = _auth(max_failures=3, lockout_s=0.0)
    for _ in range(2):
        asyncio.run(auth.authenticate(_handler(), {"username": "dave", "password": "x"}))
    assert asyncio.run(auth.authenticate(_handler(), {"username": "dave", "password": "right-password-123"}))
    assert not auth._failures.get(("name", "dave"))


def test_a_name_off_the_list_with_the_right_password_is_told_so_and_a_wrong_password_is_not():
    auth = CourseSharedPasswordAuthenticator(user_password="right-password-123", allowed_users={"alice"})
    with pytest.raises(web.HTTPError) as e:
        asyncio.run(auth.authenticate(_handler(), {"username": "alicee", "password": "right-password-123"}))
    assert e.value.status_code == 403 and "'alicee' is not on this course's class list" in e.value.log_message
    # a stranger without the password learns nothing about the list: the usual refusal
    assert asyncio.run(auth.authenticate(_handler(), {"username": "alicee", "password": "guess"})) is None
    assert asyncio.run(auth.authenticate(_handler(), {"username": "alice", "password": "right-password-123"}))


def test_a_forged_forwarding_header_neither_locks_out_another_address_nor_dodges_the_limit():
    """ATTACK: Tornado's remote_ip is any client's X-Real-IP / X-Forwarded-For; the throttle keyed on it. Now it
    keys on the connection's address, whatever the headers say."""
    auth = _auth(max_failures=100, max_address_failures=3, lockout_s=30)
    victim, forged = "10.5.5.5", {"X-Real-IP": "10.5.5.5", "X-Forwarded-For": "10.5.5.5"}
    for i in range(3):
        h = _handler("10.6.6.6", headers=forged, forged="10.5.5.5")
        assert asyncio.run(auth.authenticate(h, {"username": f"x{i}", "password": "guess"})) is None
        assert h.request.remote_ip == "10.6.6.6"  # what the request's log lines now name
    # the classroom's address was not locked by someone else's failures
    assert asyncio.run(auth.authenticate(_handler(victim), {"username": "amy", "password": "right-password-123"}))
    # the attacker, with a new made-up address on this try, is still held to the limit of the one they come from
    with pytest.raises(web.HTTPError, match="for this address"):
        asyncio.run(auth.authenticate(_handler("10.6.6.6", {"X-Forwarded-For": "10.7.7.7"}, forged="10.7.7.7"),
                                      {"username": "y", "password": "right-password-123"}))


def test_forwarding_headers_are_believed_from_a_configured_proxy_only():
    """CONTROL: behind a configured front end (10.0.0.5) each client keeps its own address: the rightmost
    X-Forwarded-For entry the proxy appended, never what the client wrote to the left of it or in X-Real-IP."""
    from scalelab.hub.addresses import client_address
    front = _handler("10.0.0.5", {"X-Forwarded-For": "6.6.6.6, 192.0.2.10", "X-Real-IP": "6.6.6.6"}).request
    assert client_address(front, ["own-proxy", "10.0.0.0/24"]) == "192.0.2.10"
    assert client_address(front, ["own-proxy"]) == "10.0.0.5"  # not configured: its headers are not believed
    chain = _handler("10.0.0.5", {"X-Forwarded-For": "192.0.2.10, 10.0.0.7"}).request  # two trusted hops
    assert client_address(chain, ["10.0.0.0/24"]) == "192.0.2.10"
    bad = _handler("10.0.0.5", {"X-Forwarded-For": "not-an-address"}).request
    assert client_address(bad, ["10.0.0.0/24"]) == "10.0.0.5"
    auth = _auth(max_failures=100, max_address_failures=2, lockout_s=30, trusted_proxies=["10.0.0.5"])
    for i in range(2):
        asyncio.run(auth.authenticate(_handler("10.0.0.5", {"X-Forwarded-For": "192.0.2.66"}),
                                      {"username": f"z{i}", "password": "guess"}))
    ok = _handler("10.0.0.5", {"X-Forwarded-For": "192.0.2.10"})
    assert asyncio.run(auth.authenticate(ok, {"username": "amy", "password": "right-password-123"}))
    with pytest.raises(web.HTTPError, match="for this address"):
        asyncio.run(auth.authenticate(_handler("10.0.0.5", {"X-Forwarded-For": "192.0.2.66"}),
                                      {"username": "amy", "password": "right-password-123"}))


def test_the_hubs_own_proxy_is_a_socket_of_the_hubs_account_not_any_loopback_peer():
    """ATTACK: on the hub's machine every course account connects from the loopback too (a student's server in
    local mode): only a socket of the hub's own account counts as its proxy. The control: the hub's account's."""
    import socket
    import subprocess
    import sys
    from scalelab.hub.addresses import peer_is_trusted, socket_owner
    server = socket.create_server(("127.0.0.1", 0))
    ours = server.getsockname()
    mine = socket.create_connection(ours)
    conn, peer = server.accept()
    assert socket_owner(peer, ours) == os.geteuid() and peer_is_trusted(peer, ours, ["own-proxy"])
    assert not peer_is_trusted(peer, ours, [])  # an empty list believes nobody
    if os.geteuid() == 0:
        code = (f"import socket,sys,time; s=socket.create_connection(('127.0.0.1',{ours[1]})); "
                "print(s.getsockname()[1], flush=True); sys.stdin.read()")
        child = subprocess.Popen([sys.executable, "-c", code], user=65534, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            port = int(child.stdout.readline())
            theirs, their_peer = server.accept()
            assert their_peer[1] == port and socket_owner(their_peer, ours) == 65534
            assert not peer_is_trusted(their_peer, ours, ["own-proxy"])
            theirs.close()
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    for s in (mine, conn, server):
        s.close()


def test_trusted_proxies_that_are_not_addresses_are_refused(cfg):
    from scalelab.hub.settings import cross_checks
    assert cross_checks(cfg) == [] and cfg["hub"]["trusted_proxies"] == ["own-proxy"]
    cfg["hub"]["trusted_proxies"] = ["own-proxy", "10.0.0.0/8", "the-front-end"]
    assert cross_checks(cfg) == ["hub.trusted_proxies: 'the-front-end' is neither 'own-proxy' nor an address or "
                                 "network"]
    assert "X-Forwarded-For believed only from the hub's own proxy" in format_posture(
        load_settings(overrides={"hub": {"state_dir": cfg["hub"]["state_dir"]}}), euid=0)


def test_a_user_the_hub_knows_but_the_class_list_does_not_cannot_sign_in():
    """ATTACK: JupyterHub adds every user of its database to allowed_users (add_user, at start and when an admin
    adds one); the course's class list, taken from the settings, is still the gate. Control: the listed student."""
    auth = CourseSharedPasswordAuthenticator(user_password="right-password-123", allowed_users={"alice"},
                                             allow_existing_users=True)  # JupyterHub's default with a list
    auth.add_user(SimpleNamespace(name="mallory"))  # in the database: an admin added her, or she was dropped
    assert "mallory" in auth.allowed_users
    with pytest.raises(web.HTTPError) as e:
        asyncio.run(auth.authenticate(_handler(), {"username": "mallory", "password": "right-password-123"}))
    assert e.value.status_code == 403 and "not on this course's class list" in e.value.log_message
    assert asyncio.run(auth.authenticate(_handler(), {"username": "alice", "password": "right-password-123"}))


# -- spawn links and job logs ----------------------------------------------------------------------------------

def test_a_spawn_link_is_refused_unless_the_course_allows_it():
    from scalelab.hub.local_spawner import CourseLocalSpawner
    sp = CourseLocalSpawner(user=SimpleNamespace(name="alice"))
    with pytest.raises(web.HTTPError, match="turned off"):
        sp.options_from_query({"profile": ["gpu-node"]})
    sp.spawn_from_link = True
    assert sp.options_from_query({"x": ["1"]}) == {"x": ["1"]}  # upstream's handling, unchanged


def _slurm_spawner(home: Path):
    from scalelab.hub.slurm_spawner import CourseSlurmSpawner
    sp = CourseSlurmSpawner(user=SimpleNamespace(name="alice"), home_template=str(home))
    sp.job_id = "42"
    return sp


def test_a_job_log_symlink_planted_by_a_student_is_not_followed(tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("TOP-SECRET-hub-cookie")
    home = tmp_path / "home"
    sp = _slurm_spawner(home)
    sp.log_dir().mkdir(parents=True)
    os.symlink(secret, sp.job_log())
    assert "TOP-SECRET" not in sp._log_tail(sp.job_log())
    os.unlink(sp.job_log())
    # a link on a folder of the path, a hard link and a FIFO are refused as well
    os.link(secret, sp.job_log())
    assert "TOP-SECRET" not in sp._log_tail(sp.job_log())
    os.unlink(sp.job_log())
    os.mkfifo(sp.job_log())
    assert "not a regular file" in sp._log_tail(sp.job_log())
    os.unlink(sp.job_log())
    jobs = sp.log_dir()
    os.rmdir(jobs)
    os.symlink(tmp_path, jobs)
    (tmp_path / sp.job_log().name).write_text("TOP-SECRET via a linked folder")
    assert "TOP-SECRET" not in sp._log_tail(sp.job_log())


def test_a_job_log_is_read_from_its_end_and_bounded(tmp_path):
    sp = _slurm_spawner(tmp_path / "home")
    sp.log_dir().mkdir(parents=True)
    sp.job_log().write_text("x" * 1_000_000 + "\nlast line of the job\n")
    tail = sp._log_tail(sp.job_log())
    assert tail.endswith("last line of the job") and len(tail) <= 3000


# -- the class list: allowed names, a roster with per-student passwords ------------------------------------------

def test_an_empty_class_list_is_refused_unless_any_name_is_chosen(cfg):
    open_ = settings(cfg, run_as="hub-account", create_accounts=False)
    open_["auth"]["allowed_users"] = []
    assert any("anyone with the shared password could sign in under any name" in p for p in problems(open_, euid=1000))
    open_["auth"]["any_name"] = True
    open_["servers"]["shared_account"] = True
    assert problems(open_, euid=1000) == [] and any("any_name" in w for w in warnings(open_))


def test_a_roster_gives_per_student_passwords_and_adds_its_names(tmp_path):
    roster = tmp_path / "class.csv"
    roster.write_text("name,password\nann,ann-own-pass-1\n\nbob,\n")
    roster.chmod(0o600)
    course = tmp_path / "c.yaml"
    course.write_text(f"hub:\n  state_dir: {tmp_path / 'st'}\nauth:\n  roster: class.csv\n  allowed_users: [cy]\n")
    cfg = load_settings(course)
    assert cfg["auth"]["roster"] == str(roster)  # relative to the settings file
    assert cfg["auth"]["allowed_users"] == ["cy", "ann", "bob"]
    assert read_roster(roster) == {"ann": "ann-own-pass-1", "bob": None}
    assert "per-student passwords from the roster, 3 names" in format_posture(cfg, euid=1000)
    roster.chmod(0o644)
    assert any("chmod 600" in w for w in warnings(cfg))


@pytest.mark.parametrize("text, words", [
    ("Ann,pw-long-enough\n", "line 1: 'Ann' is not a login name"),
    ("ann,short\n", "line 1: the password of 'ann' is shorter than 8"),
    ("ann,\nbob,\nann,\n", "line 3: 'ann' is listed twice"),
])
def test_a_bad_roster_line_is_named(tmp_path, text, words):
    roster = tmp_path / "r.csv"
    roster.write_text(text)
    with pytest.raises(SettingsError, match=words):
        read_roster(roster)


def test_a_student_with_an_own_password_cannot_use_the_shared_one():
    auth = _auth(roster_passwords={"ann": "ann-own-pass-1"})
    sign_in = lambda name, pw: asyncio.run(auth.authenticate(_handler(), {"username": name, "password": pw}))  # noqa: E731
    assert sign_in("ann", "ann-own-pass-1")["name"] == "ann"
    assert sign_in("ann", "right-password-123") is None  # the shared password is not hers
    assert sign_in("bob", "ann-own-pass-1") is None  # nor is her password anyone else's
    assert sign_in("bob", "right-password-123")["name"] == "bob"  # no own password: the shared one


def test_the_checkouts_instructor_files_are_closed_to_other_accounts(tmp_path, monkeypatch):
    # students' servers traverse the checkout (its venv, the scalelab package): solutions, hidden checks, the
    # tests' solved lab, history, executed references, collected work and grades must not be open to them
    import grp
    course_gid = 54321  # stands for the course group: a folder of that group loses its group bits too
    monkeypatch.setattr(grp, "getgrnam", lambda name: SimpleNamespace(gr_gid=course_gid))
    for rel, mode in (("labs", 0o755), ("tests/fixtures/legacy", 0o775), (".git", 0o750), ("build/executed", 0o755),
                      ("build/student/labs", 0o755), ("scalelab", 0o755), ("tests/fixtures/grading", 0o755)):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).chmod(mode)
    os.chown(tmp_path / "build" / "executed", -1, course_gid)
    sealed = seal_instructor_files(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in sealed) == ["build/executed", "labs",
                                                                           "tests/fixtures/legacy"]
    modes = {rel: (tmp_path / rel).stat().st_mode & 0o777 for rel in INSTRUCTOR_ONLY if (tmp_path / rel).exists()}
    assert modes == {"labs": 0o750, "tests/fixtures/legacy": 0o770, ".git": 0o750, "build/executed": 0o700}
    for rel in ("build/student/labs", "scalelab", "build", "tests", "tests/fixtures/grading"):  # what others use
        assert (tmp_path / rel).stat().st_mode & 0o777 == 0o755, rel
    assert seal_instructor_files(tmp_path) == []  # nothing left to close
    cfg = load_settings()
    for run_as, words in (("student-accounts", "closed to students"), ("hub-account", "readable by the servers")):
        cfg["servers"]["run_as"] = run_as
        assert words in format_posture(cfg, euid=0 if run_as == "student-accounts" else 1000)


def test_one_account_for_a_whole_class_is_refused_unless_shared_on_purpose(cfg):
    # a hub run by an ordinary (service) account gives every student's server that one account: each could read
    # the others' work and tokens and the hub's secrets, which 0700 directories do not stop (same uid)
    shared = settings(cfg, run_as="hub-account")
    assert len(shared["auth"]["allowed_users"]) > 1  # the course's class list
    [why] = problems(shared, euid=1000)
    assert "the others' work and tokens" in why and "student-accounts" in why and "shared_account" in why
    assert "shared by every student" in format_posture(shared, euid=0)
    one = settings(cfg, run_as="hub-account")
    one["auth"]["allowed_users"], one["hub"]["admin_users"] = ["ada"], []
    assert problems(one, euid=1000) == []  # a one-person try-out separates nobody from nobody
    one["hub"]["admin_users"] = ["instructor"]
    assert problems(one, euid=1000) != []  # the admin is a second person
    pam = settings(cfg, run_as="hub-account")
    pam["auth"]["type"], pam["auth"]["allowed_users"] = "pam", ["ada"]
    assert problems(pam, euid=1000) != []  # every Unix account may sign in
    ok = settings(cfg, run_as="hub-account", shared_account=True)
    assert problems(ok, euid=1000) == [] and any("shared_account" in w for w in warnings(ok))
