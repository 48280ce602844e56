"""`scalelab hub` in the local default mode (what `make hub` runs): a real hub, servers as local processes."""
from __future__ import annotations

import json

import pytest

from scalelab.testing.hub import HubRunner

pytestmark = [pytest.mark.hub, pytest.mark.slow]

NOTEBOOK = {"cells": [], "metadata": {"kernelspec": {"name": "scalelab", "display_name": "Python 3 (scalelab course)",
                                                     "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("hub-local")
    (work / "labs" / "01_intro").mkdir(parents=True)
    (work / "labs" / "01_intro" / "lab.ipynb").write_text(json.dumps(NOTEBOOK))
    (work / "labs" / "01_intro" / "hidden_checks.py").write_text("secret = 1\n")
    runner = HubRunner(work, mode="local", settings={"auth": {"password": ""}, "kernels": {"install": True},
                                                     "culler": {"enabled": True}})
    runner.start()
    yield runner
    runner.cleanup()


def test_the_generated_password_is_shown_at_start_and_kept(hub):
    assert len(hub.password) >= 8
    assert f"the password: {hub.password}" in hub.log_path.read_text()
    assert (hub.workdir / "state" / "password").stat().st_mode & 0o777 == 0o600


def test_binds_the_loopback_only(hub):
    import psutil
    listening = {c.laddr.port: c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN"}
    assert listening[hub.port] == "127.0.0.1" and listening[hub.hub_port] == "127.0.0.1"


def test_spawn_gives_lab_with_the_labs_and_the_course_kernel(hub):
    ann = hub.login("ann")
    assert ann.spawn().status_code in (201, 202)
    ann.wait_ready(timeout=60)
    assert ann.get(f"/user/{ann.name}/api/status").status_code == 200
    listing = ann.get(f"/user/{ann.name}/api/contents/labs/01_intro").json()
    assert [c["name"] for c in listing["content"]] == ["lab.ipynb"], "labs handed out, hidden checks kept back"
    specs = ann.get(f"/user/{ann.name}/api/kernelspecs").json()["kernelspecs"]
    assert specs["scalelab"]["spec"]["display_name"] == "Python 3 (scalelab course)"
    assert specs["scalelab"]["spec"]["env"]["GLOO_SOCKET_IFNAME"] == "lo"
    home = hub.workdir / "state" / "homes" / ann.name
    assert (home / "labs" / "01_intro" / "lab.ipynb").is_file()
    assert ann.stop().status_code in (202, 204)
    ann.wait_gone()


def test_the_idle_culler_runs_as_a_hub_service(hub):
    import psutil
    culler = [p for p in psutil.process_iter(["cmdline"]) if "scalelab.hub.culler" in " ".join(p.info["cmdline"] or [])
              and f":{hub.hub_port}/" in p.environ().get("JUPYTERHUB_API_URL", "")]
    assert len(culler) == 1, "one culler, started by this hub"
    assert "--timeout=3600" in culler[0].cmdline()
    assert "Starting managed service idle-culler" in hub.log_path.read_text()


def test_a_hub_started_in_the_background_stops_promptly(tmp_path):
    """A shell's background job ignores SIGINT, and so did the upstream culler it started: each stop took ~31 s."""
    import time

    runner = HubRunner(tmp_path, settings={"culler": {"enabled": True}})
    try:
        runner.start(ignore_sigint=True)
        time.sleep(3)  # the culler is in its loop
        t0 = time.monotonic()
        runner.stop()
        assert time.monotonic() - t0 < 10
    finally:
        runner.cleanup()
