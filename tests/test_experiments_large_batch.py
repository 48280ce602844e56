"""scalelab.experiments.large_batch: global-batch training runs with the engine's optimizers and schedule, and
gradient norms whose dependence on the batch size is what the noise-scale estimate assumes."""
from __future__ import annotations

import math

import pytest
import torch

from scalelab.experiments import large_batch as lb
from scalelab.run.spec import preset

DIGITS = preset("tiny").with_overrides({"data.source": "digits", "model.name": "mlp", "model.width": 32,
                                        "model.depth": 1, "optim.batch_per_worker": 32})


def test_a_run_sees_the_sample_budget_and_is_reproducible():
    a = lb.train_run(DIGITS, batch=64, lr=0.05, samples=640)
    b = lb.train_run(DIGITS, batch=64, lr=0.05, samples=640)
    assert a["steps"] == 10 and a["eval_loss"] == b["eval_loss"] and 0 <= a["accuracy"] <= 1


def test_warm_up_changes_the_first_steps_only_as_the_engine_schedule_says():
    cold = lb.train_run(DIGITS, batch=64, lr=0.5, samples=64 * 6)
    warm = lb.train_run(DIGITS, batch=64, lr=0.5, samples=64 * 6, warmup_steps=4)
    assert cold["train_loss_curve"][0] == warm["train_loss_curve"][0]  # the first loss is before any update
    assert cold["train_loss_curve"][1:] != warm["train_loss_curve"][1:]


@pytest.mark.parametrize("name", ["lars", "lamb", "adamw"])
def test_every_engine_optimizer_trains(name):
    r = lb.train_run(DIGITS, batch=128, lr=0.01 if name != "lars" else 2.0, samples=1280, optimizer=name)
    assert r["optimizer"] == name and math.isfinite(r["eval_loss"]) and r["eval_loss"] < 2.4  # below chance (ln 10)


def test_train_runs_keeps_labels_trains_identical_runs_once_and_restores_threads():
    threads = torch.get_num_threads()
    rows = lb.train_runs(DIGITS, [{"batch": 64, "lr": 0.05, "rule": "none"}, {"batch": 64, "lr": 0.05, "rule": "sqrt"},
                                  {"batch": 128, "lr": 0.1, "rule": "linear"}], samples=640)
    assert [r["rule"] for r in rows] == ["none", "sqrt", "linear"]
    assert rows[0]["eval_loss"] == rows[1]["eval_loss"] and rows[2]["steps"] == 5
    assert torch.get_num_threads() == threads


def test_a_diverging_run_is_a_result_not_a_crash():
    r = lb.train_run(DIGITS, batch=64, lr=1e6, samples=640)
    assert r["eval_loss"] == float("inf") or r["eval_loss"] > 10


def test_gradient_norms_shrink_with_the_batch_as_the_noise_model_says():
    n = lb.gradient_norms(DIGITS, small=8, big=256, batches=8, warm_steps=5)
    assert n["g2_small"] > n["g2_big"] > 0 and (n["b_small"], n["b_big"]) == (8, 256)
    g2 = (256 * n["g2_big"] - 8 * n["g2_small"]) / 248
    assert g2 > 0  # the estimate of |G|^2 is positive for these sizes
