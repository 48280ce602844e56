"""The sharded asynchronous save: the training thread only hands the state over; copy, planning and files happen
on the writer thread, the optimizer's next step waits for the copy, and what is written is the state of that step."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from scalelab.ckpt import ShardedCheckpointer, asynchronous, load_sharded
from scalelab.ckpt.manifest import read_manifest
from scalelab.run.procs import free_port


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    return model, opt


def _step(model, opt):
    torch.nn.functional.cross_entropy(model(torch.ones(4, 16)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    opt.zero_grad()


def test_sharded_async_save_copies_and_writes_nothing_on_the_callers_thread(gloo, tmp_path, monkeypatch):
    seen, release = {}, threading.Event()
    real_save, real_copy = dcp.save, asynchronous.HostSnapshot.copy

    def blocked_save(*args, **kwargs):
        seen["save"] = threading.current_thread()
        release.wait(30)
        return real_save(*args, **kwargs)

    def copy(self, state, path=""):
        seen.setdefault("copy", threading.current_thread())
        return real_copy(self, state, path)

    monkeypatch.setattr(dcp, "save", blocked_save)
    monkeypatch.setattr(asynchronous.HostSnapshot, "copy", copy)
    model, opt = _trained()
    ck = ShardedCheckpointer(tmp_path, async_save=True)
    ck.save(1, model, opt)  # returns although the write cannot finish until `release` is set
    assert ck.in_flight() == 1 and not (tmp_path / "step-00000001").exists()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)  # waits for the copy (step pre-hook), then changes the weights the copy must not see
    release.set()
    done = ck.close()
    assert seen["copy"] is not threading.current_thread() and seen["save"] is not threading.current_thread()
    assert [d["step"] for d in done] == [1] and "update_wait_s" in done[0]
    assert read_manifest(tmp_path)[0]["kind"] == "sharded"
    fresh, fresh_opt = _trained()
    with torch.no_grad():  # other weights than step 1's: the load must put them back
        for p in fresh.parameters():
            p.zero_()
    assert load_sharded(tmp_path / "step-00000001", fresh, fresh_opt) == 1
    assert all(torch.equal(fresh.state_dict()[k], w) for k, w in weights.items())  # the state of step 1, exactly


def test_a_failed_sharded_async_write_is_raised_at_the_next_save(gloo, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", broken)
    model, opt = _trained()
    ck = ShardedCheckpointer(tmp_path, async_save=True)
    ck.save(1, model, opt)
    with pytest.raises(Exception, match="step-00000001.*disk full"):
        ck.save(2, model, opt)
    ck.close()
