"""Checkpoint library on its own: retention, async flushes (bounded, isolated, errors surfaced), sharded
checkpoints (atomic publish, per-file checksums), and a process SIGKILLed in the middle of a write."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from scalelab.ckpt import (AsyncCheckpointer, CheckpointError, ShardedCheckpointer, SyncCheckpointer, best,
                           latest_checkpoint, load_any, load_checkpoint, read_manifest)
from scalelab.ckpt import asynchronous
from scalelab.ckpt.retention import select


def _entries(*metrics):
    return [{"step": s, "file": f"step-{s}", "metric": m} for s, m in zip(range(1, len(metrics) + 1), metrics)]


def test_retention_keeps_the_newest_and_the_best():
    kept, dropped = select(_entries(5.0, 1.0, 4.0, 3.0, 2.0), keep_last=2, keep_best=1)
    assert [e["step"] for e in kept] == [2, 4, 5] and [e["step"] for e in dropped] == [1, 3]
    kept, _ = select(_entries(5.0, 1.0, 4.0, 3.0, 0.5), keep_last=1, keep_best=2)
    assert [e["step"] for e in kept] == [2, 5]  # the two best; the newest (5) is one of them
    kept, _ = select(_entries(None, float("nan"), 3.0), keep_last=1, keep_best=5)
    assert [e["step"] for e in kept] == [3]  # no metric, no claim to be best
    with pytest.raises(ValueError, match="keep_last"):
        select(_entries(1.0), keep_last=0)


def _model(seed=0, width=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


X = torch.randn(8, 16)


def _step(model, opt):
    model(X).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("cls", [SyncCheckpointer, AsyncCheckpointer, ShardedCheckpointer])
def test_restore_continues_exactly_and_keeps_best_by_metric(cls, tmp_path):
    ck = cls(tmp_path, keep_last=2, keep_best=1)
    model, opt = _model()
    for step, loss in zip(range(1, 6), (5.0, 1.0, 4.0, 3.0, 2.0)):
        _step(model, opt)
        ck.save(step, model, opt, metric=loss)
    ck.close()
    assert [e["step"] for e in read_manifest(tmp_path)] == [2, 4, 5]
    assert best(tmp_path).name.startswith("step-00000002")
    fresh, fresh_opt = _model(seed=1)
    assert ck.restore(fresh, fresh_opt) == 5 and _same(fresh, model)
    _step(model, opt), _step(fresh, fresh_opt)  # the optimizer state (momentum) came back too
    assert _same(fresh, model)
    assert load_any(best(tmp_path), fresh, fresh_opt) == 2


def test_async_save_returns_before_the_write_and_snapshots_the_state_of_that_moment(tmp_path, monkeypatch):
    real = asynchronous.write_checkpoint

    def slow_write(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)
    monkeypatch.setattr(asynchronous, "write_checkpoint", slow_write)
    ck = AsyncCheckpointer(tmp_path, max_in_flight=1)
    model, opt = _model()
    first = ck.save(1, model, opt)
    assert first["blocked_s"] < 0.15 and ck.in_flight() == 1
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)  # training goes on while step 1 is written
    second = ck.save(2, model, opt)
    assert second["waited_s"] > 0.1  # bounded: one in flight, so the second save waited for the first
    ck.close()
    saved = torch.load(tmp_path / "step-00000001.pt", weights_only=False)["model"]
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_failed_async_flush_is_raised_at_the_next_save_naming_the_file(tmp_path):
    ck = AsyncCheckpointer(tmp_path)
    model, opt = _model()
    ck.save(1, model, opt, extra={"unpicklable": lambda: None})  # torch.save fails in the background thread
    time.sleep(0.2)
    with pytest.raises(CheckpointError, match=r"step 1 to .*step-00000001\.pt failed"):
        ck.save(2, model, opt)
    ck.close()
    assert latest_checkpoint(tmp_path) is None or latest_checkpoint(tmp_path).name == "step-00000002.pt"


def test_a_failed_async_flush_is_raised_at_close(tmp_path):
    ck = AsyncCheckpointer(tmp_path)
    model, opt = _model()
    ck.save(3, model, opt, extra={"unpicklable": lambda: None})
    with pytest.raises(CheckpointError, match="step-00000003.pt"):
        ck.close()


def test_sharded_checkpoint_publishes_a_complete_directory_and_names_a_corrupted_file(tmp_path):
    ck = ShardedCheckpointer(tmp_path)
    model, opt = _model()
    ck.save(1, model, opt)
    ck.close()
    entry = read_manifest(tmp_path)[0]
    assert entry["kind"] == "sharded" and ".metadata" in entry["files"]
    assert not list(tmp_path.glob(".*.partial"))
    shard = next(p for p in (tmp_path / "step-00000001").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupted"):
        ck.restore(*_model())


def test_a_partial_sharded_directory_is_never_loaded(tmp_path):
    ck = ShardedCheckpointer(tmp_path)
    model, opt = _model()
    ck.save(1, model, opt)
    ck.close()
    partial = tmp_path / ".step-00000002.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    with pytest.raises(CheckpointError, match="may be partial"):
        load_any(partial, *_model())


def test_an_unreadable_manifest_is_a_clear_error(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not a valid checkpoint manifest"):
        latest_checkpoint(tmp_path)


_WRITER = """
import sys, torch
from scalelab.ckpt import save_checkpoint
torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)   # 16 MB of weights
opt = torch.optim.SGD(model.parameters(), lr=0.1)
save_checkpoint(sys.argv[1], 1, model, opt)
print("first saved", flush=True)
while True:                            # keep writing step 2 until killed
    save_checkpoint(sys.argv[1], 2, model, opt, extra={"pad": torch.zeros(64 << 20, dtype=torch.uint8)})
"""


def test_a_process_killed_while_writing_leaves_the_last_complete_checkpoint(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "first saved"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".step-00000002.pt.*.tmp")):  # step 2 is being written right now
            assert time.monotonic() < deadline, "the child never started writing step 2"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    listed = [e["file"] for e in manifest["checkpoints"]]
    assert "step-00000001.pt" in listed
    strays = list(tmp_path.glob(".step-*.tmp"))
    assert strays, "the kill landed after the write finished: nothing partial to test"
    for stray in strays:  # the half-written file is still there, and never loaded
        with pytest.raises(CheckpointError, match="may be partial"):
            load_checkpoint(stray, torch.nn.Linear(2048, 2048))
    model = torch.nn.Linear(2048, 2048)
    assert load_checkpoint(latest_checkpoint(tmp_path), model) in (1, 2)  # 2 only if an earlier round completed


def _events(mode, blocked):
    events = [{"type": "start", "rank": 0, "t": 100.0}]
    for step in range(1, 7):
        events.append({"type": "step", "rank": 0, "t": 100.0 + step, "step": step, "step_s": 0.5})
        if step % 3 == 0:
            events.append({"type": "checkpoint", "rank": 0, "t": 100.2 + step, "step": step, "blocked_s": blocked,
                           "mode": mode})
            events.append({"type": "checkpoint_done", "rank": 0, "t": 100.9 + step, "step": step, "flush_s": 0.5,
                           "finished_t": 100.9 + step, "update_wait_s": 0.01})
    return events


def test_timeline_turns_events_into_intervals_and_totals():
    from scalelab.experiments.ckpt_timeline import timeline
    tl = timeline(_events("async", 0.05))
    assert tl["checkpoints"] == 2 and tl["mode"] == "async"
    assert tl["steps"][0] == pytest.approx((0.5, 1.0, 1))
    assert tl["blocks"][0] == pytest.approx((3.15, 3.2, 3))
    assert tl["blocked_s"] == pytest.approx(2 * (0.05 + 0.01)) and tl["flush_s"] == pytest.approx(1.0)


def test_checkpoint_timeline_widget_shows_one_row_per_run(tmp_path):
    from scalelab.widgets import CheckpointTimeline
    view = CheckpointTimeline({"sync": _events("sync", 0.4), "async": _events("async", 0.01)})
    assert view.table.value.count("<tr>") == 3 and "sync" in view.table.value
    assert view.save(tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
