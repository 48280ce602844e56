"""End to end against the real single-node Slurm: `scalelab hub --config` in slurm mode, driven over REST.

One hub serves the module. Its class reservation is a one-core reservation made for the module (other jobs on the
shared cluster keep the other cores), and a partition that is DOWN makes jobs wait in the queue on purpose.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from scalelab.testing.hub import HubRunner, class_reservation_and_queue, slurm_settings

pytestmark = [pytest.mark.slurm, pytest.mark.hub, pytest.mark.slow]

LAB = '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}'


@pytest.fixture(scope="module")
def slurm_extras(slurm_cluster):
    with class_reservation_and_queue(slurm_cluster) as names:
        yield names


@pytest.fixture(scope="module")
def hub(tmp_path_factory, slurm_cluster, slurm_extras):
    resv, down = slurm_extras
    work = tmp_path_factory.mktemp("hub-slurm")
    (work / "labs" / "01_intro").mkdir(parents=True)
    (work / "labs" / "01_intro" / "lab.ipynb").write_text(LAB)
    profiles = [
        {"name": "cpu-2h", "display_name": "CPU, 2 h", "partition": "cpu", "cpus_per_task": 1, "memory": "1G",
         "walltime": "2:00:00"},
        {"name": "queued", "display_name": "Always queued", "partition": down, "walltime": "0:10:00"},
        {"name": "broken", "display_name": "Broken prologue", "partition": "cpu", "walltime": "0:10:00",
         "prologue": "echo boom-before-port >&2\nexit 3"},
    ]
    runner = HubRunner(work, mode="slurm", settings=slurm_settings(slurm_cluster, resv, profiles))
    runner.start()
    yield runner
    runner.cleanup()


def wait_no_jobs(hub, name_part: str, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not [j for j in hub.jobs() if name_part in j["name"]]:
            return
        time.sleep(0.5)
    raise AssertionError(f"jobs of {name_part} still in squeue: {hub.jobs()}")


def test_rest_spawn_runs_a_job_with_the_profile_then_stop_removes_it(hub, slurm_extras):
    resv, _ = slurm_extras
    alice = hub.login("alice")
    r = alice.spawn(options={"profile": "cpu-2h", "walltime": "0:30:00"})
    assert r.status_code in (201, 202), r.text
    alice.wait_ready(timeout=60)
    [job] = [j for j in hub.jobs() if j["name"] == f"jupyter-{alice.name}"]
    assert job["state"] == "RUNNING"
    assert (job["partition"], job["reservation"], job["cpus"], job["memory"], job["timelimit"]) == \
        ("cpu", resv, "1", "1G", "30:00")
    status = alice.get(f"/user/{alice.name}/api/status")
    assert status.status_code == 200 and "started" in status.json()
    labs = alice.get(f"/user/{alice.name}/api/contents/labs/01_intro")
    assert [c["name"] for c in labs.json()["content"]] == ["lab.ipynb"], "the labs were handed out"
    assert alice.stop().status_code in (202, 204)
    alice.wait_gone()
    wait_no_jobs(hub, alice.name)


def test_named_server_is_its_own_job(hub):
    bob = hub.login("bob")
    assert bob.spawn("exp-1", {"profile": "cpu-2h"}).status_code in (201, 202)
    bob.wait_ready("exp-1", timeout=60)  # as the spawn page waits: the progress stream ends "ready"
    assert bob.server_model("exp-1")["ready"]
    assert [j["name"] for j in hub.jobs() if bob.name in j["name"]] == [f"jupyter-{bob.name}-exp-1"]
    assert bob.get(f"/user/{bob.name}/exp-1/api/status").status_code == 200
    assert bob.server_model("") is None, "the default server was not started"
    bob.stop("exp-1")
    bob.wait_gone("exp-1")
    wait_no_jobs(hub, bob.name)


def test_pending_job_shows_queue_progress_and_cancel_removes_it(hub):
    carol = hub.login("carol")
    assert carol.spawn(options={"profile": "queued"}).status_code == 202
    messages = []
    for event in carol.progress(timeout=30):
        messages.append(event.get("message", ""))
        if "waiting in the queue" in messages[-1]:
            break
    assert any("waiting in the queue (reason: PartitionDown)" in m for m in messages), messages
    [job] = [j for j in hub.jobs() if carol.name in j["name"]]
    assert job["state"] == "PENDING"
    assert carol.stop().status_code in (202, 204)
    carol.wait_gone(timeout=30)
    wait_no_jobs(hub, carol.name)


def test_a_job_that_dies_before_its_port_fails_the_spawn_promptly_with_its_log(hub):
    dan = hub.login("dan")
    t0 = time.monotonic()
    r = dan.spawn(options={"profile": "broken"})
    for _ in range(150):
        if dan.server_model() is None:
            break
        time.sleep(0.2)
    took = time.monotonic() - t0
    assert dan.server_model() is None, "the failed spawn is not left pending"
    assert took < 20, f"took {took:.1f} s: the hub waited instead of noticing the job's end"
    message = r.text if r.status_code >= 400 else dan.last_progress()
    assert "boom-before-port" in message and "ended" in message, message
    wait_no_jobs(hub, dan.name)


def test_scancel_from_outside_is_noticed_and_the_server_marked_stopped(hub):
    erin = hub.login("erin")
    erin.spawn(options={"profile": "cpu-2h"})
    erin.wait_ready(timeout=60)
    [job] = [j for j in hub.jobs() if erin.name in j["name"]]
    subprocess.run(["scancel", job["id"]], env=hub.slurm_env(), check=True)
    took = erin.wait_gone(timeout=30)
    assert took < 30
    assert erin.get(f"/user/{erin.name}/api/status").status_code != 200


def test_hub_restart_keeps_a_running_server_reachable(hub):
    fay = hub.login("fay")
    fay.spawn(options={"profile": "cpu-2h"})
    fay.wait_ready(timeout=60)
    [before] = [j["id"] for j in hub.jobs() if fay.name in j["name"]]
    hub.stop()
    assert [j["id"] for j in hub.jobs() if fay.name in j["name"]] == [before], "the job outlives the hub"
    hub.start()
    fay.wait_ready(timeout=30)
    assert fay.get(f"/user/{fay.name}/api/status").status_code == 200
    assert [j["id"] for j in hub.jobs() if fay.name in j["name"]] == [before]
    fay.stop()
    fay.wait_gone()
    wait_no_jobs(hub, fay.name)


def test_the_spawn_form_offers_the_profiles_and_starts_the_chosen_one(hub):
    gus = hub.login("gus")
    page = gus.session.get(f"{hub.url}/hub/spawn", timeout=30)
    assert page.status_code == 200
    for name in ("cpu-2h", "queued", "broken"):
        assert f'value="{name}"' in page.text
    xsrf = gus.session.cookies.get("_xsrf", path="/hub/")
    r = gus.session.post(f"{hub.url}/hub/spawn/{gus.name}", timeout=60, allow_redirects=False,
                         data={"profile": "cpu-2h", "walltime": "0:30:00", "_xsrf": xsrf})
    assert r.status_code == 302, r.text[:500]
    gus.wait_ready(timeout=60)
    [job] = [j for j in hub.jobs() if gus.name in j["name"]]
    assert (job["partition"], job["timelimit"]) == ("cpu", "30:00")
    gus.stop()
    gus.wait_gone()
    wait_no_jobs(hub, gus.name)
