"""run_spmd: one importable function on N real ranks, each rank's return value back, failures named and cleaned up."""
from __future__ import annotations

import time

import pytest

from scalelab.errors import LaunchError, RunFailed, RunTimeout
from scalelab.launch.spmd import SpmdPool, run_spmd

from helpers import processes_of

TARGETS = '''
import os, time
import torch
import torch.distributed as dist

def rank_sum(offset=0):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "threads": torch.get_num_threads(), "extra": os.environ.get("SPMD_EXTRA")}

def raise_on_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes

def exit_on_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()

def peer_error_before_the_exit():
    # what a loaded machine shows: rank 1's socket closes (its peer sees the error) a moment before rank 1's
    # process can be seen gone
    if dist.get_rank() == 0:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    time.sleep(1.0)
    os._exit(3)

def hang():
    time.sleep(600)

def not_json():
    return object()

def no_group():
    return dist.is_initialized()

def pid():
    return os.getpid()

def horovod_sum():
    import horovod.torch as hvd
    hvd.init()
    return {"rank": hvd.rank(), "size": hvd.size(), "sum": hvd.allreduce(torch.ones(1), op=hvd.Sum).item(),
            "mpi": bool(hvd.mpi_enabled())}
'''


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """A module of rank functions in a folder that is the caller's cwd (as a notebook's %%writefile module is)."""
    (tmp_path / "spmd_targets.py").write_text(TARGETS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_rank_returns_its_value_in_rank_order_with_a_gloo_group(targets):
    out = run_spmd("spmd_targets:rank_sum", world=2, kwargs={"offset": 1}, threads=1, run_dir=targets / "r",
                   env={"SPMD_EXTRA": "yes"})
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["threads"] == 1 and r["extra"] == "yes" for r in out)
    assert (targets / "r" / "rank-0.log").exists() and (targets / "r" / "rank-1.log").exists()


def test_init_none_leaves_the_process_group_to_the_function(targets):
    assert run_spmd("spmd_targets:no_group", world=2, init="none", run_dir=targets / "r") == [False, False]


@pytest.mark.parametrize("target, words", [
    ("raise_on_1", ["rank 1 failed", "ValueError", "rank 1 is broken"]),
    ("exit_on_1", ["rank 1", "exit status 3"]),
    ("peer_error_before_the_exit", ["rank 1", "exit status 3"]),
])
def test_a_failing_rank_is_named_and_no_process_is_left(targets, target, words):
    run_dir = targets / "r"
    start = time.monotonic()
    with pytest.raises(RunFailed) as info:
        run_spmd(f"spmd_targets:{target}", world=2, run_dir=run_dir, timeout=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and all(w in str(info.value) for w in words)
    assert processes_of(run_dir) == []


def test_a_hanging_run_times_out_and_is_killed(targets):
    run_dir = targets / "r"
    with pytest.raises(RunTimeout):
        run_spmd("spmd_targets:hang", world=2, run_dir=run_dir, timeout=5)
    assert processes_of(run_dir) == []


def test_a_result_that_is_not_json_fails_the_rank(targets):
    with pytest.raises(RunFailed, match="not JSON data"):
        run_spmd("spmd_targets:not_json", world=1, run_dir=targets / "r")


@pytest.mark.parametrize("target, kwargs, match", [
    ("no_colon", {}, "module:function"),
    ("spmd_targets:rank_sum", {"launcher": "srun"}, "launcher"),
    ("spmd_targets:rank_sum", {"init": "mpi"}, "init"),
    ("spmd_targets:rank_sum", {"world": 0}, "world"),
])
def test_bad_arguments_are_refused_before_anything_starts(targets, target, kwargs, match):
    with pytest.raises(LaunchError, match=match):
        run_spmd(target, **{"world": 2, **kwargs})


def test_an_unknown_function_fails_with_its_name(targets):
    with pytest.raises(RunFailed, match="no function 'nope'"):
        run_spmd("spmd_targets:nope", world=1, run_dir=targets / "r")


@pytest.mark.horovod
def test_horovodrun_runs_the_function_under_horovod_gloo(targets):
    out = run_spmd("spmd_targets:horovod_sum", world=2, launcher="horovodrun", init="none", run_dir=targets / "h")
    assert [(r["rank"], r["size"], r["sum"], r["mpi"]) for r in out] == [(0, 2, 2.0, False), (1, 2, 2.0, False)]


@pytest.mark.horovod
@pytest.mark.mpi
def test_mpirun_runs_the_function_under_horovod_mpi(targets):
    out = run_spmd("spmd_targets:horovod_sum", world=2, launcher="mpirun", init="none", run_dir=targets / "m")
    assert [(r["rank"], r["sum"], r["mpi"]) for r in out] == [(0, 2.0, True), (1, 2.0, True)]


CHANGING = "import os\n\ndef value():\n    return [os.getpid(), {}]\n"


def test_a_pool_runs_job_after_job_on_the_same_ranks_and_reloads_changed_modules(targets):
    (targets / "spmd_changing.py").write_text(CHANGING.format(1))
    with SpmdPool(world=2, threads=1, run_dir=targets / "p") as pool:
        first = pool.run("spmd_changing:value")
        assert pool.run("spmd_targets:rank_sum", offset=2)[1]["sum"] == 5.0
        time.sleep(0.01)
        (targets / "spmd_changing.py").write_text(CHANGING.format(2))  # a student edits a %%writefile cell
        second = pool.run("spmd_changing:value")
        procs = list(pool.procs)
    assert [p for p, _ in first] == [p for p, _ in second]  # same processes
    assert [v for _, v in first] == [1, 1] and [v for _, v in second] == [2, 2]
    assert all(p.poll() is not None for p in procs) and processes_of(targets / "p") == []


def test_a_failed_job_spends_the_pool_and_the_next_job_starts_fresh_ranks(targets):
    with SpmdPool(world=2, threads=1, run_dir=targets / "p") as pool:
        before = pool.run("spmd_targets:pid")
        with pytest.raises(RunFailed, match="rank 1 is broken"):
            pool.run("spmd_targets:raise_on_1")
        assert not pool.alive
        after = pool.run("spmd_targets:pid")
        assert set(before).isdisjoint(after) and pool.dir.name == "restart-1"


def test_a_reused_folder_does_not_replay_old_jobs(targets):
    run_spmd("spmd_targets:rank_sum", world=2, kwargs={"offset": 5}, run_dir=targets / "same")
    out = run_spmd("spmd_targets:rank_sum", world=2, kwargs={"offset": 0}, run_dir=targets / "same")
    assert out[0]["sum"] == 1.0
