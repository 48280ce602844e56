"""A training run longer than its Slurm time limit, as a chain of two jobs on the real local Slurm.

Job 1 has a 1-minute limit and more work than that: Slurm kills it (TIMEOUT), possibly in the middle of a
checkpoint. Job 2 (`--dependency=afterany:<job 1>`) resumes from the newest complete checkpoint and finishes.
The chain must end with exactly the parameters of one uninterrupted run. Steps are slowed by a simulated file
system latency (sleeps, not CPU), so the test costs wall time but little of the shared cores.
"""
from __future__ import annotations

import json

import pytest
import torch

from scalelab.launch.chain import submit_chain
from scalelab.launch import launch

from helpers import final_params, tiny

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _spec(tmp_path, name, launcher):
    # ~0.35 s per step (16 file opens of 20 ms per rank and step): 300 steps are ~100 s, past the 1-minute limit
    return tiny(tmp_path, name, **{"launcher": launcher, "steps": 300, "world.threads_per_worker": 1,
                                    "data.format": "files", "data.open_latency_ms": 20.0,
                                    "checkpoint.every_steps": 10, "log_every": 10, "slurm.time": "1"})


def _starts(run_dir):
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == "start"]


def test_two_chained_jobs_past_a_time_limit_end_like_one_uninterrupted_run(slurm_cluster, tmp_path):
    reference = launch(_spec(tmp_path, "reference", "local"))  # runs alongside the chain (mostly sleeping)
    chain = submit_chain(_spec(tmp_path, "chain", "slurm"), jobs=2, time_limits=["1", "10"])
    try:
        states = chain.wait(timeout=900)
    finally:
        chain.cancel()
    assert states == ["TIMEOUT", "COMPLETED"], f"job states {states}; job output in {chain.run_dir / 'logs'}"

    first, second = _starts(chain.run_dir)
    assert first["start_step"] == 0
    assert 0 < second["start_step"] < 300 and second["start_step"] % 10 == 0
    assert second["resumed_from"].endswith(f"step-{second['start_step']:08d}.pt")

    reference.wait(timeout=600)
    chained, uninterrupted = final_params(chain.run_dir), final_params(reference.run_dir)
    for name in uninterrupted:
        assert torch.equal(chained[name], uninterrupted[name]), f"parameter {name} differs"
