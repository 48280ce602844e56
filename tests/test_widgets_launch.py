"""LaunchPanel headless: set the form's values, call what the buttons call, observe the Run and the plot data."""
from __future__ import annotations

import time

import pytest

from scalelab.errors import RunFailed, RunTimeout
from scalelab.widgets import LaunchPanel
from scalelab.widgets._plots import run_series

from helpers import processes_of

FAST = {"data.samples": 256, "world.threads_per_worker": 1}


@pytest.fixture
def panel(tmp_path):
    p = LaunchPanel(preset="tiny", out_dir=str(tmp_path), overrides=FAST, steps=6)
    yield p
    p.stop()


def test_the_form_starts_from_the_preset_and_follows_a_preset_change(panel):
    assert (panel.workers.value, panel.strategy.value, panel.launcher.value, panel.batch.value) == (1, "ddp", "local", 16)
    assert panel.steps.value == 6  # keyword values win over the preset
    panel.preset.value = "laptop"
    assert (panel.workers.value, panel.batch.value, panel.steps.value) == (2, 32, 200)
    assert panel.validate() is None and "ok: 2 ranks" in panel.message.value


@pytest.mark.parametrize("changes, field", [
    ({"strategy": "horovod"}, "launcher"),  # horovod ranks cannot be started by the local launcher
    ({"lr": 0.0}, "optim.lr"),
    ({"precision": "fp16"}, None),          # fp16 is valid on auto device; shown as ok
])
def test_validation_names_the_field_and_blocks_launch(panel, changes, field):
    for name, value in changes.items():
        panel.controls[name].value = value
    if field is None:
        assert panel.validate() is None and not panel.launch_button.disabled
        return
    message = panel.validate()
    assert message.startswith(field) and field in panel.message.value
    assert panel.launch_button.disabled


def test_launch_and_follow_fill_per_rank_series_and_save_the_figure(panel):
    panel.workers.value = 2
    run = panel.launch()
    assert panel.active and panel.launch_button.disabled and not panel.stop_button.disabled
    summary = panel.follow(timeout=120, every=0.2, show=False)
    assert summary["status"] == "succeeded" and run.status == "succeeded"
    data = panel.plot_data()
    assert sorted(data["loss"]) == [0, 1] and sorted(data["samples_per_s"]) == [0, 1]
    assert [s for s, _ in data["loss"][0]] == list(range(1, 7))
    assert all(v > 0 for pts in data["samples_per_s"].values() for _, v in pts)
    assert data["loss"][0][-1][1] == pytest.approx(summary["loss_curve"][-1])
    assert (run.run_dir / "panel.png").read_bytes()[:4] == b"\x89PNG"
    assert panel.plot.value[:4] == b"\x89PNG" and "succeeded" in panel.status.value
    assert not panel.launch_button.disabled and panel.stop_button.disabled


def test_the_launch_button_runs_and_watches_in_the_background(panel):
    panel.launch_button.click()  # fires the handler as a click in the browser would
    assert panel.run is not None
    panel._watcher.join(timeout=120)
    assert panel.run.status == "succeeded" and len(panel.series["loss"][0]) == 6


def test_stop_ends_the_run_and_every_process(panel):
    panel.steps.value = 100_000
    panel.workers.value = 2
    run = panel.launch()
    assert "starting" in panel.status.value and "of 2 ranks ready" in panel.status.value
    while not panel.series["loss"]:
        panel.refresh(draw=False)
        time.sleep(0.2)
    assert panel.ready == {0, 1}
    before = panel.plot.value
    panel.stop_button.click()
    assert run.status == "stopped" and not panel.active
    assert processes_of(run.run_dir) == []
    assert panel.plot.value != before and "stopped" in panel.figure().axes[0].get_title()  # redrawn: says stopped


def test_before_any_launch_the_plot_is_an_image_not_a_broken_icon(panel):
    assert panel.plot.value[:4] == b"\x89PNG" and panel.run is None


def test_the_loss_is_drawn_with_its_smoothed_trend():
    from scalelab.widgets._plots import run_figure, smooth
    assert smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected: no ramp from zero
    noisy = [2.0 - 0.01 * i + (0.5 if i % 2 else -0.5) for i in range(100)]
    trend = smooth(noisy)
    assert max(abs(a - b) for a, b in zip(trend[20:], trend[21:])) < 0.2  # far calmer than the 1.0 swings
    fig = run_figure({"loss": {0: list(enumerate(noisy))}, "samples_per_s": {0: [(1, 5.0)]}})
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "rank 0 (smoothed)" in labels


def test_a_failed_run_fails_follow_naming_the_rank(tmp_path):
    p = LaunchPanel(preset="tiny", out_dir=str(tmp_path), steps=6,
                    overrides={**FAST, "fault.kind": "raise", "fault.rank": 1, "fault.step": 2}, workers=2)
    p.launch()
    with pytest.raises(RunFailed) as info:
        p.follow(timeout=120, every=0.2, show=False)
    assert info.value.rank == 1 and "failed" in p.status.value


def test_follow_stops_a_run_that_outlives_its_timeout(panel):
    panel.steps.value = 100_000
    run = panel.launch()
    with pytest.raises(RunTimeout):
        panel.follow(timeout=3, every=0.2, show=False)
    assert run.status == "stopped"


def test_run_series_extends_incrementally_and_sorts_by_step():
    events = [{"type": "step", "rank": 1, "step": 2, "loss": 0.5, "samples_per_s": 10.0},
              {"type": "start", "rank": 0},
              {"type": "step", "rank": 1, "step": 1, "loss": 0.7, "samples_per_s": 9.0}]
    s = run_series(events)
    assert s == {"loss": {1: [(1, 0.7), (2, 0.5)]}, "samples_per_s": {1: [(1, 9.0), (2, 10.0)]}}
    run_series([{"type": "step", "rank": 0, "step": 1, "loss": 1.0, "samples_per_s": 5.0}], since=s)
    assert sorted(s["loss"]) == [0, 1]


def test_follow_redraws_the_panel_while_the_run_goes(tmp_path):
    # what a lab cell under Run All does: the panel shown above must move during the run, not only at its end
    p = LaunchPanel(preset="tiny", out_dir=str(tmp_path), overrides={**FAST, "fault.kind": "slow", "fault.rank": 0,
                                                                     "fault.step": 1, "fault.slow_s": 0.3}, steps=20)
    p.launch()
    p.follow(timeout=180, every=0.1, show=False, draw_every=0.2)
    assert p.run.status == "succeeded"
    assert p.draws >= 5, f"the plot was drawn {p.draws} times during a run of 20 slow steps"
