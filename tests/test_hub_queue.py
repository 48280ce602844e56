"""Queue truth at spawn (issue 36, item 1), against the real local Slurm and a real hub in slurm mode.

The spawn form shows, per profile, what its partition and its reservation have free now (one cached sinfo for a
burst of renders); a pending server's progress says its place among the pending jobs of its partition and Slurm's
expected start, refreshed as the hub polls, and cancel still works. Attack tests: another student's job ids, names
and users never appear; a partition and a reservation named with <script> (made on the real cluster) are escaped;
a failing sinfo reads as "unknown" and the form still renders.
"""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from scalelab.testing.hub import HubRunner, class_reservation_and_queue, slurm_settings

pytestmark = [pytest.mark.slurm, pytest.mark.hub, pytest.mark.slow]

CACHE_S = 8.0
"""The hub's slurm.queue_cache_s here: long enough that a burst of renders on a loaded machine fits in it."""
EVIL_PARTITION = "q<script>x"
EVIL_RESERVATION = "r<script>y"
SLURM_TOOLS = ("sbatch", "squeue", "scancel", "scontrol", "srun", "salloc", "sacct", "sacctmgr")


@pytest.fixture(scope="module")
def evil_names(slurm_cluster):
    """A partition and a reservation whose names carry markup, made on the real cluster (the partition DOWN, the
    reservation for tomorrow, so no job of the shared cluster is touched)."""
    node = slurm_cluster.status()["nodes"][0]["name"]
    slurm_cluster.run("scontrol", "create", f"PartitionName={EVIL_PARTITION}", f"Nodes={node}", "State=DOWN")
    slurm_cluster.run("scontrol", "create", "reservation", f"ReservationName={EVIL_RESERVATION}", "Users=root",
                      "StartTime=now+1days", "Duration=10", f"Nodes={node}", "CoreCnt=1", "Flags=IGNORE_JOBS")
    try:
        yield EVIL_PARTITION, EVIL_RESERVATION
    finally:
        slurm_cluster.run("scontrol", "delete", f"ReservationName={EVIL_RESERVATION}", check=False)
        slurm_cluster.run("scontrol", "delete", f"PartitionName={EVIL_PARTITION}", check=False)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, slurm_cluster, evil_names):
    """A slurm-mode hub whose sinfo is the real one behind a wrapper that counts its calls."""
    work = tmp_path_factory.mktemp("hub-queue")
    bin_dir = work / "slurm-bin"
    bin_dir.mkdir()
    count = work / "sinfo-calls"
    for tool in SLURM_TOOLS:
        if Path("/usr/bin", tool).exists():
            (bin_dir / tool).symlink_to(Path("/usr/bin", tool))
    (bin_dir / "sinfo").write_text(f'#!/bin/sh\necho "$(date +%s.%N)" >> {count}\nexec /usr/bin/sinfo "$@"\n')
    (bin_dir / "sinfo").chmod(0o755)
    (work / "labs").mkdir()
    with class_reservation_and_queue(slurm_cluster) as (resv, down):
        profiles = [
            {"name": "queued", "display_name": "Always queued", "partition": down, "walltime": "0:10:00"},
            {"name": "cpu-1", "display_name": "CPU", "partition": "cpu", "walltime": "0:10:00"},
        ]
        settings = slurm_settings(slurm_cluster, resv, profiles, bin_dir=str(bin_dir), queue_cache_s=CACHE_S)
        runner = HubRunner(work, mode="slurm", settings=settings)
        runner.start()
        runner.sinfo_calls = lambda: len(count.read_text().split()) if count.exists() else 0
        runner.last_sinfo = lambda: float(count.read_text().split()[-1]) if count.exists() else 0.0
        runner.resv, runner.down = resv, down
        try:
            yield runner
        finally:
            runner.cleanup()


def spawn_page(user) -> str:
    r = user.session.get(f"{user.hub.url}/hub/spawn", timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.text


def test_a_burst_of_form_renders_asks_sinfo_once_and_shows_free_counts(hub, slurm_cluster):
    ann = hub.login("ann")
    wait = CACHE_S + 0.5 - (time.time() - hub.last_sinfo())  # start with a cold cache (the login asked nothing)
    if wait > 0:
        time.sleep(wait)
    before = hub.sinfo_calls()
    pages, errors, n = [], [], 20
    gate = threading.Barrier(n)

    def render():
        gate.wait()
        try:
            pages.append(spawn_page(ann))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))
    threads = [threading.Thread(target=render) for _ in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.monotonic() - t0
    assert not errors and len(pages) == n, errors
    assert took < CACHE_S, f"the {n} renders took {took:.1f} s, longer than the cache window: machine overloaded"
    assert hub.sinfo_calls() - before == 1, f"{hub.sinfo_calls() - before} sinfo calls for {n} renders"
    node = slurm_cluster.status()["nodes"][0]  # a GPU machine's local cluster has its GPUs as GRES
    gpus = rf", \d+/{node['gpus']} GPUs free" if node["gpus"] else r" free \(no GPUs\)"
    page = pages[0]
    m = re.search(rf"Free now on partition cpu: (\d+)/1 nodes, (\d+)/(\d+) CPUs{gpus}", page)
    assert m and int(m.group(3)) == node["cpus"] and int(m.group(2)) <= node["cpus"], page[-3000:]
    # the class reservation holds one core of the node (no GPUs): its total is that core
    assert re.search(rf"In reservation {hub.resv}: [01]/1 nodes, [01]/1 CPUs free \(no GPUs\)", page)
    # the DOWN partition has nothing free, and says why
    assert re.search(rf"Free now on partition {hub.down}: 0/1 nodes, 0/{node['cpus']} CPUs"
                     + (rf", 0/{node['gpus']} GPUs free" if node["gpus"] else r" free \(no GPUs\)")
                     + r" \(the partition is not taking jobs\)", page), page[-3000:]
    assert "as Slurm counted them at" in page


def real_view(conf: str):
    """A QueueView over the real Slurm tools with SLURM_CONF `conf` (what the hub's spawners share)."""
    from scalelab.hub.queue import QueueView

    async def run(argv):
        proc = await asyncio.create_subprocess_exec(*argv, env={**os.environ, "SLURM_CONF": conf},
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode, out.decode(), err.decode()
    return QueueView(run=run, sinfo="/usr/bin/sinfo", scontrol="/usr/bin/scontrol", squeue="/usr/bin/squeue",
                     conf=conf)


def test_names_from_the_cluster_are_escaped_in_the_form(hub, slurm_cluster, evil_names):
    from scalelab.hub.options import Profile, options_form_html
    from scalelab.hub.queue import profile_queue_lines
    part, resv = evil_names
    # the hub's form says counts only: the markup-named partition and reservation on its cluster never reach it
    page = spawn_page(hub.login("bea"))
    assert part not in page and resv not in page and "q&lt;script" not in page
    # a profile on them (the course settings refuse such names; a Profile made in code does not) is counted from
    # the real cluster's answers and shown escaped
    evil = Profile(name="evil", display_name="Evil", partition=part, walltime="0:10:00", reservation=resv)
    snap = asyncio.run(real_view(slurm_cluster.env()["SLURM_CONF"]).snapshot())
    assert part in snap.partitions and resv in snap.reservations, "the names were made on the real cluster"
    html = options_form_html([evil], "evil", queue=profile_queue_lines(snap, [evil]), queue_time="now")
    assert part not in html and resv not in html
    assert "Free now on partition q&lt;script&gt;x: 0/1 nodes, 0/" in html  # DOWN: nothing free
    assert "In reservation r&lt;script&gt;y: 0/1 nodes, 0/1 CPUs free (no GPUs) (it starts " in html


def pending_messages(user, until, timeout):
    """Progress messages of `user`'s pending server until one matches `until` (regex), or AssertionError."""
    seen = []
    t0 = time.monotonic()
    try:
        for event in user.progress(timeout=timeout):
            seen.append(event.get("message", ""))
            if re.search(until, seen[-1]):
                return seen
            if time.monotonic() - t0 > timeout:
                break
    except requests.RequestException:
        pass
    raise AssertionError(f"no progress message matching {until!r} in {timeout} s: {seen}")


def test_pending_server_shows_its_place_and_expected_start_refreshed_and_never_others_jobs(hub):
    secret_name = f"secret-{hub.prefix}-thesis"
    other = subprocess.run(
        ["sbatch", "--parsable", f"--partition={hub.down}", f"--job-name={secret_name}", "--time=5",
         "--wrap", "sleep 60"], env=hub.slurm_env(), capture_output=True, text=True, timeout=30, check=True)
    other_id = other.stdout.strip().split(";")[0]
    cara = hub.login("cara")
    try:
        assert cara.spawn(options={"profile": "queued"}).status_code == 202
        down = re.escape(hub.down)
        seen = pending_messages(cara, rf"position 2 of 2 waiting in partition {down}; ", timeout=40)
        assert re.search(r"\(reason: PartitionDown\); position 2 of 2 waiting in partition "
                         rf"{down}; (expected start \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d|no expected start from Slurm "
                         r"yet)$", seen[-1]), seen[-1]
        [cara_job] = [j["id"] for j in hub.jobs() if j["name"] == f"jupyter-{cara.name}"]
        form = spawn_page(hub.login("dora"))  # another student's form while both jobs wait: counts only
        assert "Free now on partition" in form
        subprocess.run(["scancel", other_id], env=hub.slurm_env(), check=True, timeout=30)
        seen += pending_messages(cara, rf"position 1 of 1 waiting in partition {down}; ",
                                 timeout=CACHE_S + 20)  # refreshed: the job ahead left
        page = cara.session.get(f"{hub.url}/hub/spawn-pending/{cara.name}", timeout=30).text
        assert all(m.startswith(f"Job {cara_job} ") for m in seen if m.startswith("Job ")), seen  # her own job
        for shown, others in (("\n".join(seen) + page, (secret_name, "thesis", other_id)),
                              (form, (secret_name, "thesis", other_id, cara.name, cara_job))):
            numbers = set(re.findall(r"(?<![0-9A-Za-z])[0-9]+(?![0-9A-Za-z])", shown))  # not digits in a hash
            for leak in others:
                assert leak not in (numbers if leak.isdigit() else shown), f"{leak!r} reached another student"
        assert "root" not in "\n".join(seen), "the other job's user (root) reached the student"
        assert cara.stop().status_code in (202, 204)  # cancel keeps working
        cara.wait_gone(timeout=30)
        assert not [j for j in hub.jobs() if cara.name in j["name"]]
    finally:
        subprocess.run(["scancel", other_id], env=hub.slurm_env(), capture_output=True, timeout=30)


@pytest.mark.parametrize("conf", ["missing", "empty"])
def test_a_failing_sinfo_reads_unknown_and_the_form_still_renders(slurm_cluster, tmp_path, conf):
    """SLURM_CONF pointing nowhere (the view does not wait out Slurm's minute of retries) or at an empty file (the
    real sinfo runs and fails): the form renders, every profile's counts 'unknown'."""
    from scalelab.hub.options import options_form_html, profiles_from_settings
    from scalelab.hub.queue import profile_queue_lines
    path = tmp_path / "slurm.conf"
    if conf == "empty":
        path.write_text("")

    async def look():
        view = real_view(str(path))
        return await view.snapshot(), await view.place("1")
    t0 = time.monotonic()
    snap, place = asyncio.run(look())
    assert time.monotonic() - t0 < 20
    assert snap.partitions is None and place is None
    assert ("is not a file" if conf == "missing" else "sinfo exit 1") in snap.error, snap.error
    ps = profiles_from_settings({"reservation": "class", "profiles": [
        {"name": "cpu", "display_name": "CPU", "partition": "cpu", "walltime": "1:00:00"}]})
    html = options_form_html(ps, "cpu", {}, profile_queue_lines(snap, ps), "04:00:00")
    assert 'value="cpu" checked' in html and "Free now: unknown (Slurm did not answer)" in html


def test_the_cache_window_is_a_course_setting():
    from traitlets.config import Config

    from scalelab.hub import config as hubconf
    from scalelab.hub.settings import load_settings
    cfg = load_settings(overrides={"mode": "slurm", "slurm": {"queue_cache_s": 12}})
    c = Config()
    hubconf.update_slurm_spawner(c, cfg)
    assert c.CourseSlurmSpawner.queue_cache_s == 12.0
    assert load_settings()["slurm"]["queue_cache_s"] == 5
