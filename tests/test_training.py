"""The training loop's options, one real single-process run each (seconds), plus resume from a checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

from scalelab.launch import launch

from helpers import final_params, tiny


@pytest.mark.parametrize("changes", [
    {"model.name": "mlp", "model.width": 32},
    {"model.name": "transformer", "model.width": 16, "model.depth": 1},
    {"data.source": "digits"},
    {"precision": "bf16"},
    {"optim.name": "lars", "optim.lr": 0.5, "optim.batch_per_worker": 64},  # LARS wants large batches
    {"optim.name": "lamb", "optim.lr": 0.01},
    {"optim.name": "adamw", "optim.lr": 0.003, "optim.lr_scaling": "sqrt", "optim.warmup_steps": 5},
    {"optim.grad_accum": 2, "data.loader_workers": 1},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_option_trains_and_lowers_the_loss(changes, tmp_path):
    summary = launch(tiny(tmp_path, workers=1, steps=30, **changes)).wait(timeout=120)
    curve = summary["loss_curve"]
    assert len(curve) == 30 and all(math.isfinite(x) for x in curve)
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5, f"loss did not go down: {curve[:5]} -> {curve[-5:]}"


def test_warmup_ramps_the_learning_rate_then_holds_the_scaled_peak(tmp_path):
    run = launch(tiny(tmp_path, workers=2, steps=6, **{"optim.warmup_steps": 4, "optim.lr_scaling": "linear",
                                                        "optim.base_batch": 16}))
    run.wait(timeout=120)
    lrs = [e["lr"] for e in run.events() if e["type"] == "step" and e["rank"] == 0]
    peak = 0.05 * 2  # global batch 32 over base 16, linear rule
    assert lrs == pytest.approx([peak / 4, peak / 2, 3 * peak / 4, peak, peak, peak])


def test_epochs_set_the_number_of_steps(tmp_path):
    # 512 samples, 1 rank, batch 16 -> 32 steps per epoch
    summary = launch(tiny(tmp_path, workers=1, epochs=2)).wait(timeout=120)
    assert summary["steps"] == 64


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_parameters(tmp_path):
    straight = launch(tiny(tmp_path, "straight", workers=2, steps=12))
    straight.wait(timeout=120)
    ckpt = {"checkpoint.every_steps": 4}
    first = launch(tiny(tmp_path, "resumed", workers=2, steps=12, **ckpt,
                        **{"fault.kind": "kill", "fault.rank": 1, "fault.step": 10}))
    with pytest.raises(Exception):
        first.wait(timeout=120)
    second = launch(tiny(tmp_path, "resumed", workers=2, steps=12, **ckpt))
    second.wait(timeout=120)
    start = [e for e in second.events() if e["type"] == "start" and e["rank"] == 0][-1]
    assert start["start_step"] == 8 and start["resumed_from"].endswith("step-00000008.pt")
    a, b = final_params(straight.run_dir), final_params(second.run_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=f"{name} differs after resume")


def test_a_schedule_of_the_students_own_sets_every_steps_rate_and_its_code_is_kept(tmp_path, monkeypatch):
    """optim.schedule = module:function: the launcher copies the module beside the notebook (here: the working folder)
    into the run's code/ folder, the rank imports it from there, and the start event names the file and its hash."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_sched.py").write_text("def lr_at(step, total_steps, peak_lr, warmup_steps):\n"
                                         "    return peak_lr * (total_steps - step) / total_steps\n")
    run = launch(tiny(tmp_path, workers=1, steps=5, **{"optim.schedule": "my_sched:lr_at"}))
    run.wait(timeout=120)
    (tmp_path / "my_sched.py").write_text("raise ImportError('the run must not import this file again')\n")
    lrs = [e["lr"] for e in run.events() if e["type"] == "step"]
    assert lrs == pytest.approx([0.05 * (5 - s) / 5 for s in range(5)])
    start = next(e for e in run.events() if e["type"] == "start")
    assert start["schedule"] == "my_sched:lr_at" and list(start["code"]) == ["my_sched.py"]
    assert (run.run_dir / "code" / "my_sched.py").read_text().startswith("def lr_at")


def test_cosine_decay_runs_from_the_peak_to_the_floor(tmp_path):
    run = launch(tiny(tmp_path, workers=1, steps=6, **{"optim.schedule": "cosine", "optim.warmup_steps": 2,
                                                        "optim.min_lr_fraction": 0.1}))
    run.wait(timeout=120)
    lrs = [e["lr"] for e in run.events() if e["type"] == "step"]
    assert lrs[:2] == pytest.approx([0.025, 0.05]) and lrs[-1] == pytest.approx(0.005)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
