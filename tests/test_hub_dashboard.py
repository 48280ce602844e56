"""The class dashboard: what it shows (from homes and the hub's user models), and on a real hub who may open it.

An admin (and a listed instructor) sees every student's server and lab progress; a student gets 403 from the hub's
OAuth before the page runs; in a headless Chromium the admin's page shows the table.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from scalelab.course.release import release_lab
from scalelab.hub.dashboard import class_snapshot, lab_progress, render_page, slurm_jobs
from scalelab.hub.settings import load_settings
from scalelab.record import MIME
from scalelab.testing.hub import HubRunner

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
    from playwright.sync_api import sync_playwright
    from tests.test_hub_browser import CHROMIUM_ARGS
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.set_default_timeout(60_000)
        try:
            page.goto(f"{hub.url}/hub/login")
            page.fill("input[name=username]", hub.user("prof"))
            page.fill("input[name=password]", hub.settings["auth"]["admin_password"])
            page.click("#login_submit")
            page.wait_for_load_state()
            page.goto(f"{hub.url}/services/dashboard/")
            page.wait_for_selector("table#class")
            text = page.inner_text("table#class")
            assert re.search(rf"{re.escape(hub.user('stud'))}", text), text
            assert "90_fixture" in text
        except Exception:
            page.screenshot(path=str(hub.workdir / "dashboard-failure.png"))
            raise
        finally:
            browser.close()


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
