"""The student's path in a real headless Chromium: log in, the server starts, JupyterLab shows the labs and the
course kernel, a lab notebook opens on that kernel and a cell runs.

Playwright drives Debian's /usr/bin/chromium (Playwright's own browser download does not work here).
"""
from __future__ import annotations

import json
import os
import time

import psutil
import pytest
import requests

from scalelab.testing.hub import HubRunner, slurm_settings

pytestmark = [pytest.mark.browser, pytest.mark.hub, pytest.mark.slow]

CELL = 'import os\nprint("gloo-iface=" + os.environ.get("GLOO_SOCKET_IFNAME", "none"), 6 * 7)'
NOTEBOOK = {
    "cells": [{"cell_type": "markdown", "id": "intro", "metadata": {}, "source": "# Lab 1"},
              {"cell_type": "code", "id": "run-me", "metadata": {}, "execution_count": None, "outputs": [],
               "source": CELL}],
    "metadata": {"kernelspec": {"name": "scalelab", "display_name": "Python 3 (scalelab course)",
                                "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("hub-browser")
    (work / "labs" / "01_intro").mkdir(parents=True)
    (work / "labs" / "01_intro" / "lab.ipynb").write_text(json.dumps(NOTEBOOK))
    runner = HubRunner(work, mode="local", admins=["teacher"], settings={
        "kernels": {"install": True}, "dashboard": {"grades": str(work / "grades")},  # the capstone's board, not public
        "capstone": {"inject_file": str(work / "spool" / "inject.json")}})
    from test_leaderboard import graded, standing
    graded(work / "grades" / "12_capstone", {runner.user("racer"): standing(t=75.0, lost=9.5),
                                             runner.user("slow"): standing(t=None, acc=0.7)})
    runner.start()
    yield runner
    runner.cleanup()


@pytest.fixture(scope="module")
def browser():
    from browser import chromium
    with chromium() as b:
        yield b


def sign_in_to_lab(page, hub, user: str) -> None:
    """Sign in through the form; local mode has no spawn form: the server starts and the hub sends the browser to
    JupyterLab."""
    page.goto(f"{hub.url}/hub/login")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", hub.password)
    page.click("#login_submit")
    page.wait_for_url(f"**/user/{user}/lab**", timeout=90_000)


def test_log_in_start_lab_open_a_lab_and_run_a_cell(hub, browser):
    user = hub.user("stud")
    page = browser.new_page()
    page.set_default_timeout(60_000)
    try:
        sign_in_to_lab(page, hub, user)
        page.wait_for_selector(".jp-Launcher", timeout=90_000)
        assert page.locator(".jp-LauncherCard", has_text="Python 3 (scalelab course)").count() >= 1
        assert page.locator(".jp-DirListing-item", has_text="labs").count() == 1
        page.goto(f"{hub.url}/user/{user}/lab/tree/labs/01_intro/lab.ipynb")
        page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
        page.wait_for_selector(".jp-Toolbar-kernelName:has-text('Python 3 (scalelab course)')")
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        page.locator(".jp-CodeCell").first.click()
        page.keyboard.press("Shift+Enter")
        output = page.wait_for_selector(".jp-OutputArea-output:has-text('gloo-iface=')", timeout=60_000)
        assert "gloo-iface=lo 42" in output.inner_text()
    except Exception:
        page.screenshot(path=str(hub.workdir / "failure.png"))
        raise
    finally:
        page.close()


READ_THE_HUB = """
(async () => {  // what a page at the hub's origin can do with the viewer's cookies: the XSRF token from a hub page,
  const home = await (await fetch("/hub/home", {credentials: "include"})).text();  // then the API with it
  const xsrf = (home.match(/xsrf_token: "([^"]+)"/) || [])[1] || "";
  const r = await fetch("/hub/api/user", {credentials: "include", headers: {"X-XSRFToken": xsrf}});
  return r.status + " " + (await r.text()).slice(0, 300);
})()"""
EVIL_PAGE = """<html><head><title>not run</title></head><body><script>
document.title = "ran";
%s.then(t => document.body.setAttribute("data-leak", "read: " + t))
  .catch(e => document.body.setAttribute("data-leak", "blocked"));
</script></body></html>""" % READ_THE_HUB.strip()


def test_a_page_a_student_serves_never_acts_as_the_instructor_who_opens_it(hub, browser):
    """Attack on the one-origin default: a student serves a page whose script reads the hub API as whoever views
    it, and waits for the instructor (an admin) to "take a look". The page runs sandboxed (jupyter_server's CSP
    sandbox: a unique origin), so its script reads nothing of the hub with the viewer's cookies; the student's own
    server config, which switches the sandbox off here, is ignored (JUPYTERHUB_DISABLE_USER_CONFIG). Controls:
    the script does run (it is the fetch that is refused), and the same fetch from the hub's own origin reads."""
    alice, teacher = hub.login("evilalice"), hub.login("teacher")
    alice.spawn()
    alice.wait_ready()
    r = requests.put(f"{hub.url}/user/{alice.name}/api/contents/evil.html", timeout=30,
                     headers={"Authorization": f"token {alice.token}"},
                     json={"type": "file", "format": "text", "content": EVIL_PAGE})
    assert r.status_code in (200, 201), r.text[:200]
    [server] = [p for p in psutil.process_iter(["cmdline"]) if "jupyterhub-singleuser" in
                " ".join(p.info["cmdline"] or []) and p.environ().get("JUPYTERHUB_USER") == alice.name]
    # the student's own server config (written from a terminal; it is Python run in their server) switches the
    # sandbox off, and the student restarts the server to load it
    config = os.path.join(server.environ()["HOME"], ".jupyter", "jupyter_server_config.py")
    os.makedirs(os.path.dirname(config), exist_ok=True)
    with open(config, "w") as f:
        f.write("import os, jupyter_server.files.handlers as h\n"
                "open(os.path.join(os.path.dirname(__file__), 'loaded'), 'w').close()\n"
                "h.FilesHandler.content_security_policy = property(lambda self: \"frame-ancestors 'self'\")\n")
    alice.stop()
    alice.wait_gone()
    alice.spawn()
    alice.wait_ready()
    evil = f"{hub.url}/user/{alice.name}/files/evil.html"

    def open_as(user: str):
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{hub.url}/hub/login")
        page.fill("input[name=username]", user)
        page.fill("input[name=password]", hub.password_of(user))
        page.click("#login_submit")
        page.wait_for_load_state("networkidle")
        response = page.goto(evil)
        page.wait_for_load_state("networkidle")
        if "/oauth2/authorize" in page.url:  # an admin opening another's server confirms it first (and does)
            with page.expect_navigation():
                page.click("button[type=submit]:has-text('Authorize')")
            response = page.goto(evil)
            page.wait_for_load_state("networkidle")
        leak = page.evaluate("document.body && document.body.getAttribute('data-leak')")
        deadline = time.monotonic() + 10
        while page.title() == "ran" and leak is None and time.monotonic() < deadline:  # the fetch may be slow
            time.sleep(0.2)
            leak = page.evaluate("document.body.getAttribute('data-leak')")
        out = (response.status if response else None, page.title(), leak, page.url)
        context.close()
        return out

    assert not os.path.exists(os.path.join(os.path.dirname(config), "loaded")), "the student's config was loaded"
    for viewer in (teacher.name, alice.name):
        status, title, leak, url = open_as(viewer)
        assert (status, title) == (200, "ran"), (viewer, status, title, url)  # the script runs...
        assert leak == "blocked", f"the student's page read the hub as {viewer}: {leak!r}"  # ...and reads nothing
    context = browser.new_context()  # control: the same fetch from a hub page (not sandboxed) reads as the viewer
    page = context.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("input[name=username]", teacher.name)
    page.fill("input[name=password]", hub.password_of(teacher.name))
    page.click("#login_submit")
    page.wait_for_load_state("networkidle")
    page.goto(f"{hub.url}/hub/home")
    seen = page.evaluate(READ_THE_HUB)
    context.close()
    assert seen.startswith("200 ") and teacher.name in seen, f"the control read {seen!r}: no leak could be seen"
    alice.stop()
    alice.wait_gone()


def test_the_capstone_leaderboard_renders_for_an_instructor_and_the_hub_keeps_students_out(hub, browser):
    """The dashboard's board in Chromium for an instructor (the admin); capstone.public is off on this hub, so the
    hub itself answers a signed-in student 403 before the service runs any code for them."""
    teacher = hub.admins[0]
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        page.goto(f"{hub.url}/hub/login")
        page.fill("input[name=username]", teacher)
        page.fill("input[name=password]", hub.password_of(teacher))
        page.click("#login_submit")
        page.wait_for_load_state()
        page.goto(f"{hub.url}/services/dashboard/leaderboard")
        rows = page.locator("table#leaderboard tbody tr")
        rows.first.wait_for()
        assert rows.count() == 2
        first = rows.nth(0).inner_text()
        assert hub.user("racer") in first and "75.0 s" in first and "9.5 s" in first, first
        assert rows.nth(1).inner_text().split()[0] == "–"  # not reached: no place
        assert page.locator("form#inject button").is_visible()
    except Exception:
        page.screenshot(path=str(hub.workdir / "leaderboard-failure.png"))
        raise
    finally:
        context.close()
    student = hub.login("racer").session
    r = student.get(f"{hub.url}/services/dashboard/leaderboard", timeout=60)
    assert r.status_code == 403 and "leaderboard" not in r.text.lower(), (r.status_code, r.text[:300])


def test_tensorboard_in_jupyterlab_shows_a_runs_scalars_and_memory_is_in_the_status_bar(hub, browser):
    """A student's path to TensorBoard: the launcher has its tile and the status bar the server's memory; a real
    run exported under the home shows its loss through the proxy, and the page fetches nothing from the
    internet."""
    from scalelab.experiments.tensorboard import export_scalars
    from scalelab.launch import launch

    from helpers import tiny
    user = hub.user("tbstud")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    requested = []
    page.on("request", lambda r: requested.append(r.url))
    try:
        sign_in_to_lab(page, hub, user)
        page.wait_for_selector(".jp-LauncherCard:has-text('TensorBoard')", timeout=90_000)
        page.wait_for_function("() => /Mem: [0-9.]+ [MG]B/.test("
                               "document.querySelector('#jp-main-statusbar')?.innerText || '')")
        home = hub.workdir / "state" / "homes" / user  # servers.home's default, as a lab's out_dir="runs" is
        run = launch(tiny(home / "labs" / "01_intro" / "runs", workers=1, steps=6))
        run.wait(timeout=120)
        export_scalars(run.run_dir)
        page.goto(f"{hub.url}/user/{user}/tensorboard/")
        page.wait_for_selector("text=01_intro/runs/run/tensorboard/rank-0", timeout=60_000)  # logdir ~/labs
        page.fill("input[placeholder='Filter tags (regex)']", "^loss$")
        page.get_by_text("loss", exact=True).first.wait_for()
        page.get_by_text("end/final_loss").wait_for(state="hidden")  # the filter leaves only the loss card
        outside = [u for u in requested if not u.startswith((hub.url, "data:", "blob:"))]
        assert outside == [], f"the pages fetched from outside the hub: {outside[:5]}"
        metrics = hub.login("tbstud").get(f"/user/{user}/api/metrics/v1")  # jupyter-resource-usage
        assert metrics.status_code == 200 and metrics.json()["rss"] > 10_000_000, metrics.text[:300]
    except Exception:
        page.screenshot(path=str(hub.workdir / "tensorboard-failure.png"))
        raise
    finally:
        page.close()


def test_another_student_cannot_reach_a_students_tensorboard_and_it_listens_on_no_tcp_port(hub):
    """Attack: TensorBoard has no authentication of its own. Another student (token or cookies) gets 403, nobody
    signed in is sent to the hub's login; the TensorBoard process holds no TCP/UDP socket, only a Unix socket in
    a directory private to the server's account."""
    alice, bob = hub.login("tbalice"), hub.login("tbbob")
    alice.spawn()
    alice.wait_ready()
    path = f"/user/{alice.name}/tensorboard/"
    assert alice.get(path).status_code == 200  # starts it
    assert bob.get(path).status_code == 403
    via_cookies = bob.session.get(f"{hub.url}{path}", timeout=30)  # the browser's way: OAuth through the hub
    assert via_cookies.status_code == 403 and "/hub/" in via_cookies.url
    anonymous = requests.get(f"{hub.url}{path}", allow_redirects=False, timeout=30)
    assert anonymous.status_code == 302 and anonymous.headers["Location"].startswith("/hub/")
    [tb] = [p for p in psutil.process_iter(["cmdline"]) if "scalelab.hub.tensorboard_proxy" in
            " ".join(p.info["cmdline"] or []) and p.environ().get("JUPYTERHUB_USER") == alice.name]
    assert [c for p in (tb, *tb.children(recursive=True)) for c in p.net_connections(kind="inet")] == []
    sockets = sorted({c.laddr for c in tb.net_connections(kind="unix") if c.laddr})  # psutil: no LISTEN on unix
    assert sockets == [tb.cmdline()[tb.cmdline().index("--socket") + 1]]
    folder = os.stat(os.path.dirname(sockets[0]))
    assert (folder.st_mode & 0o777, folder.st_uid) == (0o700, tb.uids().effective)
    alice.stop()
    alice.wait_gone()
    psutil.wait_procs([tb], timeout=30)
    assert not tb.is_running(), "TensorBoard outlived the student's server"


@pytest.mark.slurm
def test_slurm_spawn_form_pick_a_profile_and_get_lab(tmp_path, slurm_cluster, browser):
    """slurm mode: the form lists the profiles (one on a partition this cluster lacks, disabled); the chosen one
    starts as a job and JupyterLab opens."""
    profiles = [{"name": "cpu-1h", "display_name": "CPU, 1 h", "partition": "cpu", "memory": "1G",
                 "walltime": "1:00:00"},
                {"name": "gpu-1h", "display_name": "1 GPU, 1 h", "partition": "no-such-gpu-partition",
                 "gpus_per_node": 1, "walltime": "1:00:00"}]
    runner = HubRunner(tmp_path, mode="slurm", settings=slurm_settings(slurm_cluster, "", profiles))
    user = runner.user("slurmstud")
    page = browser.new_page()
    page.set_default_timeout(60_000)
    try:
        runner.start()
        page.goto(f"{runner.url}/hub/login")
        page.fill("input[name=username]", user)
        page.fill("input[name=password]", runner.password)
        page.click("#login_submit")
        page.wait_for_selector("input[name=profile][value=cpu-1h]")
        assert page.locator("input[name=profile][value=gpu-1h]").is_disabled()
        assert page.get_by_text("not available on this cluster").count() == 1
        page.check("input[name=profile][value=cpu-1h]")
        page.select_option("select[name=walltime]", "0:30:00")
        page.click("form input[type=submit], form button[type=submit]")
        page.wait_for_url(f"**/user/{user}/lab**", timeout=120_000)
        page.wait_for_selector(".jp-Launcher", timeout=90_000)
        [job] = runner.jobs()
        assert (job["partition"], job["timelimit"]) == ("cpu", "30:00")
    except Exception:
        page.screenshot(path=str(tmp_path / "failure.png"))
        raise
    finally:
        page.close()
        runner.cleanup()


@pytest.fixture(scope="module")
def lab_hub(tmp_path_factory):
    """A hub whose students get the released lab 02 (solutions out, exercise cells going on), on the course kernel."""
    from scalelab.course.release import release_lab
    from scalelab.paths import labs_dir
    work = tmp_path_factory.mktemp("hub-lab02")
    release_lab(labs_dir() / "02_data_parallel", work / "labs" / "02_data_parallel")
    runner = HubRunner(work, mode="local", settings={"kernels": {"install": True}})
    runner.start()
    yield runner
    runner.cleanup()


def test_a_student_runs_all_of_lab_02_and_sees_the_panel_move_and_the_self_check(lab_hub, browser):
    """The student's path through a real lab: Run All on a fresh student copy goes past the unsolved exercises to
    the LaunchPanel, whose plot changes while its runs go, and ends in a SelfCheck with coloured results."""
    hub, user = lab_hub, lab_hub.user("newstudent")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    try:
        sign_in_to_lab(page, hub, user)
        page.goto(f"{hub.url}/user/{user}/lab/tree/labs/02_data_parallel/lab.ipynb")
        page.wait_for_selector(".jp-Toolbar-kernelName:has-text('Python 3 (scalelab course)')", timeout=90_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
        page.locator(".jp-NotebookPanel .jp-Cell").first.click()
        page.keyboard.press("Escape")
        page.locator("div.lm-MenuBar-itemLabel", has_text="Run").click()
        page.get_by_text("Run All Cells", exact=True).click()
        # the LaunchPanel's image: count the different pictures it shows while its runs go
        images, deadline = set(), time.monotonic() + 400
        while time.monotonic() < deadline:
            for src in page.eval_on_selector_all(".widget-image", "els => els.map(e => e.src)"):
                images.add(src)
            if page.locator("text=Self-check 02_data_parallel").count():
                break
            page.wait_for_timeout(300)
        assert len(images) >= 5, f"the panel's plot showed {len(images)} different images during its runs"
        report = page.locator("text=Self-check 02_data_parallel").first
        html = report.evaluate("e => e.closest('.jp-OutputArea-output, .widget-html').innerHTML")
        assert "color:#176b2c" in html.replace(" ", "") or "color: rgb(23, 107, 44)" in html
        assert "#a11" in html or "#6b4fa1" in html or "rgb(170, 17, 17)" in html  # unsolved: red or purple rows
    except Exception:
        page.screenshot(path=str(hub.workdir / "lab02-failure.png"))
        raise
    finally:
        page.close()
