"""Security, end to end on the real single-node Slurm: what a student (or anyone) can and cannot make the hub do.

- the batchspawner callback accepts a port and nothing else, even from the server's own token (which a student
  can read inside their job) — upstream it sets any spawner attribute, e.g. the shell command run to cancel jobs;
- user options beyond the profile bounds are refused before anything is submitted;
- a user cannot reach, stop or start another user's server; without credentials there is no server at all.
"""
from __future__ import annotations

import subprocess
import time

import psutil
import pytest
import requests

from scalelab.testing.hub import HubRunner, class_reservation_and_queue, slurm_settings

pytestmark = [pytest.mark.slurm, pytest.mark.hub, pytest.mark.slow]


@pytest.fixture(scope="module")
def resv(slurm_cluster):
    with class_reservation_and_queue(slurm_cluster) as (reservation, _):
        yield reservation


@pytest.fixture(scope="module")
def hub(tmp_path_factory, slurm_cluster, resv):
    profiles = [{"name": "cpu-1h", "display_name": "CPU, 1 h", "partition": "cpu", "cpus_per_task": 1,
                 "memory": "1G", "walltime": "1:00:00"}]
    runner = HubRunner(tmp_path_factory.mktemp("hub-sec"), mode="slurm",
                       settings=slurm_settings(slurm_cluster, resv, profiles))
    runner.start()
    yield runner
    runner.cleanup()


@pytest.fixture(scope="module")
def running(hub):
    """A user with a running server, and that server's own API token as the job sees it."""
    user = hub.login("victim")
    user.spawn(options={"profile": "cpu-1h"})
    user.wait_ready(timeout=60)
    token = None
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("JUPYTERHUB_USER") == user.name and f":{hub.hub_port}/" in env.get("JUPYTERHUB_API_URL", ""):
            token = env["JUPYTERHUB_API_TOKEN"]
    assert token, "the server process and its token were not found"
    return user, token


def port_call(hub, token, body, raw=None):
    headers = {"Authorization": f"token {token}"} if token else {}
    return requests.post(f"{hub.url}/hub/api/batchspawner", headers=headers, timeout=30,
                         **({"data": raw} if raw is not None else {"json": body}))


def test_port_callback_refuses_everything_but_a_port(hub, running, tmp_path):
    user, server_token = running
    marker = tmp_path / "pwned"
    url_before = user.server_model()["url"]
    attacks = [
        {"port": 1234, "batch_cancel_cmd": f"touch {marker}"},
        {"batch_cancel_cmd": f"touch {marker}"},
        {"exec_prefix": f"touch {marker};", "port": 1},
        {"port": "1234"}, {"port": True}, {"port": 70000}, {"port": [1]},
    ]
    for body in attacks:
        r = port_call(hub, server_token, body)
        assert r.status_code == 400, (body, r.status_code, r.text)
    assert port_call(hub, server_token, None, raw="not json").status_code == 400
    # well-formed, but the server is not starting: nothing to set
    assert port_call(hub, server_token, {"port": 1234}).status_code == 409
    # not a server's token / no token at all
    assert port_call(hub, user.token, {"port": 1234}).status_code == 403
    assert port_call(hub, None, {"port": 1234}).status_code == 403
    assert user.server_model()["url"] == url_before, "the server's address did not change"
    assert user.get(f"/user/{user.name}/api/status").status_code == 200
    [job] = [j for j in hub.jobs() if user.name in j["name"]]
    user.stop()
    user.wait_gone()
    time.sleep(1)
    assert not marker.exists(), "no injected command ran at stop"
    assert job["id"] not in [j["id"] for j in hub.jobs() if j["state"] == "RUNNING"], "the real scancel ran"
    user.spawn(options={"profile": "cpu-1h"})  # leave it running for the other tests
    user.wait_ready(timeout=60)


@pytest.mark.parametrize("options, why", [
    ({"profile": "cpu-1h", "walltime": "9:00:00"}, "longer than"),
    ({"profile": "cpu-1h", "reservation": "someone-elses"}, "cannot be set"),
    ({"profile": "cpu-1h", "gpus_per_node": 4, "req_gres": "gpu:4"}, "cannot be set"),
    ({"profile": "cpu-1h", "options": "--exclusive\n#SBATCH --qos=high"}, "cannot be set"),
    ({"profile": "cpu-1h", "walltime": "0:10:00\n#SBATCH --exclusive"}, "not a duration"),
    ({"profile": "gpu-huge"}, "does not exist"),
])
def test_options_beyond_the_bounds_are_refused_and_nothing_is_submitted(hub, options, why):
    user = hub.login("greedy")
    r = user.spawn(options=options)
    assert r.status_code == 400 and why in r.json()["message"], (r.status_code, r.text)
    assert user.server_model() is None
    assert [j for j in hub.jobs() if user.name in j["name"]] == []


def test_the_batch_script_holds_only_the_profile_and_the_class_reservation(hub, slurm_cluster, resv):
    user = hub.login("honest")
    assert user.spawn(options={"profile": "cpu-1h", "walltime": "20"}).status_code in (201, 202)
    user.wait_ready(timeout=60)
    [job] = [j for j in hub.jobs() if user.name in j["name"]]
    script = slurm_cluster.run("scontrol", "write", "batch_script", job["id"], "-").stdout
    directives = sorted(line.split("=")[0] for line in script.splitlines() if line.startswith("#SBATCH"))
    assert directives == sorted(["#SBATCH --job-name", "#SBATCH --output", "#SBATCH --chdir", "#SBATCH --export",
                                 "#SBATCH --partition", "#SBATCH --nodes", "#SBATCH --ntasks-per-node",
                                 "#SBATCH --cpus-per-task", "#SBATCH --time", "#SBATCH --mem",
                                 "#SBATCH --reservation", "#SBATCH --signal"])
    assert f"#SBATCH --reservation={resv}" in script and "#SBATCH --time=0:20:00" in script
    assert "#SBATCH --signal=B:USR1@120\n" in script  # the walltime warning signal (slurm.walltime.signal_s)
    user.stop()
    user.wait_gone()


def test_a_user_cannot_reach_stop_or_start_another_users_server(hub, running):
    victim, _ = running
    other = hub.login("mallory")
    assert other.get(f"/user/{victim.name}/api/status").status_code == 403
    assert other.get(f"/user/{victim.name}/api/contents").status_code == 403
    # the browser way: mallory's hub login cookie, following redirects through the OAuth handshake
    r = other.session.get(f"{hub.url}/user/{victim.name}/api/contents", timeout=30)
    assert r.status_code == 403
    assert other.api("DELETE", f"/users/{victim.name}/server").status_code in (403, 404)
    assert other.api("POST", f"/users/{victim.name}/servers/evil").status_code in (403, 404)
    assert victim.server_model()["ready"], "the victim's server is untouched"


def test_no_credentials_no_server(hub, running):
    victim, _ = running
    r = requests.get(f"{hub.url}/user/{victim.name}/api/contents", timeout=30, allow_redirects=False)
    assert r.status_code in (302, 403) and "content" not in r.text
    if r.status_code == 302:
        assert "/hub/" in r.headers["location"]
    r = requests.get(f"{hub.url}/user/{victim.name}/api/contents", timeout=30)  # following redirects
    assert r.status_code == 403 or "/hub/login" in r.url, (r.status_code, r.url)
    assert '"content"' not in r.text
    nobody = hub.user("nobody")
    assert requests.post(f"{hub.url}/hub/api/users/{nobody}/server", timeout=30).status_code == 403
    assert requests.post(f"{hub.url}/hub/api/users/{nobody}/server", timeout=30,
                         headers={"Authorization": "token not-a-token"}).status_code == 403
    r = requests.post(f"{hub.url}/hub/login", data={"username": nobody, "password": "wrong-password"},
                      timeout=30, allow_redirects=False)
    assert r.status_code in (403, 200) and r.status_code != 302
    assert [j for j in hub.jobs() if nobody in j["name"]] == []
    out = subprocess.run(["squeue", "-h", "-o", "%j"], env=hub.slurm_env(), capture_output=True, text=True).stdout
    assert nobody not in out
