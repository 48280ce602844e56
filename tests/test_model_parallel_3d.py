"""3D parallelism in the engine (strategy 3d, train/mesh.py): dp x tp and dp x pp meshes on 4 gloo ranks train to
DDP's losses, accuracy and parameters at the same global batch and seed, each rank holding its shard; the
transformer split by heads (tp) and cut into stages (pp) follows DDP too; a tp x pp run resumed from its per-rank
checkpoints continues exactly; a layout the world does not fill names the field and the fix; ranks are grouped
Megatron-style and the transformer's stages compose to the whole model."""
from __future__ import annotations

import shutil

import pytest

from scalelab.errors import SpecError
from scalelab.launch import launch
from scalelab.train.mesh import coordinates, mesh_groups

from helpers import final_params, tiny

MLP = {"model.name": "mlp", "model.width": 32, "model.depth": 3, "steps": 3, "optim.batch_per_worker": 16,
       "world.threads_per_worker": 1}
TRANSFORMER = {**MLP, "model.name": "transformer", "model.depth": 2, "optim.batch_per_worker": 32}


def _memory(run) -> dict:
    return {e["rank"]: e for e in run.events() if e["type"] == "memory"}


def _same_model(a_dir, b_dir) -> None:
    a, b = final_params(a_dir), final_params(b_dir)  # tp shards gathered, stages united: the serial model
    assert a.keys() == b.keys()
    assert all((a[k] - b[k]).abs().max() < 1e-5 for k in a), {k: float((a[k] - b[k]).abs().max()) for k in a}


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory):
    """DDP on 2 ranks of 16 samples: the reference for the dp = 2 meshes (global batch 32)."""
    run = launch(tiny(tmp_path_factory.mktemp("ddp2"), "ddp", workers=2, **MLP))
    return run, run.wait(timeout=180)


@pytest.mark.parametrize("layout, shard_checks", [
    ({"parallel.tp": 2}, "tp"),
    ({"parallel.pp": 2, "pipeline.micro_batches": 4, "pipeline.schedule": "gpipe"}, "pp"),
])
def test_a_2x2_mesh_trains_like_ddp_at_the_same_global_batch(tmp_path, ddp2, layout, shard_checks):
    ddp_run, ddp = ddp2
    run = launch(tiny(tmp_path, "mesh", workers=4, strategy="3d", **MLP, **layout))
    mesh = run.wait(timeout=180)
    assert mesh["loss_curve"] == pytest.approx(ddp["loss_curve"], rel=1e-5)
    assert mesh["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
    assert mesh["eval_accuracy"] == pytest.approx(ddp["eval_accuracy"])
    start = [e for e in run.events() if e["type"] == "start" and e["rank"] == 0][0]
    assert start["global_batch"] == 32  # dp = 2 replicas x 16: each replica reads its own half
    memory, whole = _memory(run), _memory(ddp_run)[0]["param_bytes"]
    assert all("all_reduce" in m["comm"] for m in memory.values())  # the dp gradient average (and tp's sums)
    if shard_checks == "tp":  # ranks 0, 1 split each hidden pair; replica 1 (ranks 2, 3) holds the same shards
        assert memory[0]["param_bytes"] == memory[2]["param_bytes"] < 0.75 * whole
    else:  # stages 0 and 1 (ranks 0, 1 of replica 0) hold the model between them, and talk by send/recv
        assert memory[0]["param_bytes"] + memory[1]["param_bytes"] == whole
        assert memory[0]["comm"]["send"]["calls"] == 4 and memory[1]["comm"]["send"]["calls"] == 4
    _same_model(ddp_run.run_dir, run.run_dir)


@pytest.fixture(scope="module")
def transformer_ddp(tmp_path_factory):
    """The transformer on 1 DDP rank of 32 samples: the reference for the dp = 1 layouts."""
    run = launch(tiny(tmp_path_factory.mktemp("tddp"), "ddp", workers=1, **TRANSFORMER))
    return run, run.wait(timeout=180)


@pytest.mark.parametrize("layout", [{"strategy": "tp"}, {"strategy": "pp"},
                                    {"strategy": "3d", "parallel.tp": 2, "parallel.pp": 2}], ids=str)
def test_the_transformer_split_by_heads_and_cut_into_stages_trains_like_ddp(tmp_path, transformer_ddp, layout):
    ddp_run, ddp = transformer_ddp
    workers = 4 if layout["strategy"] == "3d" else 2
    run = launch(tiny(tmp_path, "split", workers=workers, **TRANSFORMER, **layout, **{"pipeline.micro_batches": 2}))
    split = run.wait(timeout=180)
    assert split["loss_curve"] == pytest.approx(ddp["loss_curve"], rel=1e-5)
    memory, whole = _memory(run), _memory(ddp_run)[0]["param_bytes"]
    if layout["strategy"] == "tp":  # qkv, out-projection and MLP weights halved; embedding, norms, head replicated
        assert memory[0]["param_bytes"] == memory[1]["param_bytes"] < 0.7 * whole
    elif layout["strategy"] == "pp":  # embedding + block 0 | block 1 + head
        assert memory[0]["param_bytes"] + memory[1]["param_bytes"] == whole
    else:  # ranks 0, 1: stage 0 split over tp; ranks 2, 3: stage 1
        assert memory[0]["param_bytes"] + memory[2]["param_bytes"] < 0.7 * whole
    _same_model(ddp_run.run_dir, run.run_dir)


def test_a_tp_x_pp_run_resumed_from_its_per_rank_checkpoints_continues_exactly(tmp_path):
    spec = tiny(tmp_path, "whole", workers=4, strategy="3d", **{
        **MLP, "parallel.tp": 2, "parallel.pp": 2, "steps": 4, "optim.name": "adamw", "optim.lr": 0.01,
        "checkpoint.every_steps": 2, "checkpoint.mode": "sharded", "checkpoint.keep_last": 1})
    whole_run = launch(spec)
    whole = whole_run.wait(timeout=180)
    ckpt = whole_run.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"rank-{r:05d}" for r in range(4)]
    assert all((ckpt / f"rank-{r:05d}" / "step-00000002.pt").is_file() for r in range(4))
    # a run stopped after step 2: its checkpoints, in a fresh run directory, and the same spec
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(ckpt, resumed_dir / "checkpoints")
    resumed_run = launch(spec.replace(output_dir=str(resumed_dir)))
    resumed = resumed_run.wait(timeout=180)
    start = [e for e in resumed_run.events() if e["type"] == "start" and e["rank"] == 0][0]
    assert start["start_step"] == 2 and start["resumed_from"].endswith("step-00000002.pt")
    assert resumed["loss_curve"] == whole["loss_curve"][2:]  # Adam's moments and every shard restored: exact
    _same_model(whole_run.run_dir, resumed_run.run_dir)


@pytest.mark.parametrize("changes, field, hint", [
    ({"world.workers_per_node": 3, "parallel.tp": 2}, "parallel.tp", "divides 3"),
    ({"parallel.pp": 2, "parallel.tp": 2, "model.name": "cnn"}, "model.name", "model.name=transformer"),
    ({"parallel.tp": 4, "model.name": "transformer", "model.width": 30}, "model.width", "tp 2 or 4"),
    ({"parallel.pp": 2, "model.name": "mlp", "checkpoint.every_steps": 2}, "checkpoint.mode", "mode=sharded"),
    ({"parallel.pp": 2, "model.name": "mlp", "pipeline.micro_batches": 3}, "pipeline.micro_batches", "divide"),
    ({"parallel.pp": 4, "model.name": "mlp", "model.depth": 2}, "parallel.pp", "at most 3 stages"),
])
def test_a_bad_mesh_names_the_field_and_the_fix(tmp_path, changes, field, hint):
    with pytest.raises(SpecError) as err:
        tiny(tmp_path, workers=4, strategy="3d", **changes)
    assert err.value.field == field and hint in str(err.value), str(err.value)


def test_mesh_ranks_are_grouped_tp_innermost_then_pp_then_dp():
    groups = mesh_groups(dp=2, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one node's GPUs
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # outermost: may cross nodes
    for kind, axis in (("dp", 0), ("pp", 1), ("tp", 2)):  # a group's ranks differ in its own coordinate only
        for ranks in groups[kind]:
            coords = [coordinates(r, tp=2, pp=2) for r in ranks]
            assert [c[axis] for c in coords] == list(range(2))
            assert len({c[:axis] + c[axis + 1:] for c in coords}) == 1


def test_transformer_stages_compose_to_the_whole_model_and_keep_its_names():
    import torch
    from scalelab.run.spec import ModelSpec
    from scalelab.train.models import build_model
    model = build_model(ModelSpec("transformer", width=32, depth=2), 1, 16, 4, seed=0)
    x = torch.randn(3, 1, 16, 16)
    whole = model(x)
    assert len(model.unit_sizes()) == 4 and sum(model.unit_sizes()) == sum(p.numel() for p in model.parameters())
    staged = model.forward_units(model.forward_units(x, 0, 2), 2, 4)
    assert torch.equal(staged, whole)
    names = {n for n, _ in model.named_parameters()}
    model.keep_units(2, 4)  # block 1, the norm and the head
    kept = {n for n, _ in model.named_parameters()}
    assert kept < names and all(n.startswith(("encoder.layers.1.", "norm.", "head.")) for n in kept)
