"""scalelab.experiments.large_batch: global-batch training runs with the engine's optimizers and schedules, gradient
norms whose dependence on the batch size is what the noise-scale estimate assumes, steps to a target and the fitted
critical batch, batch growth against decay, and the schedule exercise's engine runs; the engine's schedules
themselves (scalelab.train.optim.lr_at)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from scalelab.experiments import large_batch as lb
from scalelab.run.spec import preset
from scalelab.train.optim import lr_at

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


# -- the engine's schedules (scalelab.train.optim.lr_at), which the lab's runs and exercise use -------------------

@pytest.mark.parametrize("schedule", ["constant", "cosine", "poly"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule):
    assert [lr_at(s, 2.0, 4, schedule, 20) for s in range(4)] == [0.5, 1.0, 1.5, 2.0]


@pytest.mark.parametrize("schedule, low", [("cosine", 0.0), ("poly", 0.0)])
def test_cosine_and_poly_fall_from_the_peak_to_the_floor_at_the_last_step(schedule, low):
    lrs = [lr_at(s, 1.0, 4, schedule, 20) for s in range(20)]
    # the last warm-up step reaches the peak, and the decay starts from it (progress 0) on the next
    assert lrs[3] == lrs[4] == 1.0 and all(b < a for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] == pytest.approx(low)
    assert lr_at(19, 1.0, 4, schedule, 20, min_lr_fraction=0.1) == pytest.approx(0.1)
    mid = 4 + (19 - 4) / 2  # half-way through the decay: cosine at half the peak, poly (power 2) at a quarter
    assert lr_at(mid, 1.0, 4, schedule, 20) == pytest.approx({"cosine": 0.5, "poly": 0.25}[schedule])


def test_a_schedule_of_ones_own_is_called_with_step_total_peak_and_warm_up(tmp_path, monkeypatch):
    (tmp_path / "my_sched_t.py").write_text("def f(step, total, peak, warm):\n    return peak * step / total + warm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert lr_at(5, 2.0, 3, "my_sched_t:f", 10) == pytest.approx(2.0 * 5 / 10 + 3)


def test_an_in_process_run_follows_the_schedule_after_the_warm_up_only():
    const = lb.train_run(DIGITS, batch=64, lr=0.3, samples=64 * 12, warmup_steps=3)
    cosine = lb.train_run(DIGITS, batch=64, lr=0.3, samples=64 * 12, warmup_steps=3, schedule="cosine")
    assert cosine["schedule"] == "cosine" and const["schedule"] == "constant"
    assert cosine["train_loss_curve"][:4] == const["train_loss_curve"][:4]  # warm-up and the step at the peak
    assert cosine["train_loss_curve"][5:] != const["train_loss_curve"][5:]


# -- steps to a target and the critical batch ----------------------------------------------------------------------

def test_steps_to_target_counts_steps_and_gives_none_when_out_of_reach():
    steps = lb.steps_to_target(DIGITS, batch=64, lr=0.2, target=1.5, max_steps=200, warmup_steps=2)
    assert steps is not None and 1 <= steps < 200
    assert lb.steps_to_target(DIGITS, batch=64, lr=0.2, target=1.5, max_steps=steps - 1, warmup_steps=2) is None
    assert lb.steps_to_target(DIGITS, batch=64, lr=0.2, target=0.0, max_steps=5) is None  # never reaches 0


def test_the_study_keeps_each_batchs_fewest_steps_and_cuts_slower_runs_there():
    study = lb.steps_to_target_study(DIGITS, {64: [0.4, 0.2, 0.01], 16: [0.1]}, target=1.5, max_steps=150)
    rows = {(r["batch"], r["lr"]): r for r in study["rows"]}
    assert [r["batch"] for r in study["rows"]] == [16, 64, 64, 64]  # batches in order, rates as given
    fastest = min((r for r in study["rows"] if r["batch"] == 64 and r["steps"]), key=lambda r: r["steps"])
    assert {"batch": 64, "lr": fastest["lr"], "steps": fastest["steps"]} in study["best"]
    slow = rows[(64, 0.01)]  # far too small a rate: cut at the fastest so far, not run to max_steps
    assert slow["steps"] is None and slow["limit"] <= fastest["steps"] < 150


def test_the_fit_recovers_the_critical_batch_of_the_empirical_model():
    s_min, b_crit = 30.0, 48.0
    best = [{"batch": b, "steps": s_min * (1 + b_crit / b)} for b in (16, 32, 64, 128, 256)]
    fit = lb.fit_critical_batch(best)
    assert fit["s_min"] == pytest.approx(s_min) and fit["b_crit"] == pytest.approx(b_crit)
    assert fit["e_min"] == pytest.approx(s_min * b_crit) and fit["points"] == 5
    with pytest.raises(ValueError, match="two batch sizes"):
        lb.fit_critical_batch(best[:1])


# -- batch growth against decay -------------------------------------------------------------------------------------

def test_growth_and_decay_see_the_same_samples_and_growth_takes_fewer_steps():
    rows = {r["label"]: r for r in lb.growth_vs_decay(DIGITS, batch=32, lr=0.1, samples=3200, factor=4)}
    assert [p["lr"] for p in rows["decay"]["phases"]] == pytest.approx([0.1, 0.025, 0.00625])
    assert [p["batch"] for p in rows["growth"]["phases"]] == [32, 128, 512]
    assert rows["constant"]["steps"] == rows["decay"]["steps"] == 1600 // 32 + 800 // 32 + 800 // 32
    assert rows["growth"]["steps"] == 1600 // 32 + 800 // 128 + 800 // 512
    assert {r["samples"] for r in rows.values()} == {3200}


# -- the schedule exercise's engine runs, and the batch-script exercise's guard -----------------------------------

SCHEDULE = '''import math


def lr_at(step, total_steps, peak_lr, warmup_steps):
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1)
    return 0.5 * peak_lr * (1 + math.cos(math.pi * min(progress, 1.0)))
'''


def test_try_schedule_reads_the_file_as_it_is_now_and_says_when_it_is_not_written(tmp_path):
    (tmp_path / "my_schedule.py").write_text(SCHEDULE)
    lrs = lb.try_schedule("my_schedule:lr_at", total_steps=10, peak_lr=1.0, warmup_steps=2, folder=tmp_path)
    assert lrs[:2] == [0.5, 1.0] and lrs[-1] == pytest.approx(0.0)
    (tmp_path / "my_schedule.py").write_text('def lr_at(step, total_steps, peak_lr, warmup_steps):\n'
                                             '    raise NotImplementedError("exercise")\n')
    with pytest.raises(NotImplementedError, match="my_schedule:lr_at is not implemented yet"):
        lb.try_schedule("my_schedule:lr_at", folder=tmp_path)


def test_schedule_runs_run_the_students_schedule_in_every_rank(tmp_path, monkeypatch):
    """Two DDP ranks with the schedule of a module beside the 'notebook' (the working folder), and a constant
    one beside it: each step event's rate is the function's, and the run keeps the code it ran."""
    (tmp_path / "my_schedule.py").write_text(SCHEDULE)
    monkeypatch.chdir(tmp_path)
    spec = DIGITS.with_overrides({"world.workers_per_node": 2, "world.threads_per_worker": 1, "steps": 8,
                                  "optim.lr": 0.4, "optim.lr_scaling": "none", "optim.warmup_steps": 3})
    rows = {r["label"]: r for r in lb.schedule_runs(spec, tmp_path / "runs",
                                                    {"yours": "my_schedule:lr_at", "constant": "constant"})}
    yours, const = rows["yours"], rows["constant"]
    scope: dict = {}
    exec(SCHEDULE, scope)  # noqa: S102 - the test's own schedule
    assert yours["lr_curve"] == pytest.approx([scope["lr_at"](s, 8, 0.4, 3) for s in range(8)])
    assert const["lr_curve"] == pytest.approx([0.4 / 3, 0.8 / 3, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4])
    assert yours["peak_lr"] == const["peak_lr"] == 0.4 and yours["steps"] == 8
    assert yours["tail_loss"] == lb.tail_loss(yours["loss_curve"]) == yours["loss_curve"][-1]  # 8 // 10 -> 1 step
    assert (Path(yours["run_dir"]) / "code" / "my_schedule.py").read_text() == SCHEDULE


def test_an_unwritten_schedule_or_batch_script_stops_before_anything_is_launched(tmp_path, monkeypatch):
    from scalelab.experiments.multinode import submit_job_script
    (tmp_path / "my_schedule.py").write_text('def lr_at(step, total_steps, peak_lr, warmup_steps):\n'
                                             '    # YOUR CODE HERE\n    raise NotImplementedError("exercise")\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        lb.schedule_runs(DIGITS, tmp_path / "runs", {"yours": "my_schedule:lr_at"})
    script = tmp_path / "weak_scaling.sbatch"
    script.write_text('#!/bin/bash\n# YOUR CODE HERE\nraise NotImplementedError("exercise")\n')
    with pytest.raises(NotImplementedError, match="weak_scaling.sbatch is not written yet"):
        submit_job_script(script, DIGITS, tmp_path / "job")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "job").exists()
