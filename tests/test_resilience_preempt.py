"""Preemption on this machine: a SIGTERM mid-run becomes an emergency checkpoint and a clean exit (status
'preempted', exit 0, every rank stopped after the same step), and the relaunch resumes from it exactly: the same
losses and the same final parameters, bit for bit, as a run that was never interrupted."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from scalelab.ckpt import read_manifest
from scalelab.errors import SpecError
from scalelab.launch import launch

from helpers import final_params, loss_curve, processes_of, tiny

STEPS = 30
SLOW = {"fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.05}  # sleeps: light on the cores


def _events(run_dir, rank):
    return [json.loads(line) for line in (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()]


def _wait_for_step(run_dir, rank, step, timeout=120):
    deadline = time.monotonic() + timeout
    path = run_dir / "events" / f"rank-{rank}.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            events = _events(run_dir, rank)
            steps = [e["step"] for e in events if e["type"] == "step"]
            if steps and steps[-1] >= step:
                return next(e for e in events if e["type"] == "start")["pid"]
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s")


def test_sigterm_to_one_rank_stops_all_after_one_emergency_checkpoint_and_resume_is_exact(tmp_path):
    reference = launch(tiny(tmp_path, "ref", steps=STEPS))
    spec = tiny(tmp_path, "pre", steps=STEPS, **{"checkpoint.on_signal": True, **SLOW})
    run = launch(spec)
    try:
        pid = _wait_for_step(run.run_dir, 1, 5)
        os.kill(pid, signal.SIGTERM)  # only rank 1 hears it: the per-step vote stops rank 0 too
        summary = run.wait(timeout=120)
    finally:
        run.stop()
    assert summary["status"] == "preempted"
    assert [p.returncode for p in run.procs] == [0, 0]  # a clean exit, not a death
    stops = [[e for e in _events(run.run_dir, r) if e["type"] == "preempted"][0] for r in (0, 1)]
    at = stops[0]["step"]
    assert stops[1]["step"] == at and 5 <= at < STEPS
    assert stops[1]["signal"] == "SIGTERM" and stops[0]["signal"] == "peer"
    assert read_manifest(run.run_dir / "checkpoints")[-1]["step"] == at  # the emergency checkpoint
    assert processes_of(run.run_dir) == []

    resumed = launch(spec.replace(fault=spec.fault.__class__()))  # same run directory, no more slowness
    after = resumed.wait(timeout=120)
    start = [e for e in _events(resumed.run_dir, 0) if e["type"] == "start"][-1]
    assert start["start_step"] == at and start["resumed_from"].endswith(f"step-{at:08d}.pt")
    ref = reference.wait(timeout=120)
    assert loss_curve(after) == loss_curve(ref)[at:]
    mine, theirs = final_params(resumed.run_dir), final_params(reference.run_dir)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert processes_of(resumed.run_dir) == [] and processes_of(reference.run_dir) == []


@pytest.mark.parametrize("changes, field", [
    ({"slurm.requeue": True}, "slurm.requeue"),
    ({"slurm.signal": "USR1@60"}, "slurm.signal"),
    ({"slurm.signal": "KILL@60", "checkpoint.on_signal": True}, "slurm.signal"),
    ({"fault.kind": "kill", "fault.rank": -1}, "fault.rank"),
    ({"fault.node": 1}, "fault.node"),
    ({"world.max_restarts": 2}, "world.max_restarts"),
    ({"fault.recovery": "forward", "launcher": "torchrun"}, "fault.recovery"),
])
def test_resilience_fields_that_cannot_work_are_refused_naming_the_field(tmp_path, changes, field):
    with pytest.raises(SpecError) as e:
        tiny(tmp_path, "bad", **changes)
    assert e.value.field == field and len(str(e.value)) > len(field) + 20  # says what is wrong and what to do
