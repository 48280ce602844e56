"""scalelab.experiments.optimization's time to accuracy on N ranks: steps to the target from the in-process race at
global batch B, times the step time of engine runs at B on N ranks, read from those runs' own events; and the race
on a small conv net, whose layers K-FAC preconditions with convolution factors."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from scalelab.experiments import optimization as opt
from scalelab.run.spec import preset

DIGITS = preset("tiny").with_overrides({"data.source": "digits", "model.name": "mlp", "model.width": 32,
                                        "model.depth": 1})


def _race_row(label, optimizer, batch, steps):
    return {"label": label, "optimizer": optimizer, "batch": batch, "lr": 0.1, "set": {},
            "reached": {"steps": steps, "samples": steps * batch, "seconds": 0.0} if steps else None}


def test_time_on_ranks_is_the_races_steps_times_each_runs_step_time():
    race = [_race_row("sgd b32", "sgd", 32, 120), _race_row("kfac", "kfac", 128, 15),
            _race_row("sgd b512", "sgd", 512, None)]
    times = [{"label": "sgd b32", "optimizer": "sgd", "batch": 32, "ranks": 1, "step_s": 0.002, "run_dir": "a"},
             {"label": "sgd b32", "optimizer": "sgd", "batch": 32, "ranks": 2, "step_s": 0.004, "run_dir": "b"},
             {"label": "kfac", "optimizer": "kfac", "batch": 128, "ranks": 2, "step_s": 0.02, "run_dir": "c"},
             {"label": "sgd b512", "optimizer": "sgd", "batch": 512, "ranks": 2, "step_s": 0.01, "run_dir": "d"}]
    rows = opt.time_to_accuracy_on_ranks(race, times)
    assert [(r["label"], r["ranks"]) for r in rows] == [(t["label"], t["ranks"]) for t in times]
    assert [r["steps"] for r in rows] == [120, 120, 15, None]  # the steps depend on B, not on N
    assert rows[0]["seconds"] == pytest.approx(0.24) and rows[1]["seconds"] == pytest.approx(0.48)
    assert rows[2]["seconds"] == pytest.approx(0.3) and rows[3]["seconds"] is None  # never reached: no time
    assert rows[2]["run_dir"] == "c"


def test_a_step_time_of_another_run_than_the_races_is_refused():
    race = [_race_row("kfac", "kfac", 128, 15)]
    with pytest.raises(ValueError, match="did not run"):
        opt.time_to_accuracy_on_ranks(race, [{"label": "lamb", "optimizer": "lamb", "batch": 128, "ranks": 1,
                                              "step_s": 0.1}])
    with pytest.raises(ValueError, match="batch 64"):
        opt.time_to_accuracy_on_ranks(race, [{"label": "kfac", "optimizer": "kfac", "batch": 64, "ranks": 1,
                                              "step_s": 0.1}])


def test_engine_step_time_is_rank_0s_mean_without_its_first_step_and_the_loaders_waits():
    events = [{"type": "start", "rank": 0}] + [
        {"type": "step", "rank": r, "step": s, "step_s": (0.5 if s == 1 else 0.01 * s) + r, "data_s": 0.0}
        for r in (0, 1) for s in range(1, 7)] + [{"type": "step", "rank": 0, "step": 7, "step_s": 0.9, "data_s": 0.83}]
    assert opt.engine_step_s(events) == pytest.approx((0.02 + 0.03 + 0.04 + 0.05 + 0.06 + 0.07) / 6)
    with pytest.raises(ValueError, match="no step events"):
        opt.engine_step_s([{"type": "start", "rank": 0}])


def test_step_times_come_from_engine_runs_on_each_rank_count(tmp_path):
    """Engine runs (DDP, the facade's launch) of the reached rows only, at B / N per rank and N ranks, as their
    evidence shows; step_s is rank 0's mean step_s - data_s in the run's own event file, first step left out."""
    from scalelab.grade.evidence import RUNS, relative_run_dir, run_evidence
    race = [_race_row("sgd b32", "sgd", 32, 20), _race_row("sgd b64", "sgd", 64, None)]
    rows = opt.step_times_on_ranks(DIGITS, race, ranks=[1, 2], out_dir=tmp_path / "runs", steps=4)
    assert [(r["label"], r["ranks"]) for r in rows] == [("sgd b32", 1), ("sgd b32", 2)]
    found = run_evidence(tmp_path)[RUNS]
    for row in rows:
        assert f"sgd-b32-n{row['ranks']}" in row["run_dir"]
        ev = found[relative_run_dir(row["run_dir"], str(tmp_path))]
        assert ev["world_size"] == row["ranks"] and ev["global_batch"] == 32 and ev["total_steps"] == 4
        assert not ev["implausible"]
        lines = (Path(row["run_dir"]) / "events" / "rank-0.jsonl").read_text().splitlines()
        steps = [e for e in map(json.loads, lines) if e["type"] == "step"]
        assert len(steps) == 4
        assert row["step_s"] == pytest.approx(statistics.mean(e["step_s"] - e["data_s"] for e in steps[1:]))


def test_the_race_runs_on_a_conv_net_and_kfac_preconditions_its_convolutions():
    """K-FAC on the small CNN (Conv2d factors: im2col rows for A, per-position output gradients for G) trains and
    reaches the target in fewer steps than SGD at the same batch."""
    cnn = DIGITS.with_overrides({"model.name": "cnn", "model.width": 8, "model.depth": 2})
    rows = opt.time_to_target(cnn, [{"label": "sgd", "optimizer": "sgd", "batch": 128, "lr": 0.1},
                                    {"label": "kfac", "optimizer": "kfac", "batch": 128, "lr": 0.1,
                                     "set": {"optim.kfac_inv_every": 5}}], target=0.7, samples=128 * 60)
    sgd, kfac = rows
    assert kfac["set"] == {"optim.kfac_inv_every": 5}
    assert kfac["reached"], f"K-FAC on the CNN ended at {kfac['final_accuracy']:.3f}"
    assert sgd["reached"] is None or kfac["reached"]["steps"] < sgd["reached"]["steps"]


class _FakeRun:
    """A run that ends after `polls` polls; `log` records (event, index) as runs start and end."""

    def __init__(self, index, polls, log):
        self.index, self.polls, self.log = index, polls, log
        log.append(("start", index))

    def poll(self):
        self.polls -= 1
        if self.polls == 0:
            self.log.append(("end", self.index))
        return "running" if self.polls > 0 else "succeeded"

    def events(self):
        return []

    def wait(self, timeout=None):
        self.log.append(("waited", self.index))
        return {}

    def stop(self):
        self.log.append(("stop", self.index))


def test_runs_go_side_by_side_up_to_the_process_budget_the_next_as_one_ends():
    log = []
    todo = [(2, (0, 3)), (1, (1, 1)), (1, (2, 5)), (2, (3, 1)), (1, (4, 1))]  # (ranks, (index, polls to end))
    done = [i for i, _ in opt._side_by_side(todo, 4, 60, lambda spec: _FakeRun(*spec, log))]
    assert sorted(done) == [0, 1, 2, 3, 4]
    running, most = set(), 0
    for event, i in log:
        running = running | {i} if event == "start" else running - {i}
        most = max(most, sum(todo[j][0] for j in running))
    assert most <= 4 and [i for e, i in log if e == "start"][:3] == [1, 2, 4]  # fewest ranks first
    assert log.index(("start", 0)) < log.index(("end", 2))  # started when run 1 ended, not when run 2 did
    assert {i for e, i in log if e == "waited"} == set(range(5))  # every run waited for: no process left behind
