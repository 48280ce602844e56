"""scalelab.experiments.single_device: each measurement does what its name says, on the engine's workload."""
from __future__ import annotations

import json
import time

import pytest

from scalelab.experiments import single_device as sd
from scalelab.run.spec import preset


@pytest.fixture
def spec():
    return preset("tiny").with_overrides({"optim.batch_per_worker": 16, "data.samples": 256})


def test_slow_reads_wait_per_sample_and_return_the_same_samples(spec):
    from scalelab.data import build_dataset
    base = build_dataset(spec.data, spec.seed)
    slow = sd.SlowReads(base, read_ms=5)
    t0 = time.perf_counter()
    x, y = slow[3]
    assert time.perf_counter() - t0 >= 0.005
    assert (x == base[3][0]).all() and y == base[3][1] and len(slow) == len(base)
    t0 = time.perf_counter()
    batch = slow.__getitems__([1, 2, 3, 4])  # what the DataLoader calls: one wait for the batch's four samples
    assert time.perf_counter() - t0 >= 0.02
    assert len(batch) == 4 and all((b[0] == base[i][0]).all() for b, i in zip(batch, [1, 2, 3, 4]))


def test_measure_reports_each_mode_and_rejects_unknown_ones(spec):
    for mode in sd.MODES:
        m = sd.measure(spec, mode, steps=3, warmup=1)
        assert m["mode"] == mode and m["samples_per_s"] > 0 and m["batch"] == 16
    with pytest.raises(ValueError, match="mode"):
        sd.measure(spec, "io")


def test_storage_latency_bounds_the_data_rate_and_workers_lift_it(spec):
    # 4 ms per sample: one process delivers at most 250 samples/s, four workers up to four times that (the
    # margin is wide because a loaded 2-core machine delays every wake-up from sleep)
    slow = sd.measure(spec, "data", steps=4, warmup=1, read_ms=4)["samples_per_s"]
    assert slow < 250
    rows = sd.loader_sweep(spec.with_overrides({"optim.batch_per_worker": 8}), workers=(0, 4), steps=8, read_ms=4,
                           warmup=4)
    assert [r["workers"] for r in rows] == [0, 4]
    assert rows[1]["samples_per_s"] > 1.3 * rows[0]["samples_per_s"]


def test_compute_only_is_the_same_training_step_from_the_same_start(spec):
    a = sd.measure(spec, "compute", steps=3, warmup=0)
    b = sd.measure(spec, "compute", steps=3, warmup=0)
    assert a["loss"] == b["loss"]  # same seed, same synthetic batch, same model: deterministic


def test_precision_compare_gives_speedups_against_the_first_precision(spec):
    rows = sd.precision_compare(spec, ("fp32", "bf16"), steps=3, warmup=1)
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    assert rows[0]["speedup"] == 1.0 and rows[0]["loss_diff"] == 0.0
    assert rows[1]["speedup"] == pytest.approx(rows[1]["samples_per_s"] / rows[0]["samples_per_s"])
    assert rows[1]["loss_diff"] < 0.05


def test_try_compile_records_a_failure_instead_of_raising(spec):
    out = sd.try_compile(spec, backend="no-such-backend", steps=2, warmup=0)
    assert out["ok"] is False and out["error"] and out["eager_samples_per_s"] > 0


def test_profile_saves_a_chrome_trace_and_sorted_ops(spec, tmp_path):
    prof = sd.profile_steps(spec, tmp_path / "t" / "trace.json", steps=2, warmup=1)
    trace = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert prof["trace_events"] == len(trace["traceEvents"]) > 0
    selfs = [op["self_ms"] for op in prof["ops"]]
    assert selfs == sorted(selfs, reverse=True) and sum(selfs) <= prof["self_ms_total"] + 1e-9
    assert any("conv" in op["name"] for op in prof["ops"])


def test_ladder_accumulates_changes_and_reports_speedup_and_gain(spec):
    rows = sd.ladder(spec, [("base", {}), ("workers", {"data.loader_workers": 1}),
                            ("batch", {"optim.batch_per_worker": 32})], steps=3, read_ms=0.5, warmup=1)
    assert rows[2]["changes"] == {"data.loader_workers": 1, "optim.batch_per_worker": 32}
    assert rows[0]["speedup"] == 1.0
    for prev, row in zip(rows, rows[1:]):
        assert row["speedup"] == pytest.approx(row["samples_per_s"] / rows[0]["samples_per_s"])
        assert row["gain"] == pytest.approx(row["samples_per_s"] / prev["samples_per_s"])


def test_the_loader_sweep_interleaves_its_rounds_and_keeps_each_counts_best(spec, monkeypatch):
    # a burst of load lands on one measurement: the sweep must not let it decide the comparison
    calls, rates = [], iter([100.0, 90.0, 100.0, 400.0, 100.0, 380.0])  # round 1: 4 workers slowed to 90
    def fake(s, mode, steps, warmup, read_ms, timer=None):
        calls.append(s.data.loader_workers)
        return {"samples_per_s": next(rates)}
    monkeypatch.setattr(sd, "measure", fake)
    rows = sd.loader_sweep(spec, workers=(0, 4), steps=3, read_ms=1, rounds=3)
    assert calls == [0, 4, 0, 4, 0, 4]
    assert rows == [{"workers": 0, "samples_per_s": 100.0}, {"workers": 4, "samples_per_s": 400.0}]


def test_the_ladder_interleaves_its_rounds_and_keeps_each_rungs_best(spec, monkeypatch):
    # CI graded a 4x ladder as 1.28x: load landed on the last rung's only measurement
    calls, rates = [], iter([100.0, 120.0, 100.0, 400.0])  # round 1: the workers rung slowed to 120
    def fake(s, mode, steps, warmup, read_ms, compile_backend=None, timer=None, step=None):
        calls.append((s.data.loader_workers, compile_backend))
        return {"samples_per_s": next(rates)}
    monkeypatch.setattr(sd, "measure", fake)
    rows = sd.ladder(spec, [("base", {}), ("workers", {"data.loader_workers": 4, "compile": "eager"})],
                     steps=3, read_ms=1, rounds=2)
    assert calls == [(0, None), (4, "eager"), (0, None), (4, "eager")]
    assert [r["samples_per_s"] for r in rows] == [100.0, 400.0] and rows[1]["speedup"] == 4.0
    assert rows[1]["changes"] == {"data.loader_workers": 4, "compile": "eager"}
