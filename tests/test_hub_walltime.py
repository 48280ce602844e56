"""Walltime (issue 36 item 3): a student's server job shows its time left in JupyterLab and warns before the end; at
the job's end signal the runs the server started take their emergency checkpoint; the next server offers to resume
them, and the resumed run continues from the checkpoint's step.

The first tests need no hub: the batch script's signal line, the squeue answer, the committed JupyterLab bundle
against its source, and the server's signal forwarding on real runs of this process (`EndSignals` is what the server
runs on SIGUSR1) with the resume offer over them. The rest run on the real local hub and Slurm, in one job of a
2-minute profile whose life the tests follow in file order: the countdown and the warning (the endpoint, the
extension loaded in JupyterLab, headless Chromium), the attacks (a classmate reading the countdown or signalling
the run), the end (Slurm's --signal=B:USR1 reaches the server, which passes it on: the run folder holds an emergency
checkpoint at the step the run reached), and the resume in a new server.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

from scalelab.hub import walltime
from scalelab.hub.batch import render_batch_script
from scalelab.hub.options import JobRequest, Profile
from scalelab.launch import launch
from scalelab.train import preempt

from helpers import tiny

STEPS = 60
SLOW = {"fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.05}


def _events(run_dir: Path, rank: int = 0) -> list[dict]:
    path = Path(run_dir) / "events" / f"rank-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (Path(run_dir) / "events" / "rank-0.jsonl").exists() and \
                any(e["type"] == "step" and e["step"] >= step for e in _events(run_dir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{run_dir} did not reach step {step} in {timeout} s")


# -- without a hub -----------------------------------------------------------------------------------------------------

def test_the_batch_script_asks_slurm_for_the_warning_signal_to_the_server_only_when_set():
    request = JobRequest(profile=Profile(name="p", display_name="P", partition="cpu", walltime="0:30:00"), seconds=1800)
    common = dict(username="ann", job_name="jupyter-ann", log_path="/h/ann/%j.log", workdir="/h/ann",
                  export_vars=["PATH"], cmd=["/venv/bin/python", "-m", "scalelab.hub.singleuser", "x"])
    assert "#SBATCH --signal=B:USR1@120\n" in render_batch_script(request, **common, signal_s=120)
    assert "#SBATCH --signal" not in render_batch_script(request, **common, signal_s=0)


def _settings(tmp_path, walltime_yaml: str):
    from scalelab.hub.settings import load_settings
    (tmp_path / "labs" / "01_x").mkdir(parents=True)
    p = tmp_path / "c.yaml"
    p.write_text(f"mode: slurm\nhub:\n  state_dir: {tmp_path / 'state'}\nlabs:\n  source: {tmp_path / 'labs'}\n"
                 "servers:\n  run_as: hub-account\n  allow_root_servers: true\nauth:\n  any_name: true\n"
                 f"slurm:\n  walltime:\n{walltime_yaml}")
    return load_settings(p)


def test_the_course_walltime_settings_reach_the_spawner_and_a_bad_one_is_refused_by_name(tmp_path):
    from traitlets.config import Config
    from scalelab.errors import ScalelabError
    from scalelab.hub.config import update_slurm_spawner
    c = Config()
    update_slurm_spawner(c, _settings(tmp_path / "ok", "    warn_s: 300\n    signal_s: 45\n"))
    s = c.CourseSlurmSpawner
    assert (s.walltime_warn_s, s.walltime_signal_s, s.walltime_refresh_s, s.walltime_grace_s) == (300, 45, 30, 25)
    with pytest.raises(ScalelabError, match="warn_s"):
        _settings(tmp_path / "bad", "    warn_s: -5\n")


@pytest.mark.parametrize("text, seconds", [("1-02:03:04", 93784), ("2:03:04", 7384), ("3:04", 184), ("59", 59),
                                           ("UNLIMITED", None), ("NOT_SET", None), ("INVALID", None), ("", None)])
def test_squeue_time_left_is_read_as_seconds(text, seconds):
    assert walltime.parse_time_left(text) == seconds


@pytest.mark.parametrize("cmdline, spec", [
    (["/venv/bin/python", "-m", "scalelab.train.worker", "--spec", "/h/r/spec.json", "--log-dir", "/h/r/logs"],
     "/h/r/spec.json"),
    (["/usr/bin/srun", "--nodes=2", "--overlap", "/venv/bin/python", "-m", "scalelab.train.worker", "--spec",
      "/h/r/spec.json"], "/h/r/spec.json"),
    # torchrun's agent dies of SIGUSR1; its ranks are signalled themselves
    (["/venv/bin/python", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "scalelab.train.worker",
      "--spec", "/h/r/spec.json"], None),
    (["/venv/bin/python", "/venv/bin/horovodrun", "-np", "2", "python", "-m", "scalelab.train.worker", "--spec",
      "/h/r/spec.json"], None),
    (["/venv/bin/python", "-m", "ipykernel_launcher", "-f", "k.json"], None),
    (["/venv/bin/python", "-c", "import x", "-m", "scalelab.train.worker", "--spec", "/h/r/spec.json"], None),
])
def test_the_server_signals_ranks_and_launchers_that_pass_the_signal_on_and_nothing_else(cmdline, spec):
    assert walltime.worker_spec_path(cmdline) == (Path(spec) if spec else None)


def test_the_committed_jupyterlab_bundle_was_built_from_the_committed_source():
    # build.sh stamps the bundle with the source's SHA-256: a source changed without a rebuild fails here
    meta = json.loads((walltime.LAB_BUNDLE / "package.json").read_text())
    assert meta["name"] == "scalelab-walltime" and (walltime.LAB_BUNDLE / meta["jupyterlab"]["_build"]["load"]).is_file()
    assert walltime.bundle_is_current(), ("scalelab/hub/walltime_lab changed since the bundle was built: run "
                                          "`bash scalelab/hub/walltime_lab/build.sh` and commit the bundle")
    assert preempt.WALLTIME_REGISTRY == walltime.REGISTRY  # the server writes where the offer reads
    from scalelab.hub import singleuser
    assert singleuser.EARLY_SIGNAL_ENV == walltime.EARLY_SIGNAL_ENV  # singleuser imports nothing of scalelab


def test_the_end_signal_reaches_protected_runs_only_and_the_offer_resumes_from_the_checkpoint(tmp_path):
    """What the server does on SIGUSR1, done by this process for the runs it started: the protected run saves and
    stops at the step it reached, the unprotected one is not signalled; the offer lists the first and resumes it."""
    protected = launch(tiny(tmp_path, "saved", workers=1, steps=STEPS, log_every=1,
                            **{"checkpoint.on_signal": True, **SLOW}))
    unprotected = launch(tiny(tmp_path, "plain", workers=1, steps=400, **SLOW))
    try:
        _wait_step(protected.run_dir, 3)
        _wait_step(unprotected.run_dir, 1)
        runs = walltime.server_runs()
        assert {protected.run_dir, unprotected.run_dir} <= set(runs)
        assert runs[protected.run_dir]["on_signal"] and not runs[unprotected.run_dir]["on_signal"]
        home = tmp_path / "home"
        ends = walltime.EndSignals(logging.getLogger("test"), "4242", home=home)
        signalled = ends.forward("SIGUSR1")
        assert list(signalled) == [protected.run_dir]
        assert ends.wait_signalled(60)
        summary = protected.wait(timeout=60)
        assert summary["status"] == "preempted"
        assert unprotected.status == "running", "a run without checkpoint.on_signal was signalled (SIGUSR1 kills it)"
    finally:
        unprotected.stop()
        protected.stop()
    [stop] = [e for e in _events(protected.run_dir) if e["type"] == "preempted"]
    reached = max(e["step"] for e in _events(protected.run_dir) if e["type"] == "step")
    assert stop["signal"] == "SIGUSR1" and stop["step"] == reached
    note = json.loads((protected.run_dir / "walltime.json").read_text())
    assert (note["job_id"], note["signal"]) == ("4242", "SIGUSR1")

    from scalelab.widgets import ResumeOffer
    offer = ResumeOffer(home=home)
    assert [(r.run_dir, r.step, r.job_id) for r in offer.runs] == [(protected.run_dir, reached, "4242")]
    assert offer.runs[0].checkpoint.endswith(f"step-{reached:08d}.pt") and Path(offer.runs[0].checkpoint).is_file()
    assert "4242" in offer.view.value and f"{reached} of {STEPS}" in offer.view.value
    resumed = offer.resume(0)
    resumed.wait(timeout=120)
    start = [e for e in _events(resumed.run_dir) if e["type"] == "start"][-1]
    assert start["start_step"] == reached and start["resumed_from"].endswith(f"step-{reached:08d}.pt")
    assert [e for e in _events(resumed.run_dir) if e["type"] == "end"][-1]["steps"] == STEPS
    assert offer.refresh() == [], "a run that went on is offered no more"
    with pytest.raises(IndexError, match="0 interrupted run"):
        offer.resume(0)


STAND_IN_SERVER = """
import logging, os, sys, time
from pathlib import Path
from scalelab.hub.walltime import EndSignals
from scalelab.launch import launch
from scalelab.run.spec import preset
spec = preset("tiny").replace(output_dir=sys.argv[1]).with_overrides({
    "world.workers_per_node": 1, "steps": 400, "log_every": 1, "checkpoint.on_signal": True,
    "fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.05})
run = launch(spec)
ends = EndSignals(logging.getLogger("stand-in"), "77", grace_s=60, home=Path(sys.argv[2]))
ends.install(lambda *_: (print("stopping", time.time(), flush=True), os._exit(0)))
while True:
    time.sleep(0.1)
"""


def test_at_the_final_sigterm_the_server_stops_only_once_its_runs_have_saved(tmp_path):
    """The job's end without a warning signal (signal_s 0, or a stop): SIGTERM to the server, which passes SIGUSR1 on
    and waits for the run's ranks before it stops (when the batch shell exits, Slurm kills the rest of the job)."""
    import sys
    run_dir = tmp_path / "run"
    server = subprocess.Popen([sys.executable, "-c", STAND_IN_SERVER, str(run_dir), str(tmp_path / "home")],
                              stdout=subprocess.PIPE, text=True)
    try:
        _wait_step(run_dir, 3)
        server.send_signal(15)
        out, _ = server.communicate(timeout=90)
    finally:
        server.kill()
    stopped = float(out.split("stopping")[1].split()[0])
    [stop] = [e for e in _events(run_dir) if e["type"] == "preempted"]
    assert stop["signal"] == "SIGUSR1" and stop["t"] < stopped, (stop, stopped)
    assert json.loads((run_dir / "walltime.json").read_text())["signal"] == "SIGTERM"


# -- on the real hub and Slurm: one 2-minute server job, followed from start to end ------------------------------------

WALL = {"warn_s": 60, "signal_s": 30, "refresh_s": 5, "stop_grace_s": 10}
"""Slurm sends --signal=B:USR1@30 between 30 and 60 s before the end (it checks every 30 s): 60-90 s into the
2-minute job; the warning comes at 60 s left. The run's first attempt takes at least 100 s (200 steps, 0.5 s
each), so it is still training then; the resumed one has no slowness (faults fire in a first attempt only)."""
RUN_CELL = """
import json, os
from scalelab import launch, preset
spec = preset("tiny").replace(output_dir=os.path.expanduser("~/runs/wt")).with_overrides({
    "world.workers_per_node": 1, "steps": 200, "log_every": 1, "checkpoint.on_signal": True,
    "fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.5})
run = launch(spec)
import time
deadline = time.time() + 90
while time.time() < deadline and not [e for e in run.events() if e["type"] == "step"]:
    time.sleep(0.2)
pids = [p.pid for p in run.procs]
print(json.dumps({"run_dir": str(run.run_dir), "pids": pids, "status": run.status}))
"""
RESUME_CELL = """
import json
from scalelab.widgets import ResumeOffer
offer = ResumeOffer()
listed = [[str(r.run_dir), r.step, r.checkpoint, r.job_id, r.signal] for r in offer.runs]
run = offer.resume()
summary = run.wait(timeout=240)
print(json.dumps({"listed": listed, "status": summary["status"], "after": len(offer.refresh())}))
"""


def as_student(name: str, *argv: str) -> subprocess.CompletedProcess:
    """Run `argv` as the student's Unix account, as code in their notebook would."""
    return subprocess.run(["runuser", "-u", name, "--", *argv], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def open_dir():
    """A folder course accounts may traverse (pytest's tmp folders are root-only)."""
    d = Path(tempfile.mkdtemp(prefix="hubwall-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def hub(open_dir, slurm_cluster):
    if os.geteuid() != 0:  # under CI=true a missing part fails (tests/conftest.py): so does this
        ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
        (pytest.fail if ci else pytest.skip)("needs root: the hub creates course accounts (the attacks run as a "
                                             "classmate's own account)")
    from scalelab.testing.hub import HubRunner, slurm_settings
    profiles = [{"name": "short", "display_name": "2 min", "partition": "cpu", "cpus_per_task": 1, "memory": "1G",
                 "walltime": "0:02:00"},
                {"name": "cpu-10m", "display_name": "10 min", "partition": "cpu", "cpus_per_task": 1,
                 "memory": "1G", "walltime": "0:10:00"}]
    settings = slurm_settings(slurm_cluster, "", profiles, walltime=WALL)
    runner = HubRunner(open_dir / "slurm", mode="slurm", accounts=["alice", "bob"], settings=settings)
    os.chmod(runner.workdir, 0o755)
    runner.start()
    yield runner
    runner.cleanup()


@pytest.fixture(scope="module")
def job(hub):
    """alice's server in a 2-minute job, with a protected run (checkpoint.on_signal) training in it."""
    alice, slurm_job = hub.spawned("alice", "short", timeout=120)
    started = json.loads(alice.run_cell(RUN_CELL, timeout=120, keep_kernel=True).strip().splitlines()[-1])
    assert started["status"] == "running" and started["pids"], started
    return {"user": alice, "job_id": slurm_job["id"], **started}


@pytest.fixture(scope="module")
def ended(hub, job):
    """Wait for the end of alice's job (its time limit), then her run's rank-0 events."""
    alice, deadline = job["user"], time.monotonic() + 240
    while [j for j in hub.jobs() if j["id"] == job["job_id"]] and time.monotonic() < deadline:
        time.sleep(1)
    assert not [j for j in hub.jobs() if j["id"] == job["job_id"]], f"job {job['job_id']} outlived its 2 minutes"
    alice.wait_gone(timeout=60)
    return _events(Path(job["run_dir"]))


def walltime_of(user, owner: str | None = None) -> requests.Response:
    return user.get(f"/user/{owner or user.name}/scalelab/walltime")


@pytest.mark.slurm
def test_the_countdown_follows_the_job_and_warns_at_the_threshold(hub, job):
    alice = job["user"]
    page = alice.get(f"/user/{alice.name}/lab")
    assert page.status_code == 200 and '"name": "scalelab-walltime"' in page.text, "JupyterLab lists the extension"
    readings, deadline = [], time.monotonic() + 100
    while time.monotonic() < deadline:
        r = walltime_of(alice)
        assert r.status_code == 200, r.text
        info = r.json()
        readings.append(info)
        assert info["job_id"] == job["job_id"] and info["limited"] and 0 <= info["left_s"] <= 120, info
        assert info["warn"] == (info["left_s"] <= WALL["warn_s"]) and info["warn_s"] == WALL["warn_s"], info
        if info["warn"]:
            break
        time.sleep(2)
    assert not readings[0]["warn"], f"the first reading, {readings[0]['left_s']} s left, already warned"
    assert readings[-1]["warn"], "no warning within 100 s of a 2-minute job"
    assert readings[-1]["runs_protected"] == 1 and "1 run(s) with checkpoint.on_signal" in readings[-1]["warning"]
    lefts = [i["left_s"] for i in readings]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] > lefts[-1], lefts


@pytest.mark.slurm
@pytest.mark.browser
def test_jupyterlab_shows_the_countdown_in_its_status_bar_and_the_warning(hub, job):
    from browser import signed_in_page
    alice = job["user"]
    with signed_in_page(hub.url, alice.name, hub.password_of(alice.name), timeout_ms=30_000) as page:
        page.goto(f"{hub.url}/user/{alice.name}/lab")
        item = page.locator(".scalelab-walltime")
        item.wait_for(timeout=90_000)
        page.wait_for_function("document.querySelector('.scalelab-walltime').textContent.includes('left')",
                               timeout=30_000)
        text = item.inner_text()
        assert text.startswith(f"Job {job['job_id']}: ") and text.endswith(" left"), text
        page.get_by_text("save your notebooks").first.wait_for(timeout=90_000)  # the warning, at 60 s left


@pytest.mark.slurm
def test_a_classmate_cannot_read_the_countdown_nor_signal_the_run(hub, job):
    alice = job["user"]
    bob = hub.login("bob")
    assert bob.spawn(options={"profile": "cpu-10m"}).status_code in (201, 202)
    bob.wait_ready(timeout=120)
    try:
        assert walltime_of(bob).status_code == 200  # the control: his own
        assert walltime_of(bob, alice.name).status_code == 403, "bob read alice's countdown"
        anonymous = requests.get(f"{hub.url}/user/{alice.name}/scalelab/walltime", timeout=30,
                                 allow_redirects=False)
        assert anonymous.status_code in (302, 403) and "left_s" not in anonymous.text
        # from bob's own account (his notebook's): a signal to alice's rank, and Slurm's signal to her job
        rank = str(job["pids"][0])
        kill = as_student(bob.name, "kill", "-USR1", rank)
        assert kill.returncode != 0 and "not permitted" in kill.stderr, kill
        env = [f"{k}={v}" for k, v in hub.slurm_env().items() if k in ("SLURM_CONF", "PATH")]
        scancel = as_student(bob.name, "env", *env, "scancel", "--signal=USR1", "--batch", job["job_id"])
        assert scancel.returncode != 0, scancel
        [own] = [j["id"] for j in hub.jobs() if j["name"] == f"jupyter-{bob.name}"]
        control = as_student(bob.name, "env", *env, "scancel", "--signal=USR1", "--batch", own)
        assert control.returncode == 0, control  # the same command on his own job works (his server notes it)
    finally:
        bob.stop()
        bob.wait_gone(timeout=60)


@pytest.mark.slurm
def test_at_the_walltime_the_run_saves_an_emergency_checkpoint_at_the_step_it_reached(hub, job, ended):
    from scalelab.ckpt import read_manifest
    run_dir = Path(job["run_dir"])
    [stop] = [e for e in ended if e["type"] == "preempted"]
    reached = max(e["step"] for e in ended if e["type"] == "step")
    assert stop["signal"] == "SIGUSR1" and stop["step"] == reached and reached < 200, stop
    assert read_manifest(run_dir / "checkpoints")[-1]["step"] == reached
    note = json.loads((run_dir / "walltime.json").read_text())
    assert (note["job_id"], note["signal"]) == (job["job_id"], "SIGUSR1"), note  # Slurm's warning, passed on
    job_end = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job["job_id"], "-o", "State,End"], text=True,
                             capture_output=True, env=hub.slurm_env(), timeout=30).stdout.strip()
    assert job_end.startswith("TIMEOUT"), job_end


@pytest.mark.slurm
def test_the_next_server_offers_to_resume_the_run_and_it_continues_from_the_checkpoint(hub, job, ended):
    alice = job["user"]
    [stop] = [e for e in ended if e["type"] == "preempted"]
    assert alice.spawn(options={"profile": "cpu-10m"}).status_code in (201, 202)
    alice.wait_ready(timeout=120)
    try:
        out = json.loads(alice.run_cell(RESUME_CELL, timeout=300).strip().splitlines()[-1])
    finally:
        alice.stop()
    [listed] = out["listed"]
    assert listed[0] == job["run_dir"] and listed[1] == stop["step"] and listed[3:] == [job["job_id"], "SIGUSR1"]
    assert listed[2].endswith(f"step-{stop['step']:08d}.pt")
    assert out["status"] == "succeeded" and out["after"] == 0, out
    after = _events(Path(job["run_dir"]))
    start = [e for e in after if e["type"] == "start"][-1]
    assert start["start_step"] == stop["step"] and start["resumed_from"].endswith(f"step-{stop['step']:08d}.pt")
    assert [e for e in after if e["type"] == "end"][-1]["steps"] == 200
