"""Lab 08's interval runs and the student's preemption handler, without a notebook: Daly's prediction and its
optimum, a faulty run's log (plausible, every second of it accounted), a run of fixed time (what is unsaved at its
end is lost), the sweep calling the student's accounting with the same fault times for every interval of a trial
(and stopping at an unsolved one), and the engine's Preemption taking a handler class from
SCALELAB_PREEMPT_HANDLER."""
from __future__ import annotations

import itertools
import math
import os
import random
import signal
import sys

import pytest

from scalelab.experiments import interval_runs as ir
from scalelab.experiments.resilience import daly_interval, young_interval
from scalelab.train.preempt import HANDLER_ENV, Preemption


def _lab08_hidden_checks():
    """Lab 08's hidden checks module: its `_accounted` is the grader's accounting of a faulty run's log (the
    reference of the lab's exercise 3), tested here against the engine's own logs."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "labs" / "08_resilience" / "hidden_checks.py"
    spec = importlib.util.spec_from_file_location("lab08_hidden_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


account = _lab08_hidden_checks()._accounted


def test_dalys_prediction_peaks_near_youngs_interval_and_falls_off_both_ways():
    c, m = 0.02, 0.6
    best = ir.daly_optimum(c, 0.0, m)
    assert abs(best - daly_interval(c, m)) < 0.1 * best and abs(best - young_interval(c, m)) < 0.2 * best
    peak = ir.predicted_fraction(best, c, 0.0, m)
    assert ir.predicted_fraction(best / 8, c, 0.0, m) < peak - 0.1
    assert ir.predicted_fraction(best * 5, c, 0.0, m) < peak - 0.1
    assert ir.predicted_fraction(best, c, 0.1, m) == pytest.approx(peak * math.exp(-0.1 / m))  # R scales it down


def test_a_faulty_run_logs_its_faults_and_restarts_and_every_second_is_accounted(tmp_path):
    run = ir.faulty_run(tmp_path / "run", 0.05, total_steps=150, mtbf_s=0.3, restart_s=0.02, seed=3, step_s=0.004)
    events = ir.read_log(run["log"])
    assert events[0]["type"] == "start" and events[-1]["type"] == "end"
    assert run["faults"] == sum(e["type"] == "fault" for e in events) > 0
    assert run["checkpoints"] == sum(e["type"] == "checkpoint" for e in events) > 0
    step = 0
    for e in events:  # steps one after another from each start (a restart resumes from the newest checkpoint)
        if e["type"] == "start":
            assert e["start_step"] in {0} | {c["step"] for c in events if c["type"] == "checkpoint"}
            step = e["start_step"]
        elif e["type"] == "step":
            assert e["step"] == step + 1
            step = e["step"]
    assert step == 150 == events[-1]["step"] and events[-2] == {**events[-2], "type": "checkpoint", "step": 150}
    parts = account(events)  # a run of fixed work: its last step saved by a final checkpoint
    spent = parts["useful_s"] + parts["lost_s"] + parts["checkpoint_s"] + parts["restart_s"]
    assert parts["lost_s"] > 0 and 0.7 * parts["wall_s"] < spent <= parts["wall_s"] * 1.001
    assert parts["useful_s"] == pytest.approx(sum(e["step_s"] for e in events if e["type"] == "step")
                                              - parts["lost_s"])
    assert not list((tmp_path / "run").glob("checkpoint.pt*"))  # its checkpoint files are gone at the end


def test_without_faults_a_run_checkpoints_once_per_interval_of_work(tmp_path):
    run = ir.faulty_run(tmp_path / "run", 0.02, total_steps=40, mtbf_s=1e9, restart_s=0.0, step_s=0.004)
    events = ir.read_log(run["log"])
    assert run["faults"] == 0 and run["checkpoints"] > 0
    work, last = 0.0, 0.0
    for e in events:  # a checkpoint once the work since the last one reached the interval, not a step later
        if e["type"] == "step":
            work, last = work + e["step_s"], e["step_s"]
        elif e["type"] == "checkpoint" and e["step"] < 40:  # the last: the final save
            assert work >= 0.02 > work - last
            work = 0.0
    assert account(events)["lost_s"] == 0


def test_a_run_of_fixed_time_loses_what_is_unsaved_when_its_time_is_up(tmp_path):
    run = ir.faulty_run(tmp_path / "run", 0.1, window_s=0.3, mtbf_s=1e9, restart_s=0.0, step_s=0.004)
    events = ir.read_log(run["log"])
    steps = [e for e in events if e["type"] == "step"]
    assert events[-1]["type"] == "end" and events[-1]["step"] == steps[-1]["step"] and 0.3 <= run["wall_s"] < 0.5
    saved = max(e["step"] for e in events if e["type"] == "checkpoint")
    assert saved < steps[-1]["step"]  # the steps after the last checkpoint: not saved when the time was up
    parts = account(events)
    assert parts["lost_s"] == pytest.approx(sum(e["step_s"] for e in steps if e["step"] > saved))
    assert parts["useful_s"] == pytest.approx(sum(e["step_s"] for e in steps if e["step"] <= saved))


def test_the_sweep_accounts_each_run_with_the_students_function_and_stops_at_an_unsolved_one(tmp_path, monkeypatch):
    found = ir.sweep(tmp_path / "a", [0.02, 0.1], account, mtbf_s=0.15, window_s=0.4, trials=2, say=None)
    assert [r["interval_s"] for r in found["rows"]] == [0.02, 0.1] and found["error"] is None
    for row in found["rows"]:
        parts = [account(ir.read_log(f"{run}/faults.jsonl")) for run in row["runs"]]
        assert len(parts) == 2 and row["fractions"] == pytest.approx([p["useful_s"] / p["wall_s"] for p in parts])
        assert row["fraction"] == pytest.approx(sum(p["useful_s"] for p in parts) / sum(p["wall_s"] for p in parts))
    for k in range(2):  # common random numbers: trial k struck every interval at seed k's times on its clock
        rng = random.Random(k)
        drawn = list(itertools.accumulate(rng.expovariate(1 / 0.15) for _ in range(100)))
        for row in found["rows"]:
            log = ir.read_log(f"{row['runs'][k]}/faults.jsonl")
            seen = [e["t"] - log[0]["t"] for e in log if e["type"] == "fault"]
            assert seen and all(d - 0.02 <= t <= d + 0.3 for t, d in zip(seen, drawn)), (seen, drawn[:len(seen)])
    (tmp_path / "my_unsolved.py").write_text("def useful_work(events):\n    raise NotImplementedError('exercise')\n")
    monkeypatch.chdir(tmp_path)
    said = []
    found = ir.sweep(tmp_path / "b", [0.02, 0.1], "my_unsolved:useful_work", mtbf_s=0.3, window_s=0.3,
                     say=said.append)
    assert found["error"].startswith("not implemented yet") and found["best_interval_s"] is None
    assert len(found["rows"]) == 1 and found["rows"][0]["fraction"] is None and "not implemented" in said[-1]


def test_the_engine_takes_a_preemption_handler_of_the_students_own(tmp_path, monkeypatch):
    (tmp_path / "my_handler.py").write_text(
        "import signal\n\n\nclass Handler:\n    def __init__(self):\n        self.signal = None\n"
        "        signal.signal(signal.SIGUSR1, self.note)\n\n    def note(self, signum, frame):\n"
        "        self.signal = signal.Signals(signum).name\n\n    def agreed(self, device):\n"
        "        self.device = device\n        return self.signal is not None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(HANDLER_ENV, "my_handler:Handler")
    before = signal.getsignal(signal.SIGUSR1)
    try:
        p = Preemption(True)
        strategy = type("S", (), {"backend": "gloo", "device": "cuda:0"})()
        assert type(p.handler).__name__ == "Handler" and p.signal is None and not p.agreed(strategy)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.agreed(strategy) and p.signal == "SIGUSR1" and p.handler.device == "cpu"  # gloo votes on the CPU
        assert not Preemption(False).agreed(strategy)  # off unless checkpoint.on_signal
    finally:
        signal.signal(signal.SIGUSR1, before)
        sys.modules.pop("my_handler", None)
