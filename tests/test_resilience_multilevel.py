"""Multi-level checkpoints on real runs: each save lands in the node-local tier at once and in the shared tier in
the background; a restart on the same node reads the local tier, a restart after the node (its local tier) is gone
reads the shared one — and both resumes end bit-identical to an uninterrupted run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from scalelab.ckpt import read_manifest
from scalelab.errors import SpecError
from scalelab.launch import launch

from helpers import final_params, tiny


def _spec(tmp_path, name, steps):
    return tiny(tmp_path, name, steps=steps, **{"checkpoint.every_steps": 4, "checkpoint.mode": "multilevel",
                                                "checkpoint.local_dir": str(tmp_path / f"{name}-node-local")})


def _resumed_from(run):
    return [e for e in run.events() if e["type"] == "start" and e["rank"] == 0][-1]["resumed_from"]


@pytest.mark.parametrize("node_lost", [False, True], ids=["node-survived", "node-lost"])
def test_a_restart_reads_the_local_tier_if_the_node_survived_else_the_shared_one(tmp_path, node_lost):
    reference = launch(tiny(tmp_path, "ref", steps=20))
    first = launch(_spec(tmp_path, "ml", 10))
    first.wait(timeout=180)
    local, shared = tmp_path / "ml-node-local", tmp_path / "ml" / "checkpoints"
    assert [e["step"] for e in read_manifest(local)] == [4, 8] == [e["step"] for e in read_manifest(shared)]
    flushed = [e for e in first.events() if e["type"] == "checkpoint_done"]
    assert [(e["step"], e["tier"]) for e in flushed] == [(4, "shared"), (8, "shared")]
    if node_lost:
        shutil.rmtree(local)
    second = launch(_spec(tmp_path, "ml", 20))
    second.wait(timeout=180)
    assert _resumed_from(second) == str((shared if node_lost else local) / "step-00000008.pt")
    reference.wait(timeout=180)
    mine, theirs = final_params(second.run_dir), final_params(reference.run_dir)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert json.loads((tmp_path / "ml" / "spec.json").read_text())["checkpoint"]["mode"] == "multilevel"


def test_local_dir_without_multilevel_is_refused(tmp_path):
    with pytest.raises(SpecError) as e:
        tiny(tmp_path, "bad", **{"checkpoint.local_dir": "/dev/shm/x"})
    assert e.value.field == "checkpoint.local_dir"
