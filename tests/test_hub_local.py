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


# -- the sign-in throttle's address: the connection's, never a client's forwarding header (issue 39) ---------------

class _From(__import__("requests").adapters.HTTPAdapter):
    """Connections from a given loopback address (127.0.0.2, 127.0.0.3: each a "machine" of its own)."""

    def __init__(self, ip):
        self.ip = ip
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.ip, 0)
        super().init_poolmanager(*args, **kwargs)


def _sign_in(hub, source, name, password, headers=None) -> int:
    import requests
    s = requests.Session()
    s.mount("http://", _From(source))
    s.headers.update(headers or {})
    s.get(f"{hub.url}/hub/login", timeout=30)
    return s.post(f"{hub.url}/hub/login", data={"username": name, "password": password,
                                                "_xsrf": s.cookies.get("_xsrf", "")},
                  allow_redirects=False, timeout=30).status_code


@pytest.fixture(scope="module")
def throttled(tmp_path_factory):
    runner = HubRunner(tmp_path_factory.mktemp("hub-throttle"), mode="local", settings={"auth": {"throttle": {
        "failures_per_name": 100, "failures_per_address": 3, "window_s": 60, "lockout_s": 60}}})
    runner.start()
    yield runner
    runner.cleanup()


def test_a_forged_forwarding_header_cannot_lock_out_an_address_or_dodge_the_limit(throttled):
    """ATTACK through the hub's own proxy: from 127.0.0.3, three wrong passwords claiming (X-Real-IP,
    X-Forwarded-For) to come from the classroom's 127.0.0.2; then the right password under yet another made-up
    address. The classroom still signs in; the attacker is locked by the address it really comes from; the log
    names that address."""
    hub = throttled
    forged = {"X-Real-IP": "127.0.0.2", "X-Forwarded-For": "127.0.0.2"}
    assert [_sign_in(hub, "127.0.0.3", hub.user(f"x{i}"), "wrong", forged) for i in range(3)] == [403] * 3
    assert _sign_in(hub, "127.0.0.2", hub.user("amy"), hub.password) == 302  # the control: the classroom
    dodge = {"X-Real-IP": "10.11.12.13", "X-Forwarded-For": "10.11.12.13"}
    assert _sign_in(hub, "127.0.0.3", hub.user("y"), hub.password, dodge) == 429
    log = hub.log_path.read_text(errors="replace")
    assert "Sign-in locked: address '127.0.0.3'" in log and "address '127.0.0.2'" not in log
    assert "10.11.12.13" not in log  # the request log too: every line names the connection's address
    assert "POST /hub/login (@127.0.0.3)" in log and "(@127.0.0.2)" in log


# -- the class list is the whole gate (issue 39) --------------------------------------------------------------------

@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    runner = HubRunner(tmp_path_factory.mktemp("hub-listed"), mode="local")
    prof = runner.user("prof")
    runner.settings["auth"].update({"any_name": False, "allowed_users": [runner.user("alice")],
                                    "admin_password": "admin-pw-" + "x" * 24})
    runner.settings["hub"]["admin_users"] = [prof]
    import yaml
    runner.config_path.write_text(yaml.safe_dump(runner.settings, sort_keys=False), encoding="utf-8")
    runner.start()
    yield runner
    runner.cleanup()


def test_a_user_in_the_hubs_database_but_not_on_the_class_list_cannot_sign_in(listed):
    """ATTACK: JupyterHub lets every user of its database sign in (allow_existing_users): one an admin added, one
    dropped from the list, one left from a try-out. Here an admin adds mallory; the shared password must not sign
    her in. The controls: the listed student and the admin still sign in."""
    import requests
    hub, mallory = listed, listed.user("mallory")
    admin = requests.Session()
    admin.get(f"{hub.url}/hub/login", timeout=30)
    r = admin.post(f"{hub.url}/hub/login", data={"username": hub.user("prof"),
                                                 "password": hub.settings["auth"]["admin_password"],
                                                 "_xsrf": admin.cookies.get("_xsrf", "")},
                   allow_redirects=False, timeout=30)
    assert r.status_code == 302, hub.log_tail()
    r = admin.post(f"{hub.url}/hub/api/users/{mallory}", headers={"X-XSRFToken": admin.cookies.get("_xsrf", "")},
                   timeout=30)
    assert r.status_code == 201, (r.status_code, r.text)
    assert _sign_in(hub, "127.0.0.1", mallory, hub.password) == 403
    assert f"The name '{mallory}' is not on this course's class list" in hub.log_path.read_text(errors="replace")
    alice = hub.user("alice")
    assert _sign_in(hub, "127.0.0.1", alice, hub.password_of(alice)) == 302
