"""Lab 01's code exercises, below the notebook: the probe tells an honest timer from the usual wrong ones, the step runs
tell a mixed-precision step that ran in 16 bits from one that silently did not, each leaves the files the grader
re-reads, and a function not written yet is named where it runs (the measurements go on with the lab's own)."""
from __future__ import annotations

import hashlib
import json

import pytest

from scalelab.experiments import single_device as sd
from scalelab.experiments.own_code import OwnCodeError, load_own
from scalelab.experiments.timing import LOG, probe_verdict, read_log
from scalelab.grade.evidence import RUNS, run_evidence
from scalelab.run.spec import preset

HONEST = """import time
def time_steps(step, steps, warmup, sync):
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps
"""
NO_SYNC = HONEST.replace("    sync()\n", "")
WARM_UP_ON_THE_CLOCK = """import time
def time_steps(step, steps, warmup, sync):
    sync()
    start = time.perf_counter()
    for _ in range(warmup + steps):
        step()
    sync()
    return (time.perf_counter() - start) / (warmup + steps)
"""
SYNC_ONLY_AT_THE_END = HONEST.replace("    sync()\n    start", "    start")
NOT_WRITTEN = 'def time_steps(step, steps, warmup, sync):\n    raise NotImplementedError("exercise")\n'

STEP = """import torch
import torch.nn.functional as F
def train_step(model, optimizer, x, y, dtype, scaler):
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad()
    return loss.item()
"""


@pytest.fixture
def spec():
    return preset("tiny").with_overrides({"device": "cpu", "model.width": 8, "data.size": 16, "data.samples": 256,
                                          "optim.batch_per_worker": 16})


def _module(folder, name, text):
    (folder / f"{name}.py").write_text(text)
    return f"{name}:time_steps"


def test_the_probe_passes_an_honest_timer_and_logs_what_the_grader_rereads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    probe = sd.timer_probe(_module(tmp_path, "my_timer", HONEST), tmp_path / "probe")
    assert probe["honest"] and probe["calls"] == 23 and probe["syncs"] == 2
    assert 9.5 < probe["honest_ms"] < 30 and probe["launch_ms"] < 1  # 10 ms of work per step; queueing is free
    log = read_log((tmp_path / "probe" / LOG).read_text())
    assert probe_verdict(log) == {k: v for k, v in probe.items() if k != "run_dir"}
    sha = hashlib.sha256((tmp_path / "my_timer.py").read_bytes()).hexdigest()
    assert probe["code"] == {"my_timer.py": sha} and (tmp_path / "probe" / "code" / "my_timer.py").is_file()


@pytest.mark.parametrize("text, reads", [(NO_SYNC, "low"), (WARM_UP_ON_THE_CLOCK, "high"),
                                         (SYNC_ONLY_AT_THE_END, "high")],
                         ids=["without sync", "warm-up on the clock", "warm-up work still queued at the start"])
def test_the_probe_fails_a_timer_that_misses_the_device_or_counts_the_warm_up(tmp_path, monkeypatch, text, reads):
    monkeypatch.chdir(tmp_path)
    probe = sd.timer_probe(_module(tmp_path, "wrong", text), tmp_path / "probe")
    assert not probe["honest"]
    assert (probe["ratio"] < 0.1) if reads == "low" else (probe["ratio"] > 1.8), probe


def test_a_timer_not_written_yet_is_named_and_the_measurements_use_the_labs_own(tmp_path, monkeypatch, spec, capsys):
    monkeypatch.chdir(tmp_path)
    ref = _module(tmp_path, "my_timer", NOT_WRITTEN)
    with pytest.raises(NotImplementedError, match="time_steps in my_timer.py is not written yet"):
        sd.timer_probe(ref, tmp_path / "probe")
    m = sd.measure(spec, "compute", steps=2, warmup=1, timer=ref)
    assert m["samples_per_s"] > 0 and "my_timer:time_steps is not written yet" in capsys.readouterr().out


def test_the_measurements_call_the_students_timer_as_it_is_now(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    ref = _module(tmp_path, "my_timer", "def time_steps(step, steps, warmup, sync):\n    step()\n    return 0.5\n")
    assert sd.measure(spec, "compute", steps=2, timer=ref)["step_ms"] == 500
    _module(tmp_path, "my_timer", "def time_steps(step, steps, warmup, sync):\n    step()\n    return 0.25\n")
    assert sd.measure(spec, "compute", steps=2, timer=ref)["step_ms"] == 250  # rewritten: no stale import
    _module(tmp_path, "my_timer", "def time_steps(step, steps, warmup, sync):\n    return None\n")
    with pytest.raises(OwnCodeError, match="must return the seconds per step"):
        sd.measure(spec, "compute", steps=2, timer=ref)


def test_own_code_that_is_missing_or_misnamed_is_an_error_that_says_what_to_do(tmp_path):
    with pytest.raises(OwnCodeError, match="run the %%writefile cell"):
        load_own("my_timer:time_steps", source_dir=tmp_path)
    (tmp_path / "my_timer.py").write_text("x = 1\n")
    with pytest.raises(OwnCodeError, match="defines no function 'time_steps'"):
        load_own("my_timer:time_steps", source_dir=tmp_path)
    with pytest.raises(OwnCodeError, match="module:function"):
        load_own("os.path:join", source_dir=tmp_path)


def test_a_mixed_precision_step_runs_in_16_bits_beside_the_fp32_step_as_two_real_runs(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_step.py").write_text(STEP)
    own = sd.step_runs(spec, "my_step:train_step", tmp_path / "runs", precision="fp16", steps=4)
    yours, fp32 = own["yours"], own["fp32"]
    assert yours["low_precision_share"] > 0.5 and fp32["low_precision_share"] == 0
    assert yours["param_dtypes"] == fp32["param_dtypes"] == ["torch.float32"]
    assert yours["scaler_calls"] == {"scale": 4, "step": 4, "update": 4} and fp32["scaler_calls"] is None
    assert own["loss_diff"] < 0.01 and yours["losses"][0] != fp32["losses"][0]  # the same batches, not the same math
    runs = run_evidence(tmp_path)[RUNS]
    assert {k: v["implausible"] for k, v in runs.items()} == {"runs/fp16": [], "runs/fp32": []}
    assert runs["runs/fp16"]["code"] == {"my_step.py": hashlib.sha256(STEP.encode()).hexdigest()}
    assert runs["runs/fp16"]["loss_curve"] == yours["losses"] and runs["runs/fp32"]["loss_curve"] == fp32["losses"]
    events = [json.loads(line) for line in (tmp_path / "runs" / "fp16" / "events" / "rank-0.jsonl").open()]
    assert [e["type"] for e in events] == ["start", "memory"] + ["step"] * 4 + ["end"]


def test_autocast_for_another_device_type_shows_as_fp32_activations(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_step.py").write_text(STEP.replace("device_type=x.device.type", 'device_type="cuda"'))
    with pytest.warns(UserWarning, match="Disabling autocast"):
        own = sd.step_runs(spec, "my_step:train_step", tmp_path / "runs", precision="bf16", steps=2)
    assert own["yours"]["low_precision_share"] == 0 and own["loss_diff"] == 0


def test_a_step_not_written_yet_is_named_in_its_run_and_the_ladder_goes_on_with_the_labs_own(
        tmp_path, monkeypatch, spec, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_step.py").write_text(
        'def train_step(model, optimizer, x, y, dtype, scaler):\n    raise NotImplementedError("exercise")\n')
    with pytest.raises(NotImplementedError, match="train_step in my_step.py is not written yet"):
        sd.step_runs(spec, "my_step:train_step", tmp_path / "runs", steps=2)
    rows = sd.ladder(spec, [("base", {}), ("yours", {"precision": "bf16", "step": "my_step:train_step"})], steps=2,
                     read_ms=0.0, rounds=1)
    assert rows[1]["changes"] == {"precision": "bf16", "step": "my_step:train_step"} and rows[1]["samples_per_s"] > 0
    assert "my_step:train_step is not written yet" in capsys.readouterr().out
