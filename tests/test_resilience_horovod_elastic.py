"""Horovod elastic (`hvd.elastic.run` under `horovodrun --host-discovery-script`): a SIGKILLed worker leaves the
survivors to roll back to the last commit, re-form and finish where one process replaying the same steps ends; a
host taken out of the discovery script and put back costs a worker and brings a new one, synced from the state;
the discovery script lists one loopback host per slot, or the allocation's hosts; bad settings name their field."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from scalelab.errors import LaunchError, SpecError
from scalelab.experiments.elastic_horovod import elastic_report, elastic_spec, horovod_elastic_run
from scalelab.experiments.resilience import recovery
from scalelab.launch import launch
from scalelab.launch.horovodrun import write_discovery_script
from scalelab.train.hvd_elastic import replay

from helpers import final_params, processes_of, tiny

ELASTIC = {"strategy": "horovod", "launcher": "horovodrun", "world.max_restarts": 2, "model.name": "mlp",
           "fault.detect_timeout_s": 10.0}


def _events(run_dir, rank):
    return [json.loads(line) for line in (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.horovod
def test_a_killed_worker_leaves_the_survivors_to_finish_from_the_last_commit(tmp_path):
    # the lab's experiment: 3 workers, worker 1 SIGKILLed before step 8, a commit every 3 steps
    report = horovod_elastic_run(tmp_path / "killed", steps=20, fault_step=8, commit_every=3, timeout=240)
    run_dir = Path(report["run_dir"])
    assert report["finished"], report
    for rank, hvd_rank in ((0, 0), (2, 1)):
        events = _events(run_dir, rank)
        [reset] = [e for e in events if e["type"] == "recovered"]
        assert (reset["lost"], reset["members"], reset["world_before"], reset["world_size"]) == ([1], [0, 2], 3, 2)
        assert (reset["failed_step"], reset["resumed_step"], reset["hvd_rank"]) == (8, 6, hvd_rank)  # last commit: 6
        # steps 7 and 8 were done, lost with the rollback to the step-6 commit, and done again by two workers
        assert [e["step"] for e in events if e["type"] == "step"] == [*range(1, 9), *range(7, 21)]
        assert [e["world_size"] for e in events if e["type"] == "step"][-1] == 2
        [end] = [e for e in events if e["type"] == "end"]
        assert (end["world_size"], end["resets"], end["members"]) == (2, 1, [0, 2])
    assert not [e for e in _events(run_dir, 1) if e["type"] in ("end", "recovered")]
    assert (report["world_sizes"], report["lost"], report["resumed_step"], report["rolled_back_steps"]) == \
        ([3, 2], [1], 6, 2)
    assert 0 < report["detect_s"] < report["recovery_s"] < 60 and report["final_world_size"] == 2
    rec = recovery([e for r in (0, 1, 2) for e in _events(run_dir, r)])  # lab 08's reading of any recovery
    assert (rec["how"], rec["steps_redone"]) == ("elastic", 2)
    # exact rollback: the result is the uninterrupted trajectory (one process, whole global batches), up to the
    # order of float sums; two steps applied twice, or a model not restored, would be off by far more
    spec = elastic_spec(run_dir, steps=20, fault_step=8, commit_every=3)
    mine, reference, start = final_params(run_dir), replay(spec), replay(spec, steps=0)
    assert report["replay_max_diff"] < 1e-5
    assert all(torch.allclose(mine[k], reference[k], atol=1e-5) for k in reference)
    assert max((reference[k] - start[k]).abs().max() for k in reference) > 1e-2
    assert processes_of(run_dir) == []


@pytest.mark.horovod
def test_a_host_taken_out_and_put_back_brings_a_new_worker_synced_from_the_state(tmp_path):
    # rank 0 sleeps 50 ms every step: the run lasts far longer than the test needs to act on it
    spec = tiny(tmp_path, "hosts", workers=3, steps=2000, **ELASTIC, **{
        "world.commit_every": 2, "fault.kind": "slow", "fault.rank": 0, "fault.step": 0, "fault.slow_s": 0.05})
    run = launch(spec)
    exclude = run.run_dir / "elastic" / "exclude_hosts"
    try:
        host = _wait_for(run, lambda e: e["type"] == "start" and e["rank"] == 2)["horovod_host"]
        _wait_for(run, lambda e: e["type"] == "step" and e["step"] >= 5)
        exclude.write_text(host + "\n")  # the discovery script leaves worker 2's host out
        out = _wait_for(run, lambda e: e["type"] == "recovered" and e["rank"] == 0)
        exclude.unlink()  # ... and lists it again: Horovod starts a new worker there
        back = _wait_for(run, lambda e: e["type"] == "recovered" and e["rank"] == 0 and e["added"])
        joined = _wait_for(run, lambda e: e["type"] == "joined")
        _wait_for(run, lambda e: e["type"] == "step" and e["rank"] == joined["rank"] and e["step"] > joined["step"])
        assert run.status == "running"
    finally:
        run.stop()
    assert (out["reason"], out["lost"], out["world_size"]) == ("hosts_changed", [2], 2)
    assert out["rolled_back_steps"] == 0  # a host removed on purpose: no failure, nothing redone
    assert (back["added"], back["world_before"], back["world_size"]) == ([3], 2, 3)  # the next free worker number
    assert joined["rank"] == 3 and joined["step"] == back["resumed_step"]  # synced from the state, not from step 0
    assert joined["members"] == back["members"]
    assert processes_of(run.run_dir) == []


def _wait_for(run, match, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in run.events() if match(e)]
        if found:
            return found[0]
        assert run.status == "running", f"run {run.status}: {run.error}"
        time.sleep(0.2)
    raise AssertionError(f"no matching event within {timeout} s")


@pytest.mark.parametrize("changes, field, fix", [
    ({"world.min_workers": 2}, "world.min_workers", "world.max_restarts > 0"),
    ({**ELASTIC, "world.min_workers": 5}, "world.min_workers", "lower it"),
    ({**ELASTIC, "fault.kind": "hang"}, "fault.kind", "use kind kill"),
    ({**ELASTIC, "checkpoint.every_steps": 5}, "checkpoint.every_steps", "world.commit_every"),
    ({"strategy": "horovod", "launcher": "mpirun", "world.max_restarts": 1}, "world.max_restarts",
     "launcher=horovodrun"),
])
def test_a_bad_elastic_setting_names_the_field_and_the_fix(tmp_path, changes, field, fix):
    with pytest.raises(SpecError) as e:
        tiny(tmp_path, workers=3, **changes)
    assert e.value.field == field and fix in str(e.value)


def test_the_discovery_script_gives_every_slot_a_loopback_host_and_leaves_out_excluded_ones(tmp_path):
    spec = tiny(tmp_path, workers=3, **ELASTIC)
    script = write_discovery_script(spec, tmp_path)
    hosts = _run(script)
    assert hosts == ["127.0.0.1:1", "127.0.0.01:1", "127.0.0.001:1"]  # three hosts: a failure costs one slot
    (tmp_path / "elastic" / "exclude_hosts").write_text("127.0.0.01\n")
    assert _run(script) == ["127.0.0.1:1", "127.0.0.001:1"]


@pytest.mark.slurm
def test_the_discovery_script_inside_an_allocation_lists_its_hosts_with_their_slots(tmp_path, slurm_cluster):
    env = {**slurm_cluster.env(), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[1-2],gpu07",
           "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_CPUS_PER_NODE": "4(x3)"}
    spec = tiny(tmp_path, workers=2, **ELASTIC, **{"world.nodes": 2})
    assert _run(write_discovery_script(spec, tmp_path, env)) == ["node1:2", "node2:2"]
    with pytest.raises(LaunchError, match="the allocation has 3 node"):
        write_discovery_script(spec.with_overrides({"world.nodes": 4}), tmp_path, env)
    with pytest.raises(LaunchError, match="not inside one"):
        write_discovery_script(spec, tmp_path, {"PATH": "/usr/bin:/bin"})


def _run(script) -> list[str]:
    return subprocess.run(["sh", str(script)], capture_output=True, text=True, check=True).stdout.split()


def test_the_report_reads_a_survivor_when_worker_0_was_the_one_lost():
    events = [
        {"type": "start", "rank": 0, "t": 0.0, "world_size": 3}, {"type": "fault", "rank": 0, "t": 5.0, "step": 8},
        {"type": "start", "rank": 1, "t": 0.0, "world_size": 3},
        {"type": "recovered", "rank": 1, "t": 6.5, "lost": [0], "world_size": 2, "failed_step": 8, "resumed_step": 6,
         "rolled_back_steps": 2, "detected_t": 6.0, "recover_s": 0.5},
        {"type": "step", "rank": 1, "t": 7.0, "step": 7}, {"type": "end", "rank": 1, "t": 9.0, "world_size": 2,
                                                           "final_loss": 0.5}]
    report = elastic_report(events)
    assert (report["world_sizes"], report["lost"], report["resumed_step"], report["final_world_size"]) == \
        ([3, 2], [0], 6, 2)
    assert (report["detect_s"], report["recovery_s"]) == (1.0, 2.0)
