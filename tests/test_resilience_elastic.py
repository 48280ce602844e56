"""Surviving a lost worker: torchrun's elastic agent (c10d rendezvous, max_restarts) restarts the workers after
one is SIGKILLed and they resume from the newest checkpoint, ending exactly like an uninterrupted run; forward
recovery lets the survivors re-form the group and finish from memory. No process of either run is left over."""
from __future__ import annotations

import json

import torch

from scalelab.launch import launch

from helpers import final_params, processes_of, tiny

STEPS = 30


def _events(run_dir, rank=0):
    return [json.loads(line) for line in (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()]


def test_torchrun_restarts_after_a_killed_worker_and_ends_like_an_uninterrupted_run(tmp_path):
    reference = launch(tiny(tmp_path, "ref", steps=STEPS))
    run = launch(tiny(tmp_path, "elastic", steps=STEPS, **{
        "launcher": "torchrun", "world.max_restarts": 2, "checkpoint.every_steps": 5,
        "fault.kind": "kill", "fault.rank": 1, "fault.step": 12}))
    try:
        summary = run.wait(timeout=240)
    finally:
        run.stop()
    assert summary["status"] == "succeeded"
    faults = [e for e in _events(run.run_dir, 1) if e["type"] == "fault"]
    starts = [e for e in _events(run.run_dir) if e["type"] == "start"]
    assert [f["step"] for f in faults] == [12]  # killed once, in the first attempt only
    assert [s["start_step"] for s in starts] == [0, 10]  # the restart resumed from the step-10 checkpoint
    pids = [e["pid"] for e in _events(run.run_dir, 1) if e["type"] == "start"]
    assert len(pids) == 2 and pids[0] != pids[1]  # a new worker process took rank 1's place
    assert "failed (exitcode" in run.logs()  # the agent saw the failure it recovered from
    reference.wait(timeout=240)
    mine, theirs = final_params(run.run_dir), final_params(reference.run_dir)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert processes_of(run.run_dir) == []


def test_forward_recovery_finishes_with_the_survivors_from_memory(tmp_path):
    run = launch(tiny(tmp_path, "forward", workers=3, steps=STEPS, **{
        "fault.kind": "kill", "fault.rank": 2, "fault.step": 12, "fault.recovery": "forward"}))
    try:
        summary = run.wait(timeout=240)
    finally:
        run.stop()
    assert summary["status"] == "succeeded", summary.get("error")
    events = _events(run.run_dir)
    recovered = [e for e in events if e["type"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["lost"] == [2] and recovered[0]["world_size"] == 2
    assert recovered[0]["lr_factor"] == 2 / 3
    assert [e["start_step"] for e in events if e["type"] == "start"] == [0]  # no restart, no rollback
    steps = [e["step"] for e in events if e["type"] == "step"]
    assert steps == list(range(1, STEPS + 1))  # every step done exactly once, the failed one included
    ends = {e["rank"] for r in (0, 1, 2) for e in _events(run.run_dir, r) if e["type"] == "end"}
    assert ends == {0, 1}
    assert run.lost_ranks() == {2}
    assert processes_of(run.run_dir) == []


def test_forward_recovery_leaves_a_hung_rank_behind_and_fences_it(tmp_path):
    run = launch(tiny(tmp_path, "hung", steps=STEPS, **{
        "fault.kind": "hang", "fault.rank": 1, "fault.step": 12, "fault.recovery": "forward",
        "fault.detect_timeout_s": 3.0}))
    try:
        summary = run.wait(timeout=240)
    finally:
        run.stop()
    assert summary["status"] == "succeeded", summary.get("error")
    recovered = [e for e in _events(run.run_dir) if e["type"] == "recovered"]
    assert [(e["lost"], e["world_size"]) for e in recovered] == [([1], 1)]
    assert recovered[0]["recover_s"] >= 5  # it waited for the live-but-silent rank before leaving it behind
    assert run.procs[1].returncode == -9  # fenced: SIGKILLed by the survivors' leader
    assert processes_of(run.run_dir) == []
