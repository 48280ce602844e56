"""world.wait: a rank spins or blocks while it waits for its step's gradient allreduce (DDP on gloo, Horovod on CPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from scalelab.dist import RankInfo
from scalelab.errors import SpecError
from scalelab.launch import launch
from scalelab.run.spec import preset
from scalelab.train import strategies
from scalelab.train.strategies import resolve_wait

from helpers import final_params, tiny


def _resolve(wait="auto", host=True, ranks=2, threads=1, cpus=2, monkeypatch=None):
    monkeypatch.setattr(strategies, "usable_cpus", lambda: cpus)
    spec = preset("tiny").with_overrides({"world.wait": wait, "world.threads_per_worker": threads,
                                          "world.workers_per_node": ranks})
    return resolve_wait(spec, RankInfo(0, ranks, 0, ranks, "torch"), host_collectives=host)


def test_auto_spins_when_every_rank_thread_has_a_core(monkeypatch):
    assert _resolve(ranks=2, threads=1, cpus=2, monkeypatch=monkeypatch) == "spin"
    assert _resolve(ranks=4, threads=4, cpus=16, monkeypatch=monkeypatch) == "spin"


def test_auto_blocks_when_ranks_share_cores(monkeypatch):
    # a spinning rank would take CPU from the very rank it waits for
    assert _resolve(ranks=4, threads=1, cpus=2, monkeypatch=monkeypatch) == "block"
    assert _resolve(ranks=2, threads=2, cpus=2, monkeypatch=monkeypatch) == "block"


def test_an_explicit_choice_is_kept_for_host_collectives_and_gpu_ones_never_spin(monkeypatch):
    assert _resolve("block", monkeypatch=monkeypatch) == "block"
    assert _resolve("spin", ranks=4, cpus=2, monkeypatch=monkeypatch) == "spin"
    assert _resolve("spin", host=False, monkeypatch=monkeypatch) == "block"  # NCCL: the GPU finishes the op
    assert _resolve("auto", host=False, monkeypatch=monkeypatch) == "block"


def test_a_spin_gives_up_after_spin_ms_and_stops_as_soon_as_the_wait_is_over():
    start = time.perf_counter()
    # comes true after 2 s: an unbounded spin would return True; a bounded one gives up after 50 ms
    assert strategies.spin_until(lambda: time.perf_counter() > start + 2.0, 0.05) is False
    assert 0.05 <= time.perf_counter() - start < 1.5
    polls = iter([False, False, True])
    start = time.perf_counter()
    assert strategies.spin_until(lambda: next(polls), 60.0) is True
    assert time.perf_counter() - start < 1.5


def test_spin_ms_is_checked():
    assert preset("tiny").with_overrides({"world.spin_ms": 0.0}).world.spin_ms == 0.0
    for bad in (-1.0, 1e9, float("nan")):
        with pytest.raises(SpecError, match="world.spin_ms"):
            preset("tiny").with_overrides({"world.spin_ms": bad}).validate()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity: Linux")
def test_usable_cpus_follows_the_process_s_affinity_not_the_machine_s_count():
    code = ("import os; from scalelab.train.strategies import usable_cpus; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(usable_cpus(), os.cpu_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split()[0] == "1", out.stdout  # as under srun --cpu-bind or taskset -c 0


@pytest.mark.parametrize("strategy, launcher", [
    ("ddp", "local"),
    pytest.param("horovod", "horovodrun", marks=pytest.mark.horovod),
    pytest.param("horovod", "mpirun", marks=[pytest.mark.horovod, pytest.mark.mpi])])
def test_spinning_and_blocking_ranks_train_to_the_same_parameters(strategy, launcher, tmp_path):
    runs = {w: launch(tiny(tmp_path, w, workers=2, steps=12, strategy=strategy, launcher=launcher,
                           **{"world.wait": w}))
            for w in ("spin", "block")}
    for w, run in runs.items():
        run.wait(timeout=120)
        assert {e["wait"] for e in run.events() if e["type"] == "start"} == {w}
        steps = [e for e in run.events() if e["type"] == "step"]
        assert len(steps) == 2 * 12 and all(e["comm_s"] > 0 for e in steps), f"{w}: allreduce time not measured"
    spin, block = final_params(runs["spin"].run_dir), final_params(runs["block"].run_dir)
    for name in spin:
        torch.testing.assert_close(spin[name], block[name], rtol=0, atol=0, msg=f"{name} differs between waits")


def test_one_rank_has_nothing_to_wait_for(tmp_path):
    run = launch(tiny(tmp_path, workers=1, steps=2, **{"world.wait": "spin"}))
    run.wait(timeout=120)
    assert next(e for e in run.events() if e["type"] == "start")["wait"] == "none"
