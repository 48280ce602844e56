"""Every launcher trains the tiny preset for real, agrees with the others, and fails cleanly.

Real processes, real gloo / Horovod / Open MPI / Slurm: no mocks. A fault injected through the spec
(`fault.kind`) makes rank 1 raise or SIGKILL itself; the run must fail within 30 s naming rank 1, and leave
no process behind.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from scalelab.errors import RunFailed, RunTimeout
from scalelab.launch import launch

from helpers import final_params, loss_curve, processes_of, tiny

LAUNCHERS = [  # (strategy, launcher, markers)
    ("ddp", "local", []),
    ("ddp", "torchrun", []),
    ("horovod", "horovodrun", [pytest.mark.horovod]),
    ("horovod", "mpirun", [pytest.mark.horovod, pytest.mark.mpi]),
    ("ddp", "slurm", [pytest.mark.slurm]),
]


def _params(strategy, launcher, marks):
    return pytest.param(strategy, launcher, marks=marks, id=f"{strategy}-{launcher}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny preset on 2 local DDP ranks: what every other launcher must reproduce."""
    run = launch(tiny(tmp_path_factory.mktemp("ref")))
    return run.wait(timeout=120)


@pytest.mark.parametrize("strategy, launcher", [_params(*p) for p in LAUNCHERS])
def test_each_launcher_trains_two_ranks_and_matches_local_ddp(strategy, launcher, reference, tmp_path, request):
    if launcher == "slurm":
        request.getfixturevalue("slurm_cluster")
    summary = launch(tiny(tmp_path, strategy=strategy, launcher=launcher)).wait(timeout=180)
    assert summary["status"] == "succeeded"
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert all(rate > 0 for rate in summary["per_rank_samples_per_s"])
    assert math.isfinite(summary["final_loss"])
    # same seed, same data order, same averaged gradients: the same trajectory whoever moves the bytes
    assert loss_curve(summary) == pytest.approx(loss_curve(reference), rel=1e-4, abs=1e-5)


@pytest.mark.slurm
@pytest.mark.horovod
@pytest.mark.mpi
def test_slurm_launcher_runs_horovod_through_mpirun_inside_the_job(slurm_cluster, reference, tmp_path):
    summary = launch(tiny(tmp_path, strategy="horovod", launcher="slurm")).wait(timeout=180)
    assert loss_curve(summary) == pytest.approx(loss_curve(reference), rel=1e-4, abs=1e-5)
    assert "mpirun -np 2" in (tmp_path / "run" / "job.sh").read_text()


def test_one_worker_with_2b_equals_two_workers_with_b(tmp_path):
    """Data-parallel equivalence: same samples per step, gradients averaged -> the same parameters."""
    one = launch(tiny(tmp_path, "one", workers=1, **{"optim.batch_per_worker": 32}))
    two = launch(tiny(tmp_path, "two", workers=2, **{"optim.batch_per_worker": 16}))
    one.wait(timeout=120), two.wait(timeout=120)
    p1, p2 = final_params(one.run_dir), final_params(two.run_dir)
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-4, atol=1e-5, msg=f"parameter {name} differs")
    moved = final_params(one.run_dir)["head.weight"] - _initial_head(tmp_path)
    assert moved.abs().max() > 1e-3  # training really changed the parameters the comparison is about


def _initial_head(tmp_path):
    from scalelab.train.models import build_model
    spec = tiny(tmp_path)
    return build_model(spec.model, 1, spec.data.size, spec.data.classes, spec.seed).state_dict()["head.weight"]


FAULTS = [
    ("ddp", "local", "raise", []), ("ddp", "local", "kill", []), ("ddp", "local", "exit", []),
    ("ddp", "local", "kill-while-peer-spins", []), ("ddp", "local", "kill-while-peer-blocks", []),
    ("ddp", "torchrun", "kill", []),
    ("horovod", "horovodrun", "raise", [pytest.mark.horovod]),
    ("horovod", "horovodrun", "kill", [pytest.mark.horovod]),
    ("horovod", "mpirun", "kill", [pytest.mark.horovod, pytest.mark.mpi]),
    ("ddp", "slurm", "raise", [pytest.mark.slurm]), ("ddp", "slurm", "kill", [pytest.mark.slurm]),
]


@pytest.mark.parametrize("strategy, launcher, kind", [
    pytest.param(s, l, k, marks=m, id=f"{s}-{l}-{k}") for s, l, k, m in FAULTS])
def test_a_failing_rank_fails_the_run_naming_it_and_nothing_is_left(strategy, launcher, kind, tmp_path, request):
    if launcher == "slurm":
        request.getfixturevalue("slurm_cluster")
    kind, _, wait = kind.partition("-while-peer-")  # how rank 0 waits at the allreduce rank 1 never joins
    wait = {"spins": "spin", "blocks": "block"}.get(wait, "auto")
    spec = tiny(tmp_path, strategy=strategy, launcher=launcher, steps=200,
                **{"fault.kind": kind, "fault.rank": 1, "fault.step": 3, "world.wait": wait})
    run = launch(spec)
    started = _first_step_time(run)
    if wait != "auto":
        assert {e["wait"] for e in run.events() if e["type"] == "start"} == {wait}
    with pytest.raises(RunFailed) as err:
        run.wait(timeout=60)
    detected = time.time() - started
    assert err.value.rank == 1, err.value
    assert "rank 1" in str(err.value)
    if kind == "raise":
        assert "injected fault: rank 1 raised at step 3" in str(err.value)
    assert detected < 30, f"failure noticed {detected:.1f} s after training started"
    assert run.status == "failed"
    _assert_no_process_left(run)


def _first_step_time(run, timeout=90):
    """Wall-clock time of the first start event (training is underway), or now if the run already ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        starts = [e["t"] for e in run.events() if e["type"] == "start"]
        if starts or run.status not in ("pending", "running"):
            return min(starts) if starts else time.time()
        time.sleep(0.1)
    raise AssertionError(f"{run} never started; logs:\n{run.logs()}")


def _assert_no_process_left(run, within=10):
    deadline = time.monotonic() + within
    while processes_of(run.run_dir) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = processes_of(run.run_dir)
    assert not left, f"left behind: {[(p.pid, ' '.join(p.cmdline())) for p in left]}"


def test_stop_ends_a_hung_run_and_every_rank(tmp_path):
    run = launch(tiny(tmp_path, steps=200, **{"fault.kind": "hang", "fault.rank": 0, "fault.step": 2}))
    with pytest.raises(RunTimeout, match="call run.stop"):
        run.wait(timeout=8)
    assert run.status == "running"
    run.stop()
    assert run.status == "stopped"
    _assert_no_process_left(run)


@pytest.mark.slurm
def test_stop_cancels_the_slurm_job(slurm_cluster, tmp_path):
    run = launch(tiny(tmp_path, launcher="slurm", steps=100000))
    _first_step_time(run)
    job = run.job_id
    run.stop()
    assert run.status == "stopped"
    state = run.job_info().get("JobState", "")
    assert state in ("CANCELLED", ""), state
    _assert_no_process_left(run)
    assert job


def test_events_are_incremental_and_logs_are_per_rank(tmp_path):
    run = launch(tiny(tmp_path, steps=5))
    run.wait(timeout=120)
    events = run.events()
    assert {e["rank"] for e in events if e["type"] == "start"} == {0, 1}
    assert run.events(since=len(events)) == []
    steps = [e["step"] for e in events if e["type"] == "step" and e["rank"] == 1]
    assert steps == [1, 2, 3, 4, 5]
    assert "injected" not in run.logs(0)
    assert (run.run_dir / "logs" / "rank-1.log").exists()
