"""The student's path in a real headless Chromium: log in, the server starts, JupyterLab shows the labs and the
course kernel, a lab notebook opens on that kernel and a cell runs.

Playwright drives Debian's /usr/bin/chromium (Playwright's own browser download does not work here).
"""
from __future__ import annotations

import json
import time

import pytest

from scalelab.testing.hub import HubRunner, slurm_settings

pytestmark = [pytest.mark.browser, pytest.mark.hub, pytest.mark.slow]

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
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
    runner = HubRunner(work, mode="local", settings={"kernels": {"install": True}})
    runner.start()
    yield runner
    runner.cleanup()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


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
