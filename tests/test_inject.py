"""Instructor injection (issue 35 item 3): `scalelab course inject kill|preempt` writes a record to a spool file, and
every running engine run that watches it ($SCALELAB_INJECT_FILE) fails once as told: a kill takes the last rank
(torchrun restarts the workers from the newest checkpoint, and the lost time shows in the events), a preemption
takes the emergency-checkpoint path. A record from before the launch, an expired one, one for another lab, and a
malformed, huge, linked or foreign spool file fire nothing and crash nothing; the spool file only root can write.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from scalelab.ckpt import read_manifest
from scalelab.errors import SpecError
from scalelab.grade.evidence import run_evidence
from scalelab.launch import launch
from scalelab.run.inject import ENV_VAR, MAX_BYTES, InjectionWatch, issue, read

from helpers import processes_of, tiny

ROOT = Path(__file__).resolve().parent.parent
SLOW = {"fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.05}  # ~50 ms steps, light on cores
CLASSMATE = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the classmate is another account: needs root to setuid")


def _events(run_dir, rank):
    path = Path(run_dir) / "events" / f"rank-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(run, step, ranks=(0, 1), timeout=120):
    """Until every rank in `ranks` wrote a step event >= `step` (in this launch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        last = [max([e["step"] for e in _events(run.run_dir, r) if e["type"] == "step"], default=0) for r in ranks]
        if min(last) >= step:
            return min(last)
        assert run.status in ("pending", "running"), f"the run ended ({run.status}) before step {step}"
        time.sleep(0.05)
    raise AssertionError(f"{run.run_dir} did not reach step {step} in {timeout} s")


def _plausible(run_dir):
    """The grader's evidence of the run: no reason to doubt it."""
    runs = run_evidence(run_dir.parent)["grader.runs"]
    return runs[run_dir.name]


def _spool(tmp_path):
    return tmp_path / "spool" / "inject.json"


def test_an_instructor_kill_takes_the_last_rank_and_the_restart_resumes_from_its_checkpoint(tmp_path):
    spool = _spool(tmp_path)
    spec = tiny(tmp_path, "kill", steps=60, **{"launcher": "torchrun", "world.max_restarts": 2,
                                              "checkpoint.every_steps": 5, **SLOW})
    run = launch(spec, env={**os.environ, ENV_VAR: str(spool)})
    try:
        _wait_for_step(run, 12)
        record = issue(spool, "kill", by="teacher", lab="kill")  # lab: a folder of the run's path
        summary = run.wait(timeout=240)
    finally:
        run.stop()
    assert summary["status"] == "succeeded", summary.get("error")
    fault = [e for e in _events(run.run_dir, 1) if e["type"] == "fault"]
    assert [(f["source"], f["kind"], f["id"]) for f in fault] == [("instructor", "kill", record["id"])]
    assert not [e for e in _events(run.run_dir, 0) if e["type"] == "fault"]  # the last rank only
    events = _events(run.run_dir, 0)
    starts = [i for i, e in enumerate(events) if e["type"] == "start"]
    assert len(starts) == 2  # the restart did not fire again: the record predates its workers
    first, second = events[:starts[1]], events[starts[1]:]
    resumed = second[0]
    assert resumed["resumed_from"] and resumed["start_step"] % 5 == 0 and 0 < resumed["start_step"] <= fault[0]["step"]
    last = [e for e in first if e["type"] == "step"][-1]
    passed = next(e for e in second if e["type"] == "step" and e["step"] > last["step"])
    # the lost time: the steps since the checkpoint run again, after the restart's start-up
    assert passed["t"] - first[-1]["t"] > 0 and resumed["t"] > fault[0]["t"]
    assert [e["step"] for e in second if e["type"] == "step"][0] == resumed["start_step"] + 1
    evidence = _plausible(run.run_dir)
    assert evidence["implausible"] == [] and evidence["launches"] == 2 and evidence["steps"] == 60
    assert processes_of(run.run_dir) == []


def test_an_instructor_preemption_takes_an_emergency_checkpoint_and_the_relaunch_finishes(tmp_path):
    spool = _spool(tmp_path)
    env = {**os.environ, ENV_VAR: str(spool)}
    spec = tiny(tmp_path, "pre", steps=50, **{"checkpoint.on_signal": True, **SLOW})
    run = launch(spec, env=env)
    try:
        _wait_for_step(run, 5)
        record = issue(spool, "preempt", by="teacher")
        summary = run.wait(timeout=120)
    finally:
        run.stop()
    assert summary["status"] == "preempted" and [p.returncode for p in run.procs] == [0, 0]
    # due on every rank; the first to see it stops them all after that step (the vote), so a rank that polled the
    # file just before it was written may never act on it
    faults = [[e for e in _events(run.run_dir, r) if e["type"] == "fault"] for r in (0, 1)]
    assert 1 <= sum(map(len, faults)) <= 2 and all(len(f) <= 1 for f in faults)
    assert {(f["source"], f["kind"], f["id"]) for fs in faults for f in fs} == {("instructor", "preempt", record["id"])}
    stops = [[e for e in _events(run.run_dir, r) if e["type"] == "preempted"][0] for r in (0, 1)]
    at = stops[0]["step"]
    assert stops[1]["step"] == at and 5 <= at < 50 and "SIGTERM" in {s["signal"] for s in stops}
    assert read_manifest(run.run_dir / "checkpoints")[-1]["step"] == at  # the emergency checkpoint

    again = launch(spec.replace(fault=spec.fault.__class__()), env=env)  # the record is still in force
    assert again.wait(timeout=120)["status"] == "succeeded"
    start = [e for e in _events(run.run_dir, 0) if e["type"] == "start"][-1]
    assert start["start_step"] == at
    assert sum(e["type"] == "fault" for r in (0, 1) for e in _events(run.run_dir, r)) == sum(map(len, faults))
    evidence = _plausible(run.run_dir)
    assert evidence["implausible"] == [] and evidence["launches"] == 2
    assert processes_of(run.run_dir) == []


def test_a_preemption_without_on_signal_ends_the_ranks_as_a_real_one_would(tmp_path):
    spool = _spool(tmp_path)
    run = launch(tiny(tmp_path, "plain", steps=30, **SLOW), env={**os.environ, ENV_VAR: str(spool)})
    try:
        _wait_for_step(run, 3)
        issue(spool, "preempt")
        summary = run.wait(timeout=120, check=False)
    finally:
        run.stop()
    assert summary["status"] == "failed" and "killed by a signal" in run.error
    assert -15 in [p.returncode for p in run.procs]  # SIGTERM's default action: the rank is gone
    assert not list((run.run_dir / "checkpoints").glob("step-*"))  # no emergency checkpoint without on_signal
    assert processes_of(run.run_dir) == []


def test_records_that_are_not_for_this_launch_and_spool_files_that_are_not_records_fire_nothing(tmp_path):
    spool = _spool(tmp_path)
    issue(spool, "kill", window_s=3600)  # before the launch: a relaunch's view of the record that killed it
    run = launch(tiny(tmp_path, "calm", steps=90, **SLOW), env={**os.environ, ENV_VAR: str(spool)})
    elsewhere = tmp_path / "elsewhere"
    try:
        step = _wait_for_step(run, 3)

        def then(change):  # every rank looks at the file (each step) before the next change
            nonlocal step
            change()
            step = _wait_for_step(run, step + 3)
        then(lambda: issue(spool, "kill", window_s=1e-6))  # expired before any rank can read it
        then(lambda: issue(spool, "preempt", lab="12_capstone"))  # another lab's runs
        then(lambda: issue(spool, "kill", rank=5, lab="no-such-folder"))
        issue(elsewhere / "inject.json", "kill")

        def link():
            spool.unlink()
            spool.symlink_to(elsewhere / "inject.json")  # a fresh, valid record behind a link
        then(link)

        def huge():
            spool.unlink()
            record = json.loads((elsewhere / "inject.json").read_text())
            spool.write_text(json.dumps({**record, "id": "b" * 32, "pad": "x" * MAX_BYTES}))
        then(huge)
        then(lambda: spool.write_text('{"id": "c", "kind": "kill", "issued_at": '))  # cut short
        then(lambda: spool.write_text(json.dumps({**json.loads((elsewhere / "inject.json").read_text()),
                                                  "rank": "1"})))  # a wrong type
        summary = run.wait(timeout=120)
    finally:
        run.stop()
    assert summary["status"] == "succeeded", summary.get("error")
    for rank in (0, 1):
        events = _events(run.run_dir, rank)
        assert [e["type"] for e in events if e["type"] in ("start", "fault", "error")] == ["start"]
    assert processes_of(run.run_dir) == []


def _write(path: Path, text: str, mode=0o644) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_read_takes_only_a_well_formed_record_from_a_file_nobody_else_can_write(tmp_path):
    good = issue(tmp_path / "spool" / "good.json", "kill", by="teacher")
    folder = tmp_path / "spool"
    assert read(folder / "good.json") == good
    record = json.dumps(good)
    (folder / "link.json").symlink_to(folder / "good.json")
    os.mkfifo(folder / "fifo.json")  # would block a plain open() for ever
    (folder / "dir.json").mkdir()
    bad = [folder / "link.json", folder / "fifo.json", folder / "dir.json", folder / "missing.json",
           _write(folder / "huge.json", record[:-1] + ', "pad": "' + "x" * MAX_BYTES + '"}'),
           _write(folder / "cut.json", record[:40]),
           _write(folder / "list.json", "[1, 2]"), _write(folder / "deep.json", "[" * 4000),
           _write(folder / "writable.json", record, 0o666)]
    for field, value in [("kind", "nuke"), ("rank", "1"), ("rank", True), ("rank", -2), ("issued_at", None),
                         ("expires_at", float("inf")), ("id", ""), ("id", 5), ("lab", ["x"])]:
        bad.append(_write(folder / f"{field}-{value!r}.json".replace("/", "_"), json.dumps({**good, field: value})))
    binary = folder / "binary.json"
    binary.write_bytes(b"\xff\xfe" * 20)
    bad.append(binary)
    foreign = _write(folder / "foreign.json", record)
    os.chown(foreign, CLASSMATE, CLASSMATE)  # a classmate's file: they could rewrite it at will
    bad.append(foreign)
    for path in bad:
        assert read(path) is None, path.name
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    assert read(_write(loose / "inject.json", record)) is None  # anyone could have replaced it


def test_the_watch_fires_a_record_once_on_the_chosen_rank_of_a_matching_run(tmp_path):
    spool = tmp_path / "spool" / "inject.json"
    run_dir = str(tmp_path / "12_capstone" / "race")
    before = time.time() - 1
    watches = [InjectionWatch(spool, before, r, 3, run_dir) for r in range(3)]
    assert [w.due(0) for w in watches] == [None, None, None]  # no file yet
    kill = issue(spool, "kill", lab="12_capstone")
    assert [w.due(1) for w in watches] == [None, None, kill]  # rank -1: the last rank
    assert [w.due(2) for w in watches] == [None, None, None]  # once
    rank7 = issue(spool, "kill", rank=7)
    assert [w.due(3) is not None for w in watches] == [False, False, True] and watches[2].due(3) is None
    rank0 = issue(spool, "kill", rank=0)
    assert [w.due(4) for w in watches] == [rank0, None, None] and rank7 != rank0
    preempt = issue(spool, "preempt")
    assert [w.due(5) for w in watches] == [preempt] * 3
    assert InjectionWatch(spool, time.time() + 1, 0, 3, run_dir).due(0) is None  # a later launch


def test_issue_refuses_bad_input_a_link_and_a_folder_others_may_write(tmp_path):
    for kwargs, field in [({"kind": "nuke"}, "kind"), ({"kind": "kill", "window_s": 0}, "window_s"),
                          ({"kind": "kill", "window_s": float("nan")}, "window_s"),
                          ({"kind": "kill", "rank": -2}, "rank"), ({"kind": "kill", "lab": "a/b"}, "lab")]:
        with pytest.raises(SpecError) as e:
            issue(tmp_path / "ok" / "inject.json", **kwargs)
        assert e.value.field == field and "got" in str(e.value)
    target = issue(tmp_path / "ok" / "target.json", "kill")
    (tmp_path / "ok" / "inject.json").symlink_to(tmp_path / "ok" / "target.json")
    with pytest.raises(SpecError, match="symbolic link"):
        issue(tmp_path / "ok" / "inject.json", "preempt")
    assert read(tmp_path / "ok" / "target.json") == target  # the link's target was not written through
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(SpecError, match="writable by group or others"):
        issue(open_folder / "inject.json", "kill")
    assert list(open_folder.iterdir()) == []


@as_root
def test_a_classmate_can_read_the_spool_file_but_not_write_or_replace_it():
    base = Path(tempfile.mkdtemp(prefix="scalelab-inject-"))
    try:
        base.chmod(0o755)  # the classmate can reach it, as students' runs reach /var/lib/scalelab
        spool = base / "spool" / "inject.json"
        record = issue(spool, "kill")
        assert oct(spool.stat().st_mode & 0o777) == "0o644" and oct((base / "spool").stat().st_mode & 0o777) == "0o755"
        code = f"""
import json, os
from scalelab.run.inject import read
out = {{"read": read({str(spool)!r})}}
for what, path in (("write", {str(spool)!r}), ("create", {str(base / "spool" / "x.json")!r})):
    try:
        with open(path, "w") as f:
            f.write("{{}}")
        out[what] = "done"
    except OSError as e:
        out[what] = e.strerror
print(json.dumps(out))
"""
        r = subprocess.run([sys.executable, "-c", code], user=CLASSMATE, group=CLASSMATE, extra_groups=[], cwd="/",
                           capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/"})
        assert r.returncode == 0, r.stderr
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["read"] == record  # a student's run reads root's record
        assert seen["write"] == "Permission denied" and seen["create"] == "Permission denied"
        assert read(spool) == record
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "scalelab.cli", *args], capture_output=True, text=True, timeout=120)


def test_course_inject_writes_the_record_and_names_a_bad_input(tmp_path):
    spool = tmp_path / "spool" / "inject.json"
    r = _cli("course", "inject", "kill", "--file", str(spool), "--lab", "12_capstone", "--window-s", "120")
    assert r.returncode == 0, r.stderr
    record = read(spool)
    assert record["kind"] == "kill" and record["lab"] == "12_capstone" and record["rank"] == -1
    assert record["expires_at"] - record["issued_at"] == pytest.approx(120) and record["id"] in r.stdout
    r = _cli("course", "inject", "nuke", "--file", str(spool))
    assert r.returncode == 2 and "nuke" in r.stderr and "kill" in r.stderr
    r = _cli("course", "inject", "preempt", "--file", str(spool), "--window-s", "-5")
    assert r.returncode == 1 and "window_s: got -5" in r.stderr and "Traceback" not in r.stderr
    assert read(spool) == record  # nothing written by the refused ones
    course = tmp_path / "course.yaml"  # without --file: the hub setting capstone.inject_file
    course.write_text(f"capstone:\n  inject_file: {tmp_path / 'hub' / 'inject.json'}\n")
    r = _cli("course", "inject", "preempt", "--config", str(course))
    assert r.returncode == 0, r.stderr
    assert read(tmp_path / "hub" / "inject.json")["kind"] == "preempt"
