"""Strategies pp and tp in the engine: the mlp cut into one pipeline stage per rank, or its hidden layers split
column/row over the ranks, trains to the losses, accuracy and parameters of DDP at the same global batch and seed,
each rank holding only its part; bad settings name the field to change."""
from __future__ import annotations

import pytest

from scalelab.errors import SpecError
from scalelab.launch import launch

from helpers import final_params, tiny

MLP = {"model.name": "mlp", "model.width": 64, "model.depth": 3, "steps": 4, "optim.batch_per_worker": 32}


def test_a_two_stage_1f1b_pipeline_trains_like_ddp_at_the_same_global_batch(tmp_path):
    ddp_run = launch(tiny(tmp_path, "ddp", workers=1, **MLP))
    ddp = ddp_run.wait(timeout=180)
    pp_run = launch(tiny(tmp_path, "pp", workers=2, **MLP, **{"strategy": "pp", "pipeline.micro_batches": 4}))
    pp = pp_run.wait(timeout=180)
    assert pp["loss_curve"] == pytest.approx(ddp["loss_curve"], rel=1e-5)
    assert pp["eval_accuracy"] == pytest.approx(ddp["eval_accuracy"]) and pp["final_loss"] == pp["loss_curve"][-1]
    start = [e for e in pp_run.events() if e["type"] == "start" and e["rank"] == 0][0]
    assert start["global_batch"] == 32  # every stage sees the whole batch: dp = 1
    memory = {e["rank"]: e for e in pp_run.events() if e["type"] == "memory"}
    ddp_params = [e for e in ddp_run.events() if e["type"] == "memory"][0]["param_bytes"]
    assert memory[0]["param_bytes"] + memory[1]["param_bytes"] == ddp_params  # the stages split the model
    assert memory[0]["comm"]["send"]["calls"] == 4 and memory[1]["comm"]["send"]["calls"] == 4  # act. / grads
    a, b = final_params(ddp_run.run_dir), final_params(pp_run.run_dir)  # the gathered stages: the whole model
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


def test_tensor_parallel_mlp_trains_like_ddp_with_half_the_weights_per_rank(tmp_path):
    ddp_run = launch(tiny(tmp_path, "ddp", workers=1, **MLP))
    ddp = ddp_run.wait(timeout=180)
    tp_run = launch(tiny(tmp_path, "tp", workers=2, **MLP, strategy="tp"))
    tp = tp_run.wait(timeout=180)
    assert tp["loss_curve"] == pytest.approx(ddp["loss_curve"], rel=1e-5)
    assert tp["eval_accuracy"] == pytest.approx(ddp["eval_accuracy"])
    memory = {e["rank"]: e for e in tp_run.events() if e["type"] == "memory"}
    ddp_params = [e for e in ddp_run.events() if e["type"] == "memory"][0]["param_bytes"]
    assert memory[0]["param_bytes"] == memory[1]["param_bytes"] < 0.6 * ddp_params
    assert set(memory[0]["comm"]) == {"all_reduce"}  # the row-parallel layer's partial sums
    a, b = final_params(ddp_run.run_dir), final_params(tp_run.run_dir)  # shards concatenated: the serial model
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


@pytest.mark.parametrize("changes, field, hint", [
    ({"strategy": "pp"}, "model.name", "model.name=mlp"),
    ({"strategy": "pp", "model.name": "mlp", "world.workers_per_node": 1}, "world.workers_per_node", "2 to 3"),
    ({"strategy": "pp", "model.name": "mlp", "pipeline.micro_batches": 5}, "pipeline.micro_batches", "divide"),
    ({"strategy": "pp", "model.name": "mlp", "checkpoint.every_steps": 2}, "checkpoint.mode", "mode=sharded"),
    ({"pipeline.schedule": "interleaved"}, "pipeline.schedule", "1f1b"),
    ({"strategy": "tp", "model.name": "mlp", "model.width": 33}, "model.width", "divide"),
    ({"strategy": "tp", "model.name": "cnn"}, "model.name", "model.name=mlp or model.name=transformer"),
])
def test_a_bad_pipeline_setting_names_the_field_and_the_fix(tmp_path, changes, field, hint):
    with pytest.raises(SpecError) as err:
        tiny(tmp_path, **changes)
    assert err.value.field == field and hint in str(err.value)
