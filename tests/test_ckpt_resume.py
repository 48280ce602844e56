"""Resume through the engine: real runs, stopped and relaunched into the same run directory.

A resumed run must end with the same parameters, bit for bit, as one that was never interrupted (same data
order, optimizer state and RNG on CPU) in every checkpoint mode; a run SIGKILLed while a checkpoint is being
written resumes from the last complete one; a corrupted checkpoint stops the resume with an error naming it.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from scalelab.ckpt import CheckpointError, load_checkpoint, read_manifest
from scalelab.errors import RunTimeout, RunFailed
from scalelab.launch import launch

from helpers import final_params, loss_curve, tiny


def _start_event(run_dir, rank=0, last=True):
    starts = [json.loads(line) for line in (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
              if '"type": "start"' in line]
    return starts[-1] if last else starts[0]


def _assert_same_params(a, b):
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs after resume"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 uninterrupted steps on 2 ranks."""
    run = launch(tiny(tmp_path_factory.mktemp("ref"), "ref"))
    return run.run_dir, run.wait(timeout=180)


@pytest.mark.parametrize("mode", ["sync", "async", "sharded"])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(mode, reference, tmp_path):
    ref_dir, ref_summary = reference
    first = launch(tiny(tmp_path, "r", **{"steps": 10, "checkpoint.every_steps": 4, "checkpoint.mode": mode}))
    first.wait(timeout=180)
    assert [e["step"] for e in read_manifest(first.run_dir / "checkpoints")] == [4, 8]
    second = launch(tiny(tmp_path, "r", **{"steps": 20, "checkpoint.every_steps": 4, "checkpoint.mode": mode}))
    summary = second.wait(timeout=180)
    start = _start_event(second.run_dir)
    assert start["start_step"] == 8 and start["resumed_from"].endswith("step-00000008" + (
        "" if mode == "sharded" else ".pt"))
    assert loss_curve(summary) == loss_curve(ref_summary)[8:]  # the same losses, not merely close ones
    _assert_same_params(second.run_dir, ref_dir)


def _rank0_pid(run_dir, deadline):
    while time.monotonic() < deadline:
        path = run_dir / "events" / "rank-0.jsonl"
        if path.exists() and '"type": "start"' in path.read_text():
            return _start_event(run_dir)["pid"]
        time.sleep(0.05)
    raise AssertionError("rank 0 never started")


def _wide(tmp_path, name, mode, steps=24):
    """One rank, a wide MLP (~38 MB of weights and momentum per checkpoint): writes take long enough to hit."""
    return tiny(tmp_path, name, workers=1, **{"model.name": "mlp", "model.width": 2048, "model.depth": 2,
                                                "steps": steps, "checkpoint.every_steps": 3,
                                                "checkpoint.mode": mode, "checkpoint.keep_last": 3})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one(mode, tmp_path):
    reference = launch(_wide(tmp_path, "ref", mode))
    run = launch(_wide(tmp_path, "killed", mode))
    ckpts = run.run_dir / "checkpoints"
    deadline = time.monotonic() + 180
    pid = _rank0_pid(run.run_dir, deadline)
    while not (read_manifest(ckpts) and list(ckpts.glob(".step-*.pt.*.tmp"))):  # 2nd or later checkpoint, mid-write
        assert time.monotonic() < deadline and run.status == "running", "never caught a checkpoint mid-write"
        time.sleep(0.0005)
    os.kill(pid, signal.SIGKILL)
    run.stop()
    partial = list(ckpts.glob(".step-*.pt.*.tmp"))
    assert partial, "the kill landed after the write completed"
    complete = read_manifest(ckpts)[-1]["step"]
    with pytest.raises(CheckpointError, match="may be partial"):
        load_checkpoint(partial[0], torch.nn.Linear(1, 1))

    resumed = launch(_wide(tmp_path, "killed", mode))
    resumed.wait(timeout=240)
    assert _start_event(resumed.run_dir)["start_step"] == complete
    reference.wait(timeout=240)
    _assert_same_params(resumed.run_dir, reference.run_dir)


def _flip_a_byte(path: Path) -> None:
    """Corrupt a checkpoint the way a bad disk does: one byte in the middle."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_checkpoint_stops_the_resume_naming_the_file(tmp_path):
    launch(tiny(tmp_path, "c", workers=1, **{"steps": 6, "checkpoint.every_steps": 5})).wait(timeout=120)
    _flip_a_byte(tmp_path / "c" / "checkpoints" / "step-00000005.pt")
    with pytest.raises(RunFailed, match=r"step-00000005\.pt is corrupted"):
        launch(tiny(tmp_path, "c", workers=1, **{"steps": 12, "checkpoint.every_steps": 5})).wait(timeout=120)


def test_time_slices_finish_on_a_busy_machine_by_widening_a_slice_that_made_no_progress(tmp_path):
    # Lab 06 failed under load with fixed 10 s slices: start-up alone ate them. Here a slice far shorter than a
    # rank's start-up, with the other core kept busy, must still end in a finished, resumed run.
    import subprocess
    import sys

    from scalelab import run_in_time_slices
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spec = tiny(tmp_path, "slices", workers=1, **{"steps": 30, "checkpoint.every_steps": 5,
                                                       "checkpoint.resume": True})
        attempts = run_in_time_slices(spec, limit_s=0.5, max_attempts=6)
    finally:
        burner.kill()
    assert attempts[-1]["status"] == "succeeded" and attempts[-1]["last_step"] == 30
    assert attempts[0]["last_step"] is None and attempts[1]["limit_s"] == 1.0  # no progress: the slice doubled
    assert len(attempts) >= 2


def test_time_slices_count_an_attempt_lost_at_start_up_and_name_the_failure_when_every_one_is(tmp_path):
    # A rank that fails before its first step is a lost attempt (retried, the slice doubled); a start that always
    # fails (here: resuming from a corrupted checkpoint) ends in RunTimeout naming the failure, not in a loop.
    from scalelab import run_in_time_slices
    launch(tiny(tmp_path, "lost", workers=1, **{"steps": 6, "checkpoint.every_steps": 5})).wait(timeout=120)
    _flip_a_byte(tmp_path / "lost" / "checkpoints" / "step-00000005.pt")
    spec = tiny(tmp_path, "lost", workers=1, **{"steps": 12, "checkpoint.every_steps": 5, "checkpoint.resume": True})
    with pytest.raises(RunTimeout, match=r"made no progress in 2 attempts.*the last one failed: .*is corrupted"):
        run_in_time_slices(spec, limit_s=60, max_attempts=2)
