"""The class dashboard: what it shows (from homes and the hub's user models), and on a real hub who may open it.

An admin (and a listed instructor) sees every student's server and lab progress; a student gets 403 from the hub's
OAuth before the page runs; in a headless Chromium the admin's page shows the table.

The capstone's leaderboard (scalelab.hub.capstone): real names for instructors; with capstone.public (this file's
hub) students see it pseudonymised and every other path of the service stays 403 for them; without it the hub keeps
them out (tests/test_hub_browser.py's hub, and the roles below); only instructors inject a failure, with the page's
XSRF token.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from scalelab.course.release import release_lab
from scalelab.grade.leaderboard import pseudonym
from scalelab.hub.capstone import KEY_FILE, pseudonym_key
from scalelab.hub.dashboard import class_snapshot, lab_progress, render_page, slurm_jobs
from scalelab.hub.settings import SettingsError, load_settings
from scalelab.record import MIME
from scalelab.testing.hub import HubRunner
from test_leaderboard import HOSTILE, graded, standing

FIX = Path(__file__).parent / "fixtures" / "grading"


def _notebook_with_records(**records) -> dict:
    """A saved notebook whose outputs hold `records` as a kernel's record() displays them."""
    outputs = [{"output_type": "display_data", "metadata": {},
                "data": {MIME: {"name": k, "value": v}, "text/plain": f"record: {k}"}} for k, v in records.items()]
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
            "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": 1, "source": "",
                       "outputs": outputs}]}


@pytest.fixture
def course(tmp_path):
    labs = tmp_path / "labs"
    release_lab(FIX / "labs" / "90_fixture", labs / "90_fixture")
    cfg = load_settings(overrides={"labs": {"source": str(labs)}, "hub": {"state_dir": str(tmp_path / "state")},
                                   "servers": {"run_as": "hub-account", "home": str(tmp_path / "homes/{username}")},
                                   "auth": {"any_name": True}})
    return tmp_path, cfg


def test_progress_is_the_public_checks_on_the_saved_records(course):
    tmp, cfg = course
    home = tmp / "homes" / "ann"
    (home / "labs" / "90_fixture").mkdir(parents=True)
    import random
    rng = random.Random(0)
    mean = sum(rng.gauss(3.0, 1.0) for _ in range(1000)) / 1000
    (home / "labs" / "90_fixture" / "lab.ipynb").write_text(json.dumps(_notebook_with_records(n=1000, seed=0,
                                                                                              mean=mean)))
    got = lab_progress(home, "labs", tmp / "labs" / "90_fixture")
    assert got["state"] == "in progress" and got["passed"] == 1 and got["total"] == 2, got
    assert lab_progress(tmp / "homes" / "ben", "labs", tmp / "labs" / "90_fixture")["state"] == "not started"
    # a link planted where the notebook should be is never followed
    (tmp / "homes" / "eve" / "labs").mkdir(parents=True)
    (tmp / "homes" / "eve" / "labs" / "90_fixture").symlink_to(home / "labs" / "90_fixture")
    assert lab_progress(tmp / "homes" / "eve", "labs", tmp / "labs" / "90_fixture")["state"] == "not started"


def test_the_page_lists_every_student_with_server_and_progress_and_escapes_names(course):
    tmp, cfg = course
    users = [{"name": "ann", "admin": False, "servers": {"": {"ready": True, "url": "http://node7:4321/user/ann/"}}},
             {"name": "<b>ben</b>", "admin": False, "servers": {}}]
    snap = class_snapshot(cfg, users)
    assert snap["labs"] == ["90_fixture"]
    rows = {r["name"]: r for r in snap["students"]}
    assert (rows["ann"]["server"], rows["ann"]["node"]) == ("ready", "node7")
    assert rows["<b>ben</b>"]["server"] == "stopped"
    page = render_page(snap)
    assert "&lt;b&gt;ben&lt;/b&gt;" in page and "<b>ben</b>" not in page
    assert "ready on node7" in page


# -- on a real hub -------------------------------------------------------------------------------------------------

def _login(hub: HubRunner, name: str, password: str) -> requests.Session:
    s = requests.Session()
    s.get(f"{hub.url}/hub/login", timeout=30)
    r = s.post(f"{hub.url}/hub/login", data={"username": name, "password": password,
                                             "_xsrf": s.cookies.get("_xsrf", "")}, allow_redirects=False, timeout=30)
    assert r.status_code == 302, (r.status_code, hub.log_tail())
    return s


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("hub-dashboard")
    release_lab(FIX / "labs" / "90_fixture", work / "labs" / "90_fixture")
    runner = HubRunner(work, mode="local")
    runner.settings["hub"]["admin_users"] = [runner.user("prof")]
    runner.settings["auth"]["admin_password"] = "admin-pw-" + "x" * 24
    runner.settings["dashboard"]["instructors"] = [runner.user("ta")]
    runner.settings["dashboard"]["tas"] = [runner.user("helper")]
    runner.settings["dashboard"]["grades"] = str(work / "grades")
    runner.settings["capstone"] = {"public": True, "inject_file": str(work / "spool" / "inject.json")}
    graded(work / "grades" / "12_capstone", {runner.user("stud"): standing(t=90.0), runner.user("other"): standing(
        t=60.0, lost=12.0), HOSTILE: standing(t=30.0), runner.user("late"): standing(ranked=False, why="over budget")})
    import yaml
    runner.config_path.write_text(yaml.safe_dump(runner.settings, sort_keys=False), encoding="utf-8")
    runner.start()
    yield runner
    runner.cleanup()


@pytest.mark.hub
@pytest.mark.slow
def test_admin_and_instructor_see_the_class_and_a_student_gets_403(hub):
    student = hub.login("stud")
    assert student.spawn().status_code in (201, 202)
    student.wait_ready(timeout=120)
    url = f"{hub.url}/services/dashboard/"
    admin = _login(hub, hub.user("prof"), hub.settings["auth"]["admin_password"])
    r = admin.get(url, timeout=60)
    assert r.status_code == 200, (r.status_code, r.text[:500], hub.log_tail())
    assert hub.user("stud") in r.text and "ready" in r.text and "90_fixture" in r.text
    data = admin.get(url + "api/class", timeout=60).json()
    row = next(s for s in data["students"] if s["name"] == hub.user("stud"))
    assert row["server"] == "ready" and row["progress"]["90_fixture"]["state"] in ("not started", "in progress")
    ta = _login(hub, hub.user("ta"), hub.password)
    assert ta.get(url, timeout=60).status_code == 200
    for who in (student.session, _login(hub, hub.user("other"), hub.password)):
        r = who.get(url, timeout=60)
        assert r.status_code == 403, (r.status_code, r.url)
        assert "table id='class'" not in r.text  # nothing of the page reaches them
        assert who.get(url + "api/class", timeout=60).status_code == 403


@pytest.mark.hub
@pytest.mark.browser
@pytest.mark.slow
def test_the_dashboard_in_a_browser(hub):
    from browser import signed_in_page
    with signed_in_page(hub.url, hub.user("prof"), hub.settings["auth"]["admin_password"],
                        hub.workdir / "dashboard-failure.png") as page:
        page.goto(f"{hub.url}/services/dashboard/")
        page.wait_for_selector("table#class")
        text = page.inner_text("table#class")
        assert re.search(rf"{re.escape(hub.user('stud'))}", text), text
        assert "90_fixture" in text


def test_a_job_named_after_a_classmate_is_not_shown_as_their_server(tmp_path, monkeypatch):
    # attack: `sbatch -J jupyter-bob` by alice would otherwise show as bob's server on the instructors' page
    import os
    import pwd
    hub_account = pwd.getpwuid(os.geteuid()).pw_name
    queue = (f"101|jupyter-bob|RUNNING|node1|bob\n102|jupyter-carl|RUNNING|node2|alice\n"
             f"103|jupyter-dee|PENDING||{hub_account}\n104|training|RUNNING|node1|bob\n")
    (tmp_path / "squeue").write_text(f"#!/bin/sh\nprintf '{queue}'\n")
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cfg = load_settings(overrides={"mode": "slurm", "hub": {"state_dir": str(tmp_path / "state")}})
    cfg["servers"]["run_as"] = "student-accounts"
    assert slurm_jobs(cfg) == {"bob": {"job": "101", "state": "running", "nodes": "node1"}}
    cfg["servers"]["run_as"] = "hub-account"  # the hub submits every server as itself
    assert slurm_jobs(cfg) == {"dee": {"job": "103", "state": "pending", "nodes": ""}}


def test_a_large_saved_notebook_costs_the_page_neither_memory_nor_time_and_the_rest_is_shown(course, monkeypatch):
    # One student's saved notebook was read whole (up to 64 MiB) and parsed at every page load: a few MiB of
    # `[[],[],...]` parse into gigabytes of objects and tens of seconds, for every instructor's load. Now a notebook
    # over the size cap is not read and one with more JSON values than the item cap is not parsed: that student's
    # lab shows "too large", every other cell is filled in.
    import tracemalloc
    from scalelab.hub import dashboard
    tmp, cfg = course
    lab = tmp / "labs" / "90_fixture"
    for name in ("ann", "huge", "dense"):
        (tmp / "homes" / name / "labs" / "90_fixture").mkdir(parents=True)
    import random
    rng = random.Random(0)
    mean = sum(rng.gauss(3.0, 1.0) for _ in range(1000)) / 1000
    ok = json.dumps(_notebook_with_records(n=1000, seed=0, mean=mean))
    (tmp / "homes" / "ann" / "labs" / "90_fixture" / "lab.ipynb").write_text(ok)
    big = _notebook_with_records(n=1000, seed=0)
    big["metadata"]["padding"] = "x" * 4096  # over the (patched) size cap: cheap to exceed
    (tmp / "homes" / "huge" / "labs" / "90_fixture" / "lab.ipynb").write_text(json.dumps(big))
    # a real one: 12 MiB of empty lists, under the real size cap; parsed, it is about 4 million objects
    dense = tmp / "homes" / "dense" / "labs" / "90_fixture" / "lab.ipynb"
    with open(dense, "w") as f:
        f.write(ok[:-1] + ', "padding": [' + "[]," * (4 * 2**20) + "[]]}")
    assert dense.stat().st_size > 12 * 2**20 and json.loads(ok)  # the control file is a notebook
    monkeypatch.setattr(dashboard, "MAX_NOTEBOOK_BYTES", 4096)
    assert dashboard.lab_progress(tmp / "homes" / "huge", "labs", lab)["state"] == "too large"
    monkeypatch.setattr(dashboard, "MAX_NOTEBOOK_BYTES", 16 * 2**20)  # the real cap: the dense file is under it
    tracemalloc.start()
    try:
        got = dashboard.lab_progress(tmp / "homes" / "dense", "labs", lab)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got["state"] == "too large" and got["bytes"] == dense.stat().st_size, got
    assert peak < 3 * dense.stat().st_size, f"{peak / 2**20:.0f} MiB to refuse a {dense.stat().st_size >> 20} MiB file"
    monkeypatch.setattr(dashboard, "MAX_NOTEBOOK_BYTES", 4096)
    users = [{"name": n, "servers": {}} for n in ("ann", "dense", "huge")]
    snap = class_snapshot(cfg, users)
    progress = {s["name"]: s["progress"]["90_fixture"] for s in snap["students"]}
    assert progress["huge"]["state"] == progress["dense"]["state"] == "too large"
    assert (progress["ann"]["state"], progress["ann"]["passed"]) == ("in progress", 1)  # the control: read
    page = render_page(snap)
    assert page.count('class="too-large"') == 2 and "MiB: not read" in page


# -- the capstone: settings, roles, every server's environment (no hub) ---------------------------------------------

def test_capstone_settings_have_defaults_and_mistakes_are_named(tmp_path):
    cfg = load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state")}})
    assert cfg["capstone"] == {"lab": "12_capstone", "public": False, "inject_file": "/var/lib/scalelab/inject.json",
                               "pseudonym_key_file": ""}
    for over, words in (({"capstone": {"pubilc": True}}, "did you mean 'public'"),
                        ({"capstone": {"inject_file": ""}}, "capstone.inject_file: '' is not valid"),
                        ({"capstone": {"lab": "../etc"}}, "capstone.lab"),
                        ({"capstone": {"public": True}, "dashboard": {"enabled": False}}, "dashboard.enabled"),
                        ({"capstone": {"inject_file": str(tmp_path / "state/homes/x.json")}}, "inside the students'")):
        with pytest.raises(SettingsError, match=re.escape(words)):
            load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state")}, **over})


def test_students_reach_the_dashboard_through_the_hub_only_when_the_board_is_public(tmp_path):
    from traitlets.config import Config
    from scalelab.hub.config import BOARD_SCOPE, update_dashboard
    cfg = load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state"), "admin_users": ["prof"]},
                                   "auth": {"allowed_users": ["ann", "ben", "tom", "ina"]},
                                   "dashboard": {"instructors": ["ina"], "tas": ["tom"]}})
    c = Config()
    update_dashboard(c, cfg)
    granted = [r for r in c.JupyterHub.load_roles if BOARD_SCOPE in r["scopes"]]
    assert {r["name"] for r in granted} == {"course-instructors", "course-tas"}, granted  # no student
    assert BOARD_SCOPE not in (c.JupyterHub.get("extra_user_scopes") or set())
    cfg["capstone"]["public"] = True
    update_dashboard(c, cfg)
    board = next(r for r in c.JupyterHub.load_roles if r["name"] == "capstone-board")
    assert board == {"name": "capstone-board", "scopes": [BOARD_SCOPE], "users": ["ann", "ben"]}  # not the staff
    cfg["auth"]["allowed_users"], cfg["auth"]["any_name"] = [], True  # a try-out hub: every user
    update_dashboard(c, cfg)
    assert BOARD_SCOPE in c.JupyterHub.extra_user_scopes
    assert not [r for r in c.JupyterHub.load_roles if r["name"] == "capstone-board"]
    cfg["capstone"]["public"] = False  # and back: nobody
    update_dashboard(c, cfg)
    assert BOARD_SCOPE not in c.JupyterHub.extra_user_scopes


def test_every_server_local_or_slurm_gets_the_spool_file_in_its_environment(tmp_path):
    from types import SimpleNamespace
    from unittest import mock
    from jupyterhub.objects import Hub
    from traitlets.config import Config
    from scalelab.hub.config import update_servers
    from scalelab.hub.local_spawner import CourseLocalSpawner
    from scalelab.hub.slurm_spawner import CourseSlurmSpawner
    cfg = load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state")},
                                   "capstone": {"inject_file": str(tmp_path / "spool.json")}})
    c = Config()
    update_servers(c, cfg)
    user = SimpleNamespace(name="alice", escaped_name="alice", url="/user/alice/", base_url="/user/alice/")
    for cls in (CourseLocalSpawner, CourseSlurmSpawner):
        sp = cls(config=c, user=user, hub=Hub(), db=mock.MagicMock(), api_token="t", run_as="hub-account",
                 home_template=str(tmp_path / "homes/{username}"), oauth_client_id="jupyterhub-user-alice")
        sp.orm_spawner = None
        assert sp.get_env()["SCALELAB_INJECT_FILE"] == str(tmp_path / "spool.json"), cls


# -- the capstone's board and injection on the real hub (capstone.public there) -------------------------------------

def _dashboard_xsrf(session: requests.Session) -> str:
    return next((c.value for c in session.cookies if c.name == "_xsrf" and c.path.startswith("/services/dashboard")),
                "")


@pytest.mark.hub
@pytest.mark.slow
def test_instructors_see_the_leaderboard_under_real_names_escaped(hub):
    url = f"{hub.url}/services/dashboard/"
    admin = _login(hub, hub.user("prof"), hub.settings["auth"]["admin_password"])
    board = admin.get(url + "api/leaderboard", timeout=60).json()
    assert [r["student"] for r in board["rows"]] == [HOSTILE, hub.user("other"), hub.user("stud"), hub.user("late")]
    assert [r["place"] for r in board["rows"]] == [1, 2, 3, None] and board["rows"][-1]["why"] == "over budget"
    page = admin.get(url + "leaderboard", timeout=60)
    assert page.status_code == 200 and "<table id='leaderboard'>" in page.text, (page.status_code, page.text[:300])
    assert "<script>alert" not in page.text and "&lt;script&gt;alert" in page.text
    assert "id='inject'" in page.text and hub.user("stud") in page.text and "over budget" in page.text
    assert "href='leaderboard'" in admin.get(url, timeout=60).text  # the dashboard links to it


@pytest.mark.hub
@pytest.mark.slow
def test_a_student_sees_the_public_board_pseudonymised_and_nothing_else_of_the_dashboard(hub):
    hub.login("other")  # a classmate who has signed in: a course student on this hub (no class list)
    stud = hub.login("stud")
    url = f"{hub.url}/services/dashboard/"
    r = stud.session.get(url + "api/leaderboard", timeout=60)
    assert r.status_code == 200, (r.status_code, r.text[:300], hub.log_tail())
    key = pseudonym_key(f"{hub.settings['hub']['state_dir']}/{KEY_FILE}")  # the hub made it at first use
    board = r.json()
    assert board["view"] == "student"
    assert [(x["student"], x["you"]) for x in board["rows"]] == [(pseudonym(hub.user("other"), key), False),
                                                                 (pseudonym(hub.user("stud"), key), True)]
    page = stud.session.get(url + "leaderboard", timeout=60).text
    assert pseudonym(hub.user("stud"), key) in page and "you</strong>" in page
    for text in (r.text, page):
        assert hub.prefix not in text and "script" not in text  # no real name, the unlisted hostile one neither
    assert "id='inject'" not in page and "_xsrf" not in page
    # attack: every other path of the service, by cookie and by the student's own hub token
    token = {"Authorization": f"token {stud.token}"}
    for path in ("", "api/class", "api/warm", "api/inject", "nothing-here", "leaderboard/", "api/leaderboard/x",
                 "leaderboard/../api/class", "api/class?leaderboard", "API/leaderboard"):
        for kw in ({}, {"headers": token}):
            got = (stud.session if not kw else requests).get(url + path, timeout=60, allow_redirects=False, **kw)
            assert got.status_code == 403, (path, kw, got.status_code, got.text[:200])
            assert "table id='class'" not in got.text
    for path, body in (("api/inject", {"kind": "kill"}), ("api/warm", {}), ("api/leaderboard", {})):
        got = requests.post(url + path, json=body, headers=token, timeout=60, allow_redirects=False)
        assert got.status_code == 403, (path, got.status_code, got.text[:200])
        stud.session.cookies.set("_xsrf", "forged", path="/services/dashboard/")  # their own cookie and field agree
        got = stud.session.post(url + path, data={"_xsrf": "forged", "kind": "kill"}, timeout=60,
                                allow_redirects=False)
        assert got.status_code == 403, (path, got.status_code, got.text[:200])
    assert not (hub.workdir / "spool" / "inject.json").exists()


@pytest.mark.hub
@pytest.mark.slow
def test_only_an_instructor_injects_a_failure_and_only_with_the_pages_xsrf_token(hub):
    url = f"{hub.url}/services/dashboard/"
    spool = hub.workdir / "spool" / "inject.json"
    ta = _login(hub, hub.user("helper"), hub.password)  # a TA: sees the board, may not act
    assert ta.get(url + "leaderboard", timeout=60).status_code == 200
    r = ta.post(url + "api/inject", data={"_xsrf": _dashboard_xsrf(ta), "kind": "kill"}, timeout=60,
                allow_redirects=False)
    assert r.status_code == 403, (r.status_code, r.text[:300])
    admin = _login(hub, hub.user("prof"), hub.settings["auth"]["admin_password"])
    assert "id='inject'" in admin.get(url + "leaderboard", timeout=60).text
    r = admin.post(url + "api/inject", data={"kind": "kill"}, timeout=60, allow_redirects=False)  # another site's form
    assert r.status_code == 403 and "_xsrf" in r.text, (r.status_code, r.text[:300])
    assert not spool.exists()
    r = admin.post(url + "api/inject", data={"_xsrf": _dashboard_xsrf(admin), "kind": "bogus"}, timeout=60)
    assert r.status_code == 400 and not spool.exists(), (r.status_code, r.text[:300])
    r = admin.post(url + "api/inject", data={"_xsrf": _dashboard_xsrf(admin), "kind": "preempt"}, timeout=60)
    assert r.status_code == 200 and "id='issued'" in r.text, (r.status_code, r.text[:300], hub.log_tail())
    record = json.loads(spool.read_text())
    assert (record["kind"], record["by"], record["lab"]) == ("preempt", hub.user("prof"), "12_capstone")
    assert record["id"] in r.text and (spool.stat().st_mode & 0o777) == 0o644
