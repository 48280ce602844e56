"""A whole node lost on the namespace cluster (real slurmds in network namespaces, each node its own /dev/shm):
after a rank-only crash the restart reads the node-local checkpoint tier (node1's memory survived); after node1 is
lost — its processes SIGKILLed, its /dev/shm gone, slurmctld told it is DOWN — the restart on the survivor reads
the shared tier; the three attempts end bit-identical to one uninterrupted run, and the cluster is whole again."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scalelab.cluster.nodes import NodesCluster
from scalelab.errors import ClusterError, SpecError
from scalelab.experiments.resilience_nodes import node_loss, tier_of
from scalelab.launch import launch

from helpers import final_params, processes_of, tiny

STEPS = 40
SLOW = {"fault.kind": "slow", "fault.rank": -1, "fault.node": 0, "fault.slow_s": 0.1}  # sleeps: light on the cores


def test_tiers_are_told_apart_by_the_run_directory(tmp_path):
    assert tier_of(tmp_path / "run" / "checkpoints" / "step-00000004.pt", tmp_path / "run") == "shared"
    assert tier_of("/dev/shm/scalelab-ckpt-abc/step-00000004.pt", tmp_path / "run") == "local"
    assert tier_of(None, tmp_path / "run") is None


@pytest.mark.parametrize("changes, field", [({"world.nodes": 1}, "world.nodes"), ({"checkpoint.mode": "sync"},
                                                                                  "checkpoint.mode")])
def test_a_story_without_two_slurm_nodes_and_two_tiers_is_refused_naming_the_field(tmp_path, changes, field):
    spec = tiny(tmp_path, "story", workers=1, **{"launcher": "slurm", "world.nodes": 2, "checkpoint.every_steps": 4,
                                                 "checkpoint.mode": "multilevel", **changes})
    with pytest.raises(SpecError) as e:
        node_loss(spec, "/nonexistent-state")
    assert e.value.field == field


def test_losing_a_node_the_cluster_does_not_have_is_refused_naming_its_nodes():
    with pytest.raises(ClusterError, match="no node 'node3': this cluster has node1, node2"):
        NodesCluster("/nonexistent-state", nodes=2).lose_node("node3")


@pytest.mark.slurm
@pytest.mark.netns
def test_a_rank_lost_restarts_from_node_local_a_node_lost_from_shared_and_ends_exact(nodes_cluster, tmp_path):
    reference = launch(tiny(tmp_path, "ref", steps=STEPS, **{"world.threads_per_worker": 1}))
    spec = tiny(tmp_path, "story", workers=1, launcher="slurm", steps=STEPS,
                **{"world.nodes": 2, "world.threads_per_worker": 1, "checkpoint.every_steps": 4,
                   "checkpoint.mode": "multilevel", "log_every": 1, **SLOW})
    story = node_loss(spec, str(nodes_cluster.state_dir), crash_after=5, lose_after=10, lose="node1")
    crash, lost, finish = story["attempts"]

    # 1. rank 1 SIGKILLed: the job fails; node1 (rank 0, the writer) lives on
    assert crash["status"] == "failed" and crash["saved_local"] and crash["slurm_restarts"] == 0
    assert crash["slurm_state"] in ("FAILED", "CANCELLED")  # srun's verdict, or our cancel after a peer's error
    # 2. the relaunch on both nodes reads node1's /dev/shm: the newest checkpoint, nothing lost
    assert lost["tier"] == "local" and lost["resumed_from"].startswith("/dev/shm/scalelab-ckpt-")
    assert lost["host"] == "node1" and lost["start_step"] == crash["saved_local"][-1] > 0
    # node1 lost: Slurm itself requeued the job for the node failure (then we cancelled it); the run named the lost
    # node if rank 1 reported its vanished peer before Slurm killed it, else we stopped the requeued job
    assert lost["slurm_restarts"] == 1 and lost["slurm_state"] in ("CANCELLED", "COMPLETING")
    assert (lost["status"], "node node1 was lost" in (lost["error"] or "")) in (("failed", True), ("stopped", False))
    assert story["shared_at_loss"][-1] > lost["start_step"]  # a checkpoint of this attempt reached the shared tier
    # 3. the finish on node2 alone (1 node x 2 ranks) reads the shared tier's newest checkpoint
    assert story["survivor_hosts"] == ["node2"] and finish["host"] == "node2"
    assert finish["tier"] == "shared" and finish["start_step"] == story["shared_at_loss"][-1]
    assert finish["resumed_from"] == f"{story['run_dir']}/checkpoints/step-{finish['start_step']:08d}.pt"
    assert finish["status"] == "succeeded" and finish["last_step"] == STEPS

    reference.wait(timeout=120)
    mine, theirs = final_params(story["run_dir"]), final_params(reference.run_dir)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert processes_of(story["run_dir"]) == []
    # the cluster is whole again, and node1 came back with an empty memory: its local tier died with it
    shm = nodes_cluster.run("srun", "-N2", "-n2", "sh", "-c", "echo $(hostname) $(ls /dev/shm)", timeout=60)
    seen = dict(line.split(" ", 1) if " " in line else (line, "") for line in shm.stdout.strip().splitlines())
    assert sorted(seen) == ["node1", "node2"]
    assert "scalelab-ckpt-" not in seen["node1"] and "scalelab-ckpt-" in seen["node2"]


@pytest.mark.slurm
@pytest.mark.netns
def test_each_node_has_its_own_memory_file_system(nodes_cluster, tmp_path):
    """/dev/shm is node-local (a tmpfs per node): what one node writes there, neither the other nor the host sees."""
    mark = f"scalelab-probe-{tmp_path.name}"
    r = nodes_cluster.run("srun", "-N2", "-n2", "-l", "sh", "-c", f"touch /dev/shm/{mark}-$(hostname); sleep 1; "
                          "echo $(hostname) $(ls /dev/shm | grep -c scalelab-probe-) $(stat -f -c %T /dev/shm); "
                          f"rm -f /dev/shm/{mark}-$(hostname)", timeout=60)
    lines = sorted(line.split(":", 1)[1].split() for line in r.stdout.strip().splitlines())
    assert lines == [["node1", "1", "tmpfs"], ["node2", "1", "tmpfs"]]  # its own file only, not the other's
    assert not list(Path("/dev/shm").glob(f"{mark}-*"))
