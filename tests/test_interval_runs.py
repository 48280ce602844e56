"""Lab 08's interval runs and the student's preemption handler, without a notebook: Daly's prediction and its
optimum, a faulty run's log (plausible, every second of it accounted), the sweep calling the student's accounting
(and stopping at an unsolved one), and the engine's Preemption taking a handler class from SCALELAB_PREEMPT_HANDLER."""
from __future__ import annotations

import math
import os
import signal
import sys

import pytest

from scalelab.experiments import interval_runs as ir
from scalelab.experiments.resilience import daly_interval, young_interval
from scalelab.train.preempt import HANDLER_ENV, Preemption


def account(events):
    """The reference accounting (the lab's exercise 3)."""
    useful = lost = checkpoint = restart = unsaved = 0.0
    fault_t = None
    for e in events:
        if e["type"] == "step":
            unsaved += e["step_s"]
        elif e["type"] == "checkpoint":
            useful, unsaved, checkpoint = useful + unsaved, 0.0, checkpoint + e["blocked_s"]
        elif e["type"] == "fault":
            lost, unsaved = lost + unsaved, 0.0
            fault_t = e["t"] if fault_t is None else fault_t
        elif e["type"] == "start" and fault_t is not None:
            restart, fault_t = restart + e["t"] - fault_t, None
        elif e["type"] == "end":
            useful, unsaved = useful + unsaved, 0.0
    return {"wall_s": events[-1]["t"] - events[0]["t"], "useful_s": useful, "lost_s": lost,
            "checkpoint_s": checkpoint, "restart_s": restart}


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
    assert step == 150
    parts = account(events)
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
        elif e["type"] == "checkpoint":
            assert work >= 0.02 > work - last
            work = 0.0
    assert account(events)["lost_s"] == 0


def test_the_sweep_accounts_each_run_with_the_students_function_and_stops_at_an_unsolved_one(tmp_path, monkeypatch):
    found = ir.sweep(tmp_path / "a", [0.02, 0.1], account, mtbf_s=0.3, work_s=0.3, say=None)
    assert [r["interval_s"] for r in found["rows"]] == [0.02, 0.1] and found["error"] is None
    for row in found["rows"]:
        parts = account(ir.read_log(f"{row['runs'][0]}/faults.jsonl"))
        assert row["fraction"] == pytest.approx(parts["useful_s"] / parts["wall_s"])
    (tmp_path / "my_unsolved.py").write_text("def useful_work(events):\n    raise NotImplementedError('exercise')\n")
    monkeypatch.chdir(tmp_path)
    said = []
    found = ir.sweep(tmp_path / "b", [0.02, 0.1], "my_unsolved:useful_work", mtbf_s=0.3, work_s=0.3, say=said.append)
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
