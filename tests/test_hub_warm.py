"""Warm the class (issue 36, item 2): `scalelab course warm` and the dashboard's button start every listed student's
server with the course's default profile, in the class reservation, as the student's own account.

Plain functions first (what a request may carry, who is warmed, the service token's scopes, --at), then a real hub
in Slurm mode on the shared local cluster, with course accounts and a class reservation for the course's Slurm
account. Attack tests: a student and a TA calling warm through the dashboard (by token and by cookie) and through the
hub's API; an instructor's request smuggling a profile or user options, or naming staff or strangers: refused
before anything starts.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest
import requests
from traitlets.config import Config

from scalelab.hub.config import update_dashboard, warm_scopes
from scalelab.hub.settings import load_settings
from scalelab.hub.warm import WarmError, check_request, parse_at, plan, wait_until
from scalelab.testing.hub import HubRunner, slurm_settings

TA_REFUSAL = "Forbidden: teaching assistants may look, not act"


@pytest.fixture
def cfg(tmp_path):
    return load_settings(overrides={
        "hub": {"state_dir": str(tmp_path / "state"), "admin_users": ["prof"]},
        "servers": {"run_as": "hub-account", "home": str(tmp_path / "homes/{username}")},
        "auth": {"allowed_users": ["ann", "ben", "ina", "tom"]},
        "dashboard": {"instructors": ["ina"], "tas": ["tom"]}})


@pytest.mark.parametrize("body, words", [
    ({"users": ["ann"], "profile": "gpu1-2h"}, "takes only 'users'"),
    ({"users": ["ann"], "user_options": {"profile": "gpu1-2h"}}, "takes only 'users'"),
    ({"users": "ann"}, "must be a list of names"),
    ([{"users": ["ann"]}], "is a JSON object"),
    ({"dry_run": "yes"}, "'dry_run' must be true or false"),
])
def test_a_warm_request_carries_names_only(body, words):
    with pytest.raises(WarmError, match=words):
        check_request(body)
    assert check_request({"users": ["ann", "ann", "ben"]}) == (["ann", "ben"], False)
    assert check_request(None) == (None, False)


def test_warm_starts_course_students_only_and_leaves_running_servers_alone():
    students = [{"name": "ann", "servers": {}}, {"name": "ben", "servers": {"": {"ready": True}}},
                {"name": "cy", "servers": {"": {"ready": False, "pending": "spawn"}}}]
    start, left = plan(students, None)
    assert start == ["ann"]
    assert {(r.name, r.outcome) for r in left} == {("ben", "already running"), ("cy", "already starting")}
    with pytest.raises(WarmError, match="not students of this course.*'ina'"):
        plan(students, ["ann", "ina"])  # an instructor (not in `students`: course_students leaves staff out)


def test_the_dashboard_token_may_start_students_servers_only(cfg):
    assert warm_scopes(cfg) == ["start:servers!user=ann", "start:servers!user=ben"]
    c = Config()
    update_dashboard(c, cfg)
    scopes = next(r for r in c.JupyterHub.load_roles if r["name"] == "dashboard")["scopes"]
    assert "start:servers!user=ann" in scopes
    assert not [s for s in scopes if s.split("!")[0] in ("servers", "delete:servers", "admin:users", "admin:servers")]
    assert not [s for s in scopes if s.endswith(("=ina", "=tom", "=prof"))]  # no staff member's server
    cfg["auth"]["allowed_users"], cfg["auth"]["any_name"] = [], True  # a try-out hub with no class list
    assert warm_scopes(cfg) == ["start:servers"]


def test_at_waits_in_the_command_until_the_time():
    now = datetime(2026, 12, 1, 8, 30).astimezone()
    assert parse_at("08:50", now) == now.replace(minute=50)
    assert parse_at("2026-12-01T09:00", now).hour == 9
    with pytest.raises(WarmError, match="already past"):
        parse_at("08:00", now)
    with pytest.raises(WarmError, match="is not a time"):
        parse_at("soon", now)
    clock = [now]
    slept = []

    def sleep(s):
        slept.append(s)
        clock[0] += timedelta(seconds=s)
    wait_until(now + timedelta(minutes=20), sleep=sleep, clock=lambda: clock[0], say=lambda m: None)
    assert clock[0] == now + timedelta(minutes=20) and max(slept) <= 60


def test_wait_reports_each_started_server_as_ready_or_failed():
    # a scripted dashboard (api/class answers in turn): ann becomes ready, ben's server stops before it is ready
    import http.server
    import json
    import threading
    from scalelab.hub.warm import follow
    answers = iter([{"ann": "spawn", "ben": "spawn"}, {"ann": "ready", "ben": "stopped"}])
    seen = []

    class Dash(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization")))
            body = json.dumps({"students": [{"name": n, "server": st} for n, st in next(answers).items()]})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Dash)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answer = {"results": [{"name": "ann", "outcome": "starting"}, {"name": "ben", "outcome": "starting"},
                              {"name": "cy", "outcome": "already running"}], "failed": 0}
        got = follow(f"http://127.0.0.1:{server.server_port}/services/dashboard/", "tok", answer, timeout=30,
                     sleep=lambda s: None)
    finally:
        server.shutdown()
    assert [(r["name"], r["outcome"]) for r in got["results"]] == [("ann", "ready"), ("ben", "failed"),
                                                                     ("cy", "already running")]
    assert got["failed"] == 1 and "stopped before it was ready" in got["results"][1]["detail"]
    assert seen == [("/services/dashboard/api/class", "token tok")] * 2


# -- on a real hub, in Slurm mode, with course accounts -------------------------------------------------------------

PROFILES = [{"name": "warm-cpu", "display_name": "CPU (default)", "partition": "cpu", "cpus_per_task": 1,
             "memory": "512M", "walltime": "0:30:00"},
            {"name": "other", "display_name": "CPU, short", "partition": "cpu", "cpus_per_task": 1,
             "memory": "512M", "walltime": "0:20:00"}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, slurm_cluster):
    if os.geteuid() != 0:
        pytest.skip("needs root: the hub creates course accounts")
    import secrets
    import shutil
    import tempfile
    work = tempfile.mkdtemp(prefix="hubwarm-")
    os.chmod(work, 0o755)  # students' jobs read nothing here, but their accounts must traverse to their homes
    node = slurm_cluster.status()["nodes"][0]["name"]
    resv = f"hubtest-class-{secrets.token_hex(3)}"  # hubtest-: a later run removes it if this one is killed
    # the class reservation, for the course's Slurm account (every course account), one core of the node
    slurm_cluster.run("scontrol", "create", "reservation", f"ReservationName={resv}", "Accounts=scalelab",
                      "StartTime=now", "Duration=60", f"Nodes={node}", "CoreCnt=1", "Flags=IGNORE_JOBS")
    runner = HubRunner(work, mode="slurm", accounts=["ann", "ben", "cy", "eve"], admins=["prof"],
                       settings=slurm_settings(slurm_cluster, resv, PROFILES))
    u = runner.user
    runner.settings["auth"]["allowed_users"] += [u("ina"), u("tom")]
    runner.settings["dashboard"].update(instructors=[u("ina")], tas=[u("tom")])
    import yaml
    runner.config_path.write_text(yaml.safe_dump(runner.settings, sort_keys=False), encoding="utf-8")
    # eve's name is taken on this machine by an account that is not a course account: her start must fail, alone
    subprocess.run(["useradd", "--no-create-home", u("eve")], check=True, capture_output=True)
    runner.resv = resv
    try:
        runner.start()
        yield runner
    finally:
        runner.cleanup()
        subprocess.run(["userdel", u("eve")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        slurm_cluster.drop_reservation(resv, wait_s=30, cancel_jobs=True)  # left, it holds a core for an hour


@pytest.fixture(scope="module")
def people(hub):
    return {short: hub.login(short) for short in ("ina", "tom", "ann", "ben")}


def _warm_url(hub) -> str:
    return f"{hub.url}/services/dashboard/api/warm"


def _post(hub, token: str, body) -> requests.Response:
    return requests.post(_warm_url(hub), json=body, headers={"Authorization": f"token {token}"}, timeout=120,
                         allow_redirects=False)


def _xsrf(session: requests.Session) -> str:
    return next((c.value for c in session.cookies if c.name == "_xsrf" and c.path.startswith("/services/dashboard")),
                "")


@pytest.mark.slurm
@pytest.mark.hub
@pytest.mark.slow
def test_students_and_tas_cannot_warm_and_no_request_smuggles_options(hub, people):
    u, ann, tom, ina = hub.user, people["ann"], people["tom"], people["ina"]
    # a student: 403 by token and by cookie, on the dashboard; 403/404 on the hub's API for a classmate's server
    r = _post(hub, ann.token, {"users": [u("ben")]})
    assert r.status_code == 403, (r.status_code, r.text[:300])
    r = ann.session.post(_warm_url(hub), data={"_xsrf": ann.session.cookies.get("_xsrf", path="/hub/")},
                         timeout=60, allow_redirects=False)
    assert r.status_code == 403, (r.status_code, r.text[:300])
    assert ann.api("POST", f"/users/{u('ben')}/server", json={}).status_code in (403, 404)
    # a TA: 403 from the dashboard's read-only gate, by token and by cookie with the dashboard's own XSRF token
    r = _post(hub, tom.token, {})
    assert (r.status_code, r.reason) == (403, TA_REFUSAL)
    ta = hub.login("tom").session
    assert ta.get(f"{hub.url}/services/dashboard/", timeout=60).status_code == 200
    assert "id='warm'" not in ta.get(f"{hub.url}/services/dashboard/", timeout=60).text  # no button for a TA
    r = ta.post(_warm_url(hub), headers={"X-XSRFToken": _xsrf(ta)}, data={"_xsrf": _xsrf(ta)}, timeout=60,
                allow_redirects=False)
    assert (r.status_code, r.reason) == (403, TA_REFUSAL)
    assert tom.api("POST", f"/users/{u('ann')}/server", json={}).status_code in (403, 404)
    # the command with a student's token: refused, said why, nothing started
    r = subprocess.run([sys.executable, "-m", "scalelab.cli", "course", "warm", "--hub",
                        f"{hub.url}/services/dashboard/"], env={**os.environ, "JUPYTERHUB_API_TOKEN": ann.token},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not one of the course's instructors" in r.stderr, (r.returncode, r.stderr)
    # another site's page posting the button with an instructor's cookie but without the dashboard's XSRF token
    ina_browser = hub.login("ina").session
    assert ina_browser.get(f"{hub.url}/services/dashboard/", timeout=60).status_code == 200
    r = ina_browser.post(_warm_url(hub), data={}, timeout=60, allow_redirects=False)
    assert r.status_code == 403 and "_xsrf" in r.text, (r.status_code, r.text[:300])
    # an instructor cannot smuggle a profile or options in, nor warm staff or strangers
    for body, words in (({"users": [u("ann")], "profile": "other"}, "takes only 'users'"),
                        ({"users": [u("ann")], "user_options": {"profile": "other"}}, "takes only 'users'"),
                        ({"users": [u("ina")]}, "not students of this course"),
                        ({"users": [u("nobody")]}, "not students of this course")):
        r = _post(hub, ina.token, body)
        assert r.status_code == 400 and words in r.json()["message"], (body, r.status_code, r.text[:300])
    assert hub.jobs() == [], f"a refused request started something: {hub.jobs()}"
    for who in (ann, people["ben"]):
        assert who.model()["servers"] == {}


@pytest.mark.slurm
@pytest.mark.hub
@pytest.mark.slow
def test_warm_starts_the_class_in_the_reservation_as_each_student_and_a_student_finds_it_running(hub, people):
    u, ben, ina = hub.user, people["ben"], people["ina"]
    # ben started his own server, with another profile: warm leaves it alone
    assert ben.spawn(options={"profile": "other"}).status_code in (201, 202)
    ben.wait_ready(timeout=120)
    ben_job = next(j for j in hub.jobs() if j["user"] == u("ben"))
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": ina.token}
    cli = [sys.executable, "-m", "scalelab.cli", "course", "warm", "--hub", f"{hub.url}/services/dashboard/"]
    r = subprocess.run([*cli, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"{u('ann')}" in r.stdout and "would start" in r.stdout, r.stdout + r.stderr
    assert {j["user"] for j in hub.jobs()} == {u("ben")}, "a dry run started something"
    at = (datetime.now() + timedelta(seconds=3)).strftime("%Y-%m-%dT%H:%M:%S")
    t0 = time.monotonic()
    r = subprocess.run([*cli, "--at", at, "--wait", "180"], env=env, capture_output=True, text=True, timeout=300)
    assert "waiting until" in r.stderr and time.monotonic() - t0 >= 2, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(hub.prefix)}
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)  # eve's failure is reported, in the exit code too
    assert "already running" in lines[u("ben")], r.stdout
    assert "failed" in lines[u("eve")] and "not a course account" in lines[u("eve")], r.stdout
    for short in ("ann", "cy"):  # --wait followed them until ready
        assert lines[u(short)].split()[1] == "ready", r.stdout
    # ann signs in after the warm: her server is there, running as her own account, in the class reservation,
    # with the course's default profile and nothing else
    ann = hub.login("ann")
    ann.wait_ready(timeout=180)
    hub.login("cy").wait_ready(timeout=180)
    jobs = {j["user"]: j for j in hub.jobs()}
    for short in ("ann", "cy"):
        job = jobs[u(short)]
        assert (job["reservation"], job["partition"], job["timelimit"]) == (hub.resv, "cpu", "30:00"), job
    assert jobs[u("ben")]["id"] == ben_job["id"] and jobs[u("ben")]["timelimit"] == "20:00"  # left alone
    assert u("eve") not in jobs
    assert ann.server_model()["user_options"] == {"profile": "warm-cpu"}
    r = ann.session.get(f"{hub.url}/hub/spawn", timeout=60, allow_redirects=False)  # what the browser does next
    assert r.status_code == 302 and f"/user/{ann.name}/" in r.headers["Location"], (r.status_code, r.headers)
    uid = int(ann.run_cell("import os; print(os.getuid())").strip())
    assert uid == pwd.getpwnam(ann.name).pw_uid and uid != 0
    assert len([j for j in hub.jobs() if j["user"] == ann.name]) == 1  # signing in started no second job


@pytest.mark.slurm
@pytest.mark.hub
@pytest.mark.slow
def test_the_dashboard_button_warms_and_shows_each_student(hub, people):
    u = hub.user
    prof = hub.login("prof").session  # a hub admin, by cookie as in a browser
    page = prof.get(f"{hub.url}/services/dashboard/", timeout=60)
    assert page.status_code == 200 and "id='warm'" in page.text, page.text[:500]
    before = {j["id"] for j in hub.jobs()}
    r = prof.post(_warm_url(hub), data={"_xsrf": _xsrf(prof)}, timeout=120, allow_redirects=False)
    assert r.status_code == 200 and "id='warm-results'" in r.text, (r.status_code, r.text[:500])
    for short in ("ann", "ben", "cy"):  # all running since the test before: left alone
        assert f"<td>{u(short)}</td><td class='already-running'>" in r.text, r.text
    assert f"<td>{u('eve')}</td><td class='failed'>" in r.text
    assert u("ina") not in r.text and u("tom") not in r.text  # staff are not warmed
    assert {j["id"] for j in hub.jobs()} == before


@pytest.mark.slurm
@pytest.mark.hub
@pytest.mark.browser
@pytest.mark.slow
def test_the_warm_button_in_a_browser(hub):
    # the page's Content-Security-Policy (no scripts) still lets its form post; the result page lists each student
    from browser import signed_in_page
    with signed_in_page(hub.url, hub.user("prof"), hub.admin_password, hub.workdir / "warm-failure.png") as page:
        page.goto(f"{hub.url}/services/dashboard/")
        page.click("form#warm button")
        page.wait_for_selector("table#warm-results")
        text = page.inner_text("table#warm-results")
        assert hub.user("ann") in text and hub.user("eve") in text and "failed" in text, text
