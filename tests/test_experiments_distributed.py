"""scalelab.experiments.collectives and ddp_internals on 2 real gloo ranks (one SpmdPool for the module)."""
from __future__ import annotations

import math

import pytest

from scalelab.errors import RunFailed
from scalelab.experiments.collectives import bandwidths, fit_latency_bandwidth
from scalelab.launch.spmd import SpmdPool
from scalelab.run.spec import preset

AVERAGES = '''
import torch.distributed as dist

def right(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

def no_division(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)

def nothing(model):
    pass
'''
SMALL = preset("tiny").with_overrides({"data.samples": 128}).to_dict()
MLP = preset("tiny").with_overrides({"model.name": "mlp", "model.width": 128, "model.depth": 6,
                                     "data.samples": 256, "optim.batch_per_worker": 16}).to_dict()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    d = tmp_path_factory.mktemp("pool")
    (d / "averages_for_test.py").write_text(AVERAGES)
    mp = pytest.MonkeyPatch()
    mp.chdir(d)  # the ranks import modules from the caller's working directory
    with SpmdPool(world=2, threads=1, run_dir=d / "ranks") as p:
        yield p
    mp.undo()


def test_allreduce_sweep_times_every_size_and_sums_correctly(pool):
    out = pool.run("scalelab.experiments.collectives:allreduce_sweep", sizes=[64, 1 << 16], repeats=3)
    assert out[0]["rows"] == out[1]["rows"]  # the slowest rank's time, agreed by both
    assert all(r["sum_ok"] for r in out) and [r["bytes"] for r in out[0]["rows"]] == [64, 1 << 16]
    assert out[0]["backend"] == "gloo"


def test_bandwidths_and_alpha_beta_fit_follow_the_model():
    rows = [{"bytes": b, "time_s": 1e-4 + b / 2e9} for b in (1e3, 1e5, 1e7)]
    bw = bandwidths(rows, world=4)
    assert bw[2]["busbw_GBps"] == pytest.approx(bw[2]["algbw_GBps"] * 1.5)
    fit = fit_latency_bandwidth(rows)
    assert fit["latency_us"] == pytest.approx(100, rel=1e-6) and fit["bandwidth_GBps"] == pytest.approx(2.0)


@pytest.mark.parametrize("average, same", [("right", True), ("no_division", False), ("nothing", False)])
def test_gradients_averaged_by_hand_match_ddp_only_when_averaged_right(pool, average, same):
    out = pool.run("scalelab.experiments.ddp_internals:compare_with_ddp", average=f"averages_for_test:{average}",
                   spec=SMALL, steps=2)
    assert all((r["grad_max_diff"] < 1e-6) == same for r in out)
    assert out[0]["losses"] != out[1]["losses"]  # each rank trains on its own shard


def test_a_student_function_that_raises_fails_the_job_naming_it(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "stub_average.py").write_text("def average_gradients(model):\n    raise NotImplementedError('exercise')\n")
    mp = pytest.MonkeyPatch()
    mp.chdir(d)
    try:
        with SpmdPool(world=2, threads=1, run_dir=d / "r") as p, pytest.raises(RunFailed, match="NotImplementedError"):
            p.run("scalelab.experiments.ddp_internals:compare_with_ddp", average="stub_average:average_gradients",
                  spec=SMALL, steps=1)
    finally:
        mp.undo()


def test_bucket_sweep_counts_fewer_buckets_for_larger_caps_and_the_same_bytes(pool):
    out = pool.run("scalelab.experiments.ddp_internals:bucket_sweep", spec=MLP, caps_mb=[0.05, 25.0], steps=2,
                   warmup=1)[0]
    small, large = out["rows"]
    assert small["buckets"] > large["buckets"] == 1
    assert small["bytes_per_step"] == large["bytes_per_step"] == 4 * out["parameters"]
    assert all(r["step_ms"] > 0 and r["nosync_step_ms"] > 0 and r["exposed_comm_ms"] >= 0 for r in out["rows"])


def test_no_sync_accumulation_sends_k_times_fewer_allreduces_for_the_same_gradient(pool):
    out = pool.run("scalelab.experiments.ddp_internals:accumulation", spec=MLP, k=3, steps=1)[0]
    assert out["calls_naive"] == 3 * out["calls_no_sync"] and out["calls_no_sync"] == out["buckets"] >= 1
    assert out["grad_max_diff"] < 1e-6


def test_replicas_are_identical_with_ddp_and_drift_without_averaging(pool):
    out = pool.run("scalelab.experiments.ddp_internals:replicas", spec=SMALL, steps=3)
    assert all(r["ddp"]["max_diff_from_rank0"] == 0.0 for r in out)
    assert out[0]["ddp"]["checksum"] == out[1]["ddp"]["checksum"]
    assert out[1]["no_averaging"]["max_diff_from_rank0"] > 0 and out[0]["no_averaging"]["max_diff_from_rank0"] == 0
    assert not math.isclose(out[0]["no_averaging"]["checksum"], out[1]["no_averaging"]["checksum"])


PORTS = '''
import horovod.torch as hvd

def right(model, optimizer):
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)

def no_broadcast(model, optimizer):
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)

def no_averaging(model, optimizer):
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return optimizer
'''


@pytest.mark.horovod
def test_horovod_port_matches_the_reference_only_when_ported_right_and_the_timeline_is_read(tmp_path, monkeypatch):
    from scalelab.experiments.horovod_port import timeline_summary
    (tmp_path / "ports_for_test.py").write_text(PORTS)
    monkeypatch.chdir(tmp_path)
    env = {"HOROVOD_TIMELINE": str(tmp_path / "tl.json")}
    with SpmdPool(world=2, launcher="horovodrun", init="none", threads=1, run_dir=tmp_path / "r", env=env) as p:
        got = {name: p.run("scalelab.experiments.horovod_port:train_ported", port=f"ports_for_test:{name}",
                           spec=SMALL, steps=2) for name in ("right", "no_broadcast", "no_averaging")}
    assert all(r["replica_max_diff"] == 0 and r["reference_max_diff"] < 1e-6 for r in got["right"])
    assert got["no_broadcast"][1]["replica_max_diff"] > 1e-3
    assert all(r["reference_max_diff"] > 1e-4 for r in got["no_averaging"])
    tl = timeline_summary(tmp_path / "tl.json")
    assert tl["ok"] and tl["activities"]["ALLREDUCE"] > 0 and "allreduce.head.weight" in tl["tensors"]


def test_timeline_summary_reads_a_file_cut_short(tmp_path):
    from scalelab.experiments.horovod_port import timeline_summary
    (tmp_path / "t.json").write_text('[\n{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.w"}},'
                                     '\n{"ph": "B", "name": "ALLREDUCE", "ts": 1, "pid": 1},{"ph": "E", "ts": 2, "pi')
    tl = timeline_summary(tmp_path / "t.json")
    assert tl["ok"] and tl["activities"] == {"ALLREDUCE": 1} and tl["tensors"] == ["allreduce.w"]
    assert not timeline_summary(tmp_path / "missing.json")["ok"]
