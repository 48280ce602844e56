"""model.activation_checkpointing: the transformer trains to the same losses while keeping a fraction of the
activations for backward (the memory event's activation_bytes, counted from the tensors autograd saves)."""
from __future__ import annotations

import pytest

from scalelab.errors import SpecError
from scalelab.launch import launch

from helpers import tiny

TRANSFORMER = {"model.name": "transformer", "model.width": 32, "model.depth": 2, "steps": 4}


def _run(tmp_path, name, **changes):
    run = launch(tiny(tmp_path, name, workers=1, **TRANSFORMER, **changes))
    summary = run.wait(timeout=120)
    return summary["loss_curve"], [e for e in run.events() if e["type"] == "memory"][0]


def test_checkpointed_layers_keep_less_for_backward_and_train_the_same(tmp_path):
    plain_losses, plain = _run(tmp_path, "plain")
    ckpt_losses, ckpt = _run(tmp_path, "ckpt", **{"model.activation_checkpointing": True})
    assert ckpt_losses == plain_losses  # recomputation gives the very same gradients
    assert 0 < ckpt["activation_bytes"] < 0.3 * plain["activation_bytes"], (ckpt, plain)
    assert ckpt["state_bytes"] == plain["state_bytes"]


def test_activation_checkpointing_of_a_model_without_encoder_layers_is_refused_by_name(tmp_path):
    with pytest.raises(SpecError) as err:
        tiny(tmp_path, **{"model.activation_checkpointing": True})
    assert err.value.field == "model.activation_checkpointing" and "model.name=transformer" in str(err.value)
