"""scalelab.sweep (specs, sequential runs, speedup/efficiency table, time breakdown) and ScalingExplorer headless."""
from __future__ import annotations

import pytest

from scalelab.errors import SpecError
from scalelab.run.spec import preset
from scalelab.experiments.sweep import (SweepStopped, format_table, run_sweep, scaling_table, spec_key, sweep_specs,
                                        time_breakdown)
from scalelab.widgets import ScalingExplorer

FAST = {"data.samples": 256, "world.threads_per_worker": 1, "steps": 6}


def _summary(sps, data=0.1, compute=0.9, comm=0.0, world=1):
    return {"samples_per_s": sps, "per_rank_samples_per_s": [sps / world] * world, "final_loss": 1.0,
            "time_fraction": {"data": data, "compute": compute, "comm": comm}}


def test_weak_specs_keep_the_batch_per_worker_and_strong_specs_split_the_global_batch(tmp_path):
    base = preset("tiny")
    weak = sweep_specs(base, "weak", workers=[1, 2, 4], out_dir=tmp_path)
    assert [(s.world_size, s.optim.batch_per_worker, s.global_batch) for s in weak] == [(1, 16, 16), (2, 16, 32),
                                                                                          (4, 16, 64)]
    strong = sweep_specs(base, "strong", workers=[1, 2, 4], global_batch=64, out_dir=tmp_path)
    assert [(s.world_size, s.global_batch) for s in strong] == [(1, 64), (2, 64), (4, 64)]
    batch = sweep_specs(base, "batch", batches=[8, 32], out_dir=tmp_path)
    assert [s.optim.batch_per_worker for s in batch] == [8, 32]
    assert len({s.output_dir for s in weak + strong + batch}) == 8  # every run has its own folder
    assert all(s.output_dir.startswith(str(tmp_path)) for s in weak)


@pytest.mark.parametrize("kwargs, field", [({"mode": "diagonal"}, "mode"),
                                           ({"mode": "strong", "workers": [1, 3], "global_batch": 64}, "global_batch"),
                                           ({"mode": "weak", "workers": [0]}, "world.workers_per_node")])
def test_impossible_sweeps_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as info:
        sweep_specs(preset("tiny"), **kwargs)
    assert info.value.field == field


def test_scaling_table_computes_speedup_against_the_first_run_and_efficiency_against_ideal(tmp_path):
    specs = sweep_specs(preset("tiny"), "weak", workers=[1, 2, 4], out_dir=tmp_path)
    rows = scaling_table(specs, [_summary(100), _summary(180, world=2), _summary(300, world=4)], "weak")
    assert [r["speedup"] for r in rows] == [1.0, 1.8, 3.0]
    assert [r["ideal_speedup"] for r in rows] == [1.0, 2.0, 4.0]
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.9, 0.75])
    assert rows[1]["step_s"] == pytest.approx(32 / 180)
    batch = scaling_table(sweep_specs(preset("tiny"), "batch", batches=[8, 16], out_dir=tmp_path),
                          [_summary(100), _summary(150)], "batch")
    assert batch[1]["ideal_speedup"] == 1.0 and batch[1]["efficiency"] == 1.5
    text = format_table(rows)
    assert "speedup" in text and len(text.splitlines()) == 5


def test_time_breakdown_adds_up_to_one_and_takes_overlapped_comm_out_of_compute():
    assert time_breakdown(_summary(1, 0.1, 0.6, 0.3)) == pytest.approx({"data": 0.1, "compute": 0.6, "comm": 0.3})
    ddp = time_breakdown(_summary(1, 0.1, 0.9, 0.4))  # DDP: comm measured while backward still computes
    assert sum(ddp.values()) == pytest.approx(1.0) and ddp["compute"] == pytest.approx(0.5)
    assert sum(time_breakdown({"time_fraction": {}}).values()) == 0.0


def test_run_sweep_runs_in_order_reuses_cached_runs_and_can_be_stopped(tmp_path):
    base = preset("tiny").with_overrides(FAST)
    weak = sweep_specs(base, "weak", workers=[1, 2], out_dir=tmp_path / "w")
    cache, seen = {}, []
    summaries = run_sweep(weak, timeout=120, on_result=lambda i, s, r: seen.append((i, s.world_size)), cache=cache)
    assert seen == [(0, 1), (1, 2)] and [s["world_size"] for s in summaries] == [1, 2]
    assert all(s["status"] == "succeeded" for s in summaries)
    # the strong sweep at global batch 32 shares the 2-worker run (2 x 16) with the weak one
    strong = sweep_specs(base, "strong", workers=[2], global_batch=32, out_dir=tmp_path / "s")
    assert spec_key(strong[0]) == spec_key(weak[1])
    assert run_sweep(strong, cache=cache)[0] is summaries[1]
    assert not (tmp_path / "s").exists()  # reused, not rerun

    def stop(i, spec, summary):
        raise SweepStopped("enough")
    with pytest.raises(SweepStopped) as info:
        run_sweep(sweep_specs(base, "batch", batches=[8, 32], out_dir=tmp_path / "b"), on_result=stop)
    assert len(info.value.summaries) == 1 and not (tmp_path / "b" / "sweep-batch-1w-32b").exists()


def test_scaling_explorer_validates_runs_plots_and_keeps_history(tmp_path):
    ex = ScalingExplorer(preset="tiny", out_dir=str(tmp_path), overrides={"data.samples": 256,
                                                                          "world.threads_per_worker": 1}, steps=6)
    ex.workers.value = "1, x"
    assert ex.validate().startswith("workers") and ex.run_button.disabled
    ex.mode.value, ex.workers.value, ex.global_batch.value = "strong", "1, 3", 32
    assert ex.validate().startswith("global_batch")
    ex.mode.value, ex.workers.value = "weak", "1, 2"
    assert ex.validate() is None and "2 runs" in ex.message.value
    rows = ex.run(timeout=120)
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["speedup"] == 1.0
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"]))
    assert ex.plot.value[:4] == b"\x89PNG" and "speedup" in ex.table.value and ex.plot.layout.display is None
    assert ex.save_figure(tmp_path / "f.png").endswith("f.png") and (tmp_path / "f.png").stat().st_size > 1000
    ex.mode.value, ex.global_batch.value = "strong", 32
    ex.run_button.click()  # the button runs the sweep in a thread; 2 x 16 is reused from the weak sweep
    ex._thread.join(timeout=180)
    assert [h["mode"] for h in ex.history] == ["weak", "strong"] and ex.rows[1]["batch_per_worker"] == 16
    assert "done" in ex.progress.value


def test_the_explorer_opens_only_the_fields_its_mode_uses(tmp_path):
    ex = ScalingExplorer(preset="tiny", out_dir=str(tmp_path))
    assert ex.plot.layout.display == "none"  # no empty image (a broken icon) before the first sweep
    ex.mode.value = "weak"
    assert not ex.workers.disabled and ex.batches.disabled and ex.global_batch.disabled
    ex.mode.value = "batch"
    assert ex.workers.disabled and not ex.batches.disabled and ex.global_batch.disabled
    ex.mode.value = "strong"
    assert not ex.workers.disabled and ex.batches.disabled and not ex.global_batch.disabled


def test_an_efficiency_above_one_is_drawn_with_a_note_saying_what_it_is():
    from scalelab.widgets._plots import efficiency_note, scaling_figure
    rows = [{"workers": 1, "speedup": 1.0, "ideal_speedup": 1, "efficiency": 1.0, "time_fraction": {"compute": 1}},
            {"workers": 2, "speedup": 2.64, "ideal_speedup": 2, "efficiency": 1.32, "time_fraction": {"compute": 1}}]
    note = efficiency_note(rows)
    assert "efficiency 1.32 > 1" in note and "warm-up" in note
    texts = [t.get_text() for t in scaling_figure(rows).axes[1].texts]
    assert note in texts
    rows[1]["efficiency"] = 0.9
    assert efficiency_note(rows) == "" and not scaling_figure(rows).axes[1].texts
