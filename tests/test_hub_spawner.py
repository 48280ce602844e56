"""CourseSlurmSpawner against a scripted fake Slurm (sbatch/squeue/scancel/sinfo as small programs).

The fake keeps its jobs in a JSON file, which the spawner's explicit SLURM_CONF points at (the spawner passes
nothing else of the environment to Slurm commands, so this also proves SLURM_CONF is handed over). Each test
moves jobs between states the way Slurm would, or makes Slurm misbehave.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import socket
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from jupyterhub.objects import Hub
from tornado import web
from traitlets.config import Config

from scalelab.hub.slurm_spawner import CourseSlurmSpawner, SpawnFailed

FAKE = textwrap.dedent('''\
    #!{python}
    import fcntl, json, os, sys
    state_path = os.environ["SLURM_CONF"]
    lock = open(state_path + ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until exit: the test changes the same file
    st = json.load(open(state_path))
    cmd = os.path.basename(sys.argv[0])
    st.setdefault("calls", []).append([cmd] + sys.argv[1:])
    def save():  # atomic: the test reads and writes the same file meanwhile
        tmp = state_path + "." + str(os.getpid())
        with open(tmp, "w") as f:
            json.dump(st, f)
        os.replace(tmp, state_path)
    if cmd == "sbatch":
        if st.get("sbatch_error"):
            save(); print(st["sbatch_error"], file=sys.stderr); sys.exit(1)
        jid = str(100 + len(st["jobs"]))
        st["jobs"][jid] = {{"state": st.get("initial", "PENDING"), "script": sys.stdin.read(), "reason": "Resources"}}
        save(); print(jid)
    elif cmd == "squeue":
        jid = sys.argv[sys.argv.index("-j") + 1]
        save()
        if st.get("squeue_delay"):  # answer late, with the state as it was when asked (a slow slurmctld)
            lock.close(); import time; time.sleep(st["squeue_delay"])
        if st.get("squeue_error"):
            print(st["squeue_error"], file=sys.stderr); sys.exit(1)
        job = st["jobs"].get(jid)
        if job is None or job["state"] == "PURGED":
            print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr); sys.exit(1)
        print(job["state"] + "|" + ("node1" if job["state"] != "PENDING" else "n/a") + "|" + job["reason"])
    elif cmd == "scancel":
        st["jobs"][sys.argv[1]]["state"] = "CANCELLED"; save()
    elif cmd == "sinfo":  # sinfo -h -N -O (scalelab.hub.queue.SINFO_FIELDS): one idle node per "partition|gres"
        save(); print("\\n".join("node1|" + p.split("|")[0] + "|up|idle|" + p.split("|")[1] + "|(null)|0/2/0/2|"
                                 for p in st.get("partitions", ["cpu|(null)", "gpu|gpu:2"])))
''')


class FakeSlurm:
    """The fake scheduler's state, and helpers to move its jobs along."""

    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "fakebin"
        self.bin.mkdir()
        for name in ("sbatch", "squeue", "scancel", "sinfo"):
            p = self.bin / name
            p.write_text(FAKE.format(python=sys.executable))
            p.chmod(0o755)
        self.state = tmp_path / "fake-slurm.json"
        self.write({"jobs": {}})

    def read(self) -> dict:
        return json.loads(self.state.read_text())

    def write(self, st: dict) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        tmp.replace(self.state)

    @contextlib.contextmanager
    def locked(self):
        """Hold the fake's lock: a read-modify-write the fake commands cannot interleave with."""
        with open(str(self.state) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def update(self, **kw) -> None:
        with self.locked():
            st = self.read()
            st.update(kw)
            self.write(st)

    def set_job(self, jid: str, **kw) -> None:
        with self.locked():
            st = self.read()
            st["jobs"][jid].update(kw)
            self.write(st)

    def calls(self, cmd: str) -> list[list[str]]:
        return [c for c in self.read().get("calls", []) if c[0] == cmd]


@pytest.fixture
def fake(tmp_path):
    return FakeSlurm(tmp_path)


@pytest.fixture
def spawner(fake, tmp_path):
    c = Config()
    c.CourseSlurmSpawner.queue_cache_s = 0  # every form asks the fake again (each test changes what it says)
    c.CourseSlurmSpawner.slurm_bin_dir = str(fake.bin)
    c.CourseSlurmSpawner.slurm_conf = str(fake.state)
    c.CourseSlurmSpawner.home_template = str(tmp_path / "homes/{username}")
    c.CourseSlurmSpawner.cmd = ["/venv/bin/jupyterhub-singleuser"]
    c.CourseSlurmSpawner.poll_min = 0.05
    c.CourseSlurmSpawner.poll_max = 0.2
    c.CourseSlurmSpawner.http_timeout = 5
    c.CourseSlurmSpawner.profiles = [
        {"name": "cpu-1h", "display_name": "CPU, 1 h", "partition": "cpu", "walltime": "1:00:00",
         "reservation": "class"},
        {"name": "gpu-1h", "display_name": "GPU, 1 h", "partition": "gpu", "walltime": "1:00:00", "gpus_per_node": 1}]
    c.CourseSlurmSpawner.default_profile = "cpu-1h"
    user = SimpleNamespace(name="alice", escaped_name="alice", url="/user/alice/", base_url="/user/alice/")
    sp = CourseSlurmSpawner(config=c, user=user, hub=Hub(), db=mock.MagicMock(), api_token="secret-token",
                            oauth_client_id="jupyterhub-user-alice")
    sp.orm_spawner = None
    return sp


def run(coro):
    return asyncio.run(coro)


def listening_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


async def start_and_drive(spawner, fake, steps):
    """Start the spawner while `steps(jid)` (a coroutine) plays Slurm; return start()'s result or exception."""
    task = asyncio.ensure_future(spawner.start())
    for _ in range(200):
        if fake.read()["jobs"]:
            break
        await asyncio.sleep(0.02)
    jid = next(iter(fake.read()["jobs"]))
    await steps(jid)
    return await asyncio.wait_for(task, 10)


def test_spawn_submits_the_bounded_script_and_returns_the_node(spawner, fake):
    sock, port = listening_port()

    async def steps(jid):
        await asyncio.sleep(0.2)
        fake.set_job(jid, state="RUNNING")
        await asyncio.sleep(0.2)
        spawner.report_port(port)

    async def go():
        await spawner._apply_course_options(spawner, {"profile": "cpu-1h", "walltime": "30"})
        spawner.node_address = "127.0.0.1"
        return await start_and_drive(spawner, fake, steps)

    with sock:
        assert run(go()) == ("127.0.0.1", port)
    script = next(iter(fake.read()["jobs"].values()))["script"]
    assert "#SBATCH --reservation=class" in script and "#SBATCH --time=0:30:00" in script
    assert "#SBATCH --partition=cpu" in script
    assert "exec " in script and "-m scalelab.hub.singleuser /venv/bin/jupyterhub-singleuser" in script
    assert "#SBATCH --output=" + str(spawner.log_dir()) in script
    assert spawner.log_dir().is_dir(), "the log folder exists before the job starts"
    assert all("-t" in c and "all" in c for c in fake.calls("squeue"))


def test_options_out_of_bounds_are_a_400_before_anything_is_submitted(spawner, fake):
    with pytest.raises(web.HTTPError) as e:
        run(spawner._apply_course_options(spawner, {"profile": "cpu-1h", "reservation": "vip"}))
    assert e.value.status_code == 400 and "cannot be set" in e.value.log_message
    with pytest.raises(web.HTTPError):
        run(spawner._apply_course_options(spawner, {"profile": "cpu-1h", "walltime": "9:00:00"}))
    assert fake.calls("sbatch") == []


def test_profiles_on_missing_partitions_are_shown_disabled_and_refused(spawner, fake):
    fake.update(partitions=["cpu|(null)"])
    form = run(spawner._render_form(spawner))
    assert 'value="gpu-1h" disabled' in form
    with pytest.raises(web.HTTPError, match="not available"):
        run(spawner._apply_course_options(spawner, {"profile": "gpu-1h"}))


def test_before_the_account_exists_a_gpu_profile_the_cluster_lacks_is_a_clear_refusal(spawner, fake):
    # At a student's first start the course account does not exist yet: sinfo run as that account (sudo -u) failed,
    # every profile looked available, and a GPU profile the cluster lacks went to sbatch and failed the spawn (a
    # 500). What the cluster offers is now asked as the hub, and a profile whose partition has no such GPUs is
    # disabled in the form and refused with a 400 that says why, before the account or a job is made.
    spawner.run_as, spawner.exec_prefix = "student-accounts", "sudo -E -u {username}"
    spawner.user.name = "sl-no-such-account"
    fake.update(partitions=["cpu|(null)", "gpu|(null)"])  # a gpu partition, but no GPUs in it
    form = run(spawner._render_form(spawner))
    assert 'value="gpu-1h" disabled' in form and "no node of partition &#x27;gpu&#x27; has 1 GPU" in form
    assert 'value="cpu-1h" checked' in form  # the control: the CPU profile is offered
    with pytest.raises(web.HTTPError) as e:
        run(spawner._apply_course_options(spawner, {"profile": "gpu-1h"}))
    assert e.value.status_code == 400
    assert e.value.log_message == ("profile 'gpu-1h' is not available on this cluster (no node of partition 'gpu' "
                                   "has 1 GPU); choose another")
    run(spawner._apply_course_options(spawner, {"profile": "cpu-1h"}))  # the control: accepted
    assert spawner.job_request.profile.name == "cpu-1h"
    assert fake.calls("sinfo") and fake.calls("sbatch") == []
    fake.update(partitions=["cpu|(null)", "gpu|gpu:tesla:2(S:0-1)"])  # with GPUs the profile is given
    run(spawner._apply_course_options(spawner, {"profile": "gpu-1h"}))
    assert spawner.job_request.profile.name == "gpu-1h"


def test_a_job_that_dies_before_reporting_its_port_fails_fast_with_its_log(spawner, fake):
    async def steps(jid):
        fake.set_job(jid, state="RUNNING")
        await asyncio.sleep(0.2)
        log = spawner.log_dir() / f"jupyter-{jid}.log"
        log.write_text("line 1\nModuleNotFoundError: No module named 'jupyterhub'\n")
        fake.set_job(jid, state="FAILED")

    async def go():
        loop_t0 = asyncio.get_running_loop().time()
        with pytest.raises(SpawnFailed) as e:
            await start_and_drive(spawner, fake, steps)
        return e.value, asyncio.get_running_loop().time() - loop_t0

    err, took = run(go())
    assert took < 3, "no waiting for start_timeout"
    assert "ended (FAILED) before its server reported a port" in str(err)
    assert "No module named 'jupyterhub'" in err.jupyterhub_message
    assert spawner.job_id == ""


def test_a_job_that_fails_while_pending_fails_the_spawn(spawner, fake):
    async def steps(jid):
        fake.set_job(jid, state="PURGED")

    with pytest.raises(SpawnFailed, match="before it started running"):
        run(start_and_drive(spawner, fake, steps))


def test_sbatch_refusal_is_shown(spawner, fake):
    fake.update(sbatch_error="sbatch: error: Invalid account or account/partition combination specified")
    with pytest.raises(SpawnFailed, match="Invalid account"):
        run(spawner.start())


def test_squeue_errors_keep_the_server_and_a_vanished_job_stops_it(spawner, fake):
    async def go():
        await spawner.submit_batch_script()
        jid = spawner.job_id
        fake.set_job(jid, state="RUNNING")
        assert await spawner.poll() is None
        fake.update(squeue_error="slurm_load_jobs error: Unexpected message received")
        assert await spawner.poll() is None, "an unknown squeue error must not drop the server"
        assert spawner.job_id == jid
        fake.update(squeue_error="")
        fake.set_job(jid, state="CANCELLED")  # scancel from outside
        assert await spawner.poll() == 1
        assert spawner.job_id == ""

    run(go())


def test_stop_cancels_the_job(spawner, fake):
    async def go():
        await spawner.submit_batch_script()
        fake.set_job(spawner.job_id, state="RUNNING")
        jid = spawner.job_id
        await spawner.stop()
        return jid

    jid = run(go())
    assert fake.calls("scancel") == [["scancel", jid]]
    assert fake.read()["jobs"][jid]["state"] == "CANCELLED"


def test_cancelling_a_pending_spawn_leaves_the_job_for_stop_to_cancel(spawner, fake):
    async def go():
        task = asyncio.ensure_future(spawner.start())
        for _ in range(100):  # the fake sbatch is a Python program: give a busy machine time
            if spawner.job_id and spawner.state_ispending():
                break
            await asyncio.sleep(0.05)
        assert spawner.job_id and spawner.state_ispending()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await spawner.stop()

    run(go())
    assert [j["state"] for j in fake.read()["jobs"].values()] == ["CANCELLED"]


def test_progress_says_the_job_waits_in_the_queue_and_why(spawner, fake):
    async def go():
        await spawner.submit_batch_script()
        await spawner.query_job_status()
        events = []
        async for ev in spawner.progress():
            events.append(ev)
            if len(events) == 1:
                fake.set_job(spawner.job_id, state="RUNNING")
                await spawner.query_job_status()
            else:
                break
        return events

    events = run(go())
    assert "waiting in the queue (reason: Resources)" in events[0]["message"]
    assert "running on node1" in events[1]["message"]


def test_queue_polling_backs_off(spawner, fake):
    async def go():
        task = asyncio.ensure_future(spawner.start())
        await asyncio.sleep(2.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    n = len(fake.calls("squeue"))
    # 0.05 s growing x1.5 up to 0.2 s: ~13 calls in 2 s; a fixed 0.05 s would make ~40
    assert 3 <= n <= 20, n


def test_no_shell_is_ever_used(spawner):
    spawner.batch_cancel_cmd = "touch /tmp/pwned; scancel {job_id}"
    with pytest.raises(RuntimeError, match="no shell"):
        run(spawner.run_command("true"))


def test_slurm_commands_get_only_what_they_need(spawner, fake):
    env = spawner.slurm_env()
    assert set(env) == {"PATH", "LANG", "SLURM_CONF"} and env["SLURM_CONF"] == str(fake.state)
    server_env = spawner.get_env()
    assert server_env["SLURM_CONF"] == str(fake.state), "srun/sbatch work from the notebook"
    assert server_env["HOME"].endswith("/homes/alice")


def test_a_reported_port_ends_the_queue_wait_without_waiting_for_the_next_poll(spawner, fake):
    spawner.poll_min = spawner.poll_max = 30.0  # a wait for the poll tick would outlast start_and_drive's 10 s
    spawner.node_address = "127.0.0.1"
    sock, port = listening_port()

    async def steps(jid):
        fake.set_job(jid, state="RUNNING")
        spawner.report_port(port)

    with sock:
        assert run(start_and_drive(spawner, fake, steps)) == ("127.0.0.1", port)


def test_a_port_reported_while_squeue_answers_is_not_taken_for_a_lagging_squeue(spawner, fake):
    """squeue asked while PENDING answers after the port came: that answer is stale, so ask again at once
    (the full CI run once waited out a whole poll interval here)."""
    spawner.poll_min = spawner.poll_max = 30.0
    spawner.node_address = "127.0.0.1"
    fake.update(squeue_delay=0.5)
    sock, port = listening_port()

    async def steps(jid):
        for _ in range(500):  # until the first squeue is under way (it answers PENDING half a second later)
            if fake.calls("squeue"):
                break
            await asyncio.sleep(0.01)
        assert fake.calls("squeue"), "the spawner never asked squeue"
        fake.set_job(jid, state="RUNNING")
        spawner.report_port(port)

    with sock:
        assert run(start_and_drive(spawner, fake, steps)) == ("127.0.0.1", port)
    assert len(fake.calls("squeue")) >= 2, "the stale PENDING answer was followed by a fresh question"


def test_named_servers_do_not_multiply_the_profile_limits(spawner, fake):
    # Attack: a student with named servers started one GPU server per name, each within its profile, and so held
    # several GPUs (and CPUs) at once. Their total is now held to one student's share: by default what the largest
    # profile needs. Controls: the first GPU server, a second one once the first has stopped, CPU servers beside it.
    fake.update(partitions=["cpu|(null)", "gpu|gpu:tesla:4(S:0-1)"])
    others = {}
    spawner.user.spawners = others

    def running(name, profile):
        others[name] = SimpleNamespace(active=True, pending=None, user_options={"profile": profile})

    run(spawner._apply_course_options(spawner, {"profile": "gpu-1h"}))  # no other server: accepted
    running("first", "gpu-1h")
    with pytest.raises(web.HTTPError) as e:
        run(spawner._apply_course_options(spawner, {"profile": "gpu-1h"}))
    assert e.value.status_code == 400
    assert "would hold 2 CPUs and 2 GPUs; a student may hold 1 CPUs and 1 GPUs at once" in e.value.log_message
    others["first"].active = False  # stopped: its GPU is free again
    run(spawner._apply_course_options(spawner, {"profile": "gpu-1h"}))
    spawner.student_max_cpus = 2   # a course that lets a student keep a CPU server beside a GPU one
    running("gpu", "gpu-1h")
    run(spawner._apply_course_options(spawner, {"profile": "cpu-1h"}))
    assert spawner.job_request.profile.name == "cpu-1h" and fake.calls("sbatch") == []
