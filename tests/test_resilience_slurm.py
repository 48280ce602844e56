"""Preemption on the real local Slurm: a job told to stop — by its time-limit warning (`--signal=B:USR1@N`, which
signals the batch shell) and then by an administrator's `scontrol requeue` (SIGTERM to every process) — takes an
emergency checkpoint each time, goes back to the queue under the same job id, and resumes from it; the three
attempts together end with exactly the parameters of one uninterrupted run."""
from __future__ import annotations

import json
import time

import pytest
import torch

from scalelab.cluster.slurm import slurm_command
from scalelab.launch import launch

from helpers import final_params, processes_of, tiny

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 60
SLOW = {"fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.1}  # sleeps: light on the cores


def _events(run_dir):
    path = run_dir / "events" / "rank-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(run, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run.poll()  # the handle also lets a requeued job start again at once (Slurm holds it back ~2 min)
        events = _events(run.run_dir)
        if what(events):
            return events
        time.sleep(0.2)
    raise AssertionError(f"timed out in {run.run_dir}; rank 0's last events: {_events(run.run_dir)[-3:]}")


def _stepping(attempt, steps=3):
    """Rank 0 is in attempt `attempt` (1-based) and has done `steps` steps in it."""
    def check(events):
        starts = [i for i, e in enumerate(events) if e["type"] == "start"]
        return len(starts) >= attempt and sum(e["type"] == "step" for e in events[starts[attempt - 1]:]) >= steps
    return check


def test_a_signalled_then_requeued_job_resumes_twice_and_ends_like_an_uninterrupted_run(slurm_cluster, tmp_path):
    reference = launch(tiny(tmp_path, "ref", steps=STEPS))
    run = launch(tiny(tmp_path, "job", steps=STEPS, **{"launcher": "slurm", "checkpoint.on_signal": True,
                                                       "slurm.requeue": True, "slurm.signal": "USR1@30",
                                                       "world.threads_per_worker": 1, **SLOW}))
    try:
        _wait_for(run, _stepping(1))
        # what --signal=B:USR1@30 does 30 s before the limit: SIGUSR1 to the batch shell only
        assert slurm_command(["scancel", "--batch", "--signal=USR1", run.job_id], run.env).returncode == 0
        _wait_for(run, _stepping(2))
        assert slurm_command(["scontrol", "requeue", run.job_id], run.env).returncode == 0
        summary = run.wait(timeout=300)
    finally:
        run.stop()
    events = _events(run.run_dir)
    starts = [e for e in events if e["type"] == "start"]
    stops = [e for e in events if e["type"] == "preempted"]
    assert summary["status"] == "succeeded" and len(starts) == 3 and len(stops) == 2, (starts, stops)
    assert [s["signal"] for s in stops] == ["SIGUSR1", "SIGTERM"]
    assert [s["start_step"] for s in starts] == [0, stops[0]["step"], stops[1]["step"]]
    assert 0 < stops[0]["step"] < stops[1]["step"] < STEPS
    assert run.output().count("requeued job") == 1 and "TERM received" in run.output()

    reference.wait(timeout=300)
    mine, theirs = final_params(run.run_dir), final_params(reference.run_dir)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert processes_of(run.run_dir) == []
