"""The GPU paths: which backend ranks get on a node's GPUs, what refuses to run there (and says why), the GPU
peak in the memory event, and a profiled GPU run's trace.

The logic tests run everywhere (a node's GPU count is passed in). The tests marked `gpu` need a CUDA GPU and
skip without one, CI included; they ran on one H100 (torch 2.11, NCCL 2.28), where NCCL refused two ranks on one
GPU ("Duplicate GPU detected"), gloo failed pipeline send/recv of GPU tensors ("writev: Bad address") and FSDP's
reduce-scatter on gloo killed its rank without a word: hence the rules tested here.
"""
from __future__ import annotations

import pytest
import torch

from scalelab import launch
from scalelab.errors import RunFailed, SpecError
from scalelab.experiments.profiling import load_trace, trace_intervals
from scalelab.run.spec import preset
from scalelab.train.profiling import trace_path
from scalelab.train.strategies import pick_backend

from helpers import tiny

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def _spec(**changes):
    return preset("tiny").with_overrides(changes)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this node has n GPUs (pick_backend reads torch.cuda.device_count())."""
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


def test_auto_gives_nccl_when_each_rank_has_a_gpu_and_gloo_when_ranks_share_one(gpus, capfd):
    gpus(2)
    assert pick_backend(_spec(**{"world.workers_per_node": 2}), CUDA, local_size=2) == "nccl"
    assert pick_backend(_spec(), CPU, local_size=2) == "gloo"
    gpus(1)
    assert pick_backend(_spec(**{"world.workers_per_node": 2}), CUDA, local_size=2) == "gloo"
    assert "2 ranks share this node's 1 GPU(s): backend gloo" in capfd.readouterr().err
    assert pick_backend(_spec(**{"world.workers_per_node": 2, "backend": "gloo"}), CUDA, local_size=2) == "gloo"


def test_nccl_with_more_ranks_than_gpus_is_refused_naming_what_to_change(gpus):
    gpus(1)
    with pytest.raises(SpecError) as e:
        pick_backend(_spec(**{"world.workers_per_node": 2, "backend": "nccl"}), CUDA, local_size=2)
    assert e.value.field == "backend" and "world.workers_per_node to at most 1" in str(e.value)
    assert "backend=gloo" in str(e.value)


@pytest.mark.parametrize("changes, runs_on_gloo", [
    ({"strategy": "ddp"}, True),
    ({"strategy": "fsdp", "fsdp.sharding": "none"}, True),
    ({"strategy": "tp", "model.name": "transformer"}, True),
    ({"strategy": "fsdp", "fsdp.sharding": "full"}, False),
    ({"strategy": "fsdp", "fsdp.sharding": "grad_op"}, False),
    ({"strategy": "pp", "model.name": "transformer"}, False),
])
def test_strategies_gloo_cannot_run_on_gpus_are_refused_before_they_start(gpus, changes, runs_on_gloo):
    two = {"world.workers_per_node": 2, **changes}
    gpus(1)  # ranks share the GPU: auto falls back to gloo, which these strategies cannot use
    if runs_on_gloo:
        assert pick_backend(_spec(**two), CUDA, local_size=2) == "gloo"
        _spec(device="cuda", backend="gloo", **two).validate()
        return
    with pytest.raises(SpecError) as e:
        pick_backend(_spec(**two), CUDA, local_size=2)
    assert e.value.field == "world.workers_per_node" and "at most 1" in str(e.value) and "device=cpu" in str(e.value)
    with pytest.raises(SpecError) as e:  # asked for explicitly: refused at launch, before any rank starts
        _spec(device="cuda", backend="gloo", **two).validate()
    assert e.value.field == "backend" and "backend=nccl" in str(e.value)
    gpus(2)  # a GPU each: NCCL
    assert pick_backend(_spec(**two), CUDA, local_size=2) == "nccl"


def _x(name, ts_ms, dur_ms, tid, cat):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "tid": tid}


def test_a_gpu_trace_counts_each_step_and_phase_once():
    # the profiler records each annotation twice on a GPU: on the CPU thread and as gpu_user_annotation on the
    # stream (seen in an H100 trace); steps and phases are the CPU's, compute and comm are the kernels
    trace = {"traceEvents": [
        _x("ProfilerStep#2", 0, 10, 1, "user_annotation"), _x("scalelab:forward", 0, 4, 1, "user_annotation"),
        _x("ProfilerStep#2", 0.5, 10, 7, "gpu_user_annotation"), _x("scalelab:forward", 0.5, 4, 7, "gpu_user_annotation"),
        _x("sm90_xmma_gemm", 1, 2, 7, "kernel"), _x("ncclDevKernel_AllReduce_Sum_f32", 2, 3, 8, "kernel")]}
    iv = trace_intervals(trace, 0)
    assert iv["gpu"] and [s[0] for s in iv["steps"]] == [2] and [p[0] for p in iv["phases"]] == ["forward"]
    assert iv["compute"] == [(0.001, 0.003)] and [c[0] for c in iv["comm"]] == ["all_reduce"]


# -- on a real GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_run_on_the_gpu_trains_in_each_precision_and_reports_its_gpu_peak(tmp_path, precision):
    run = launch(tiny(tmp_path, precision, workers=1, device="cuda", precision=precision, steps=60))
    summary = run.wait(timeout=300)
    start = next(e for e in run.events() if e["type"] == "start")
    memory = next(e for e in run.events() if e["type"] == "memory")
    assert summary["status"] == "succeeded" and start["device"] == "cuda:0" and start["backend"] == "nccl"
    curve = summary["loss_curve"]  # it learns: the last five steps' mean loss is below the first five's
    assert sum(curve[-5:]) < sum(curve[:5])
    # the caching allocator's peak holds at least the parameters, gradients and optimizer state
    assert memory["device_peak_bytes"] >= memory["state_bytes"] > 0


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_train_over_gloo_and_nccl_is_refused_by_name(tmp_path):
    if torch.cuda.device_count() > 1:
        pytest.skip("this node has a GPU per rank")
    run = launch(tiny(tmp_path, "shared", device="cuda"))
    assert run.wait(timeout=300)["status"] == "succeeded"
    assert {e["backend"] for e in run.events() if e["type"] == "start"} == {"gloo"}
    with pytest.raises(RunFailed, match="world.workers_per_node to at most 1"):
        launch(tiny(tmp_path, "nccl", device="cuda", backend="nccl")).wait(timeout=300)
    with pytest.raises(RunFailed, match="reduce-scatters gradients"):
        launch(tiny(tmp_path, "fsdp", device="cuda", strategy="fsdp")).wait(timeout=300)


@pytest.mark.gpu
def test_a_profiled_gpu_run_has_kernels_and_each_active_step_once(tmp_path):
    run = launch(tiny(tmp_path, "prof", workers=1, device="cuda", steps=8, **{
        "profile.enabled": True, "profile.wait_steps": 1, "profile.warmup_steps": 1, "profile.active_steps": 3}))
    run.wait(timeout=300)
    iv = trace_intervals(load_trace(trace_path(run.run_dir, 0)), 0)
    assert iv["gpu"] and iv["compute"] and [s[0] for s in iv["steps"]] == [2, 3, 4]
    assert sorted({p for p, *_ in iv["phases"]}) == ["backward", "data", "forward", "optimizer"]
