"""Profiling: traces per rank, the comm/compute overlap read from them, and the Timeline widget drawn from them."""
from __future__ import annotations

import json
import shutil

import pytest

from scalelab import launch
from scalelab.errors import SpecError
from scalelab.experiments.profiling import (horovod_timeline, load_trace, merge, overlap_by_rank, overlap_seconds,
                                            run_timeline, timeline_lanes, trace_intervals)
from scalelab.run.spec import preset
from scalelab.train.profiling import PHASES, horovod_timeline_path, trace_path

from helpers import tiny

# an mlp of about 0.65 M parameters (2.6 MB of gradients): DDP's first bucket holds 1 MB, so every step sends at
# least two bucket all-reduces, the first while backward is still computing the earlier layers' gradients
PROFILED = {"model.name": "mlp", "model.width": 512, "model.depth": 3, "data.samples": 256, "steps": 5,
            "profile.enabled": True, "profile.wait_steps": 1, "profile.warmup_steps": 1, "profile.active_steps": 3}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """A 2-rank DDP run with profiling on (about 4 s)."""
    tmp = tmp_path_factory.mktemp("profiled")
    run = launch(tiny(tmp, "ddp", **PROFILED))
    run.wait(timeout=180)
    return run


def test_a_profiled_ddp_run_writes_a_trace_per_rank_that_loads(ddp_run):
    for rank in (0, 1):
        trace = load_trace(trace_path(ddp_run.run_dir, rank))
        iv = trace_intervals(trace, rank)
        assert [n for n, _, _ in iv["steps"]] == [2, 3, 4]  # wait 1, warm-up 1, then the 3 active steps
        assert {p for p, _, _ in iv["phases"]} == set(PHASES)
        assert iv["compute"]
    traced = [e for e in ddp_run.events() if e["type"] == "trace"]
    assert sorted(e["rank"] for e in traced) == [0, 1] and traced[0]["first_step"] == 3


def test_ddp_buckets_overlap_backward_in_the_trace(ddp_run):
    summary = overlap_by_rank(ddp_run.run_dir)
    assert sorted(summary) == [0, 1]
    for rank, s in summary.items():
        assert s["collectives"].get("all_reduce", 0) >= 2 * 3, (rank, s)  # several buckets in each active step
        assert s["comm_s"] > 0 and 0 < s["overlap"] <= 1, (rank, s)
        assert s["overlapped_s"] == pytest.approx(s["overlap"] * s["comm_s"])
    # the first bucket's all-reduce starts inside backward: backward is still running when it is sent
    iv = trace_intervals(load_trace(trace_path(ddp_run.run_dir, 0)), 0)
    backward = [(a, b) for p, a, b in iv["phases"] if p == "backward"]
    assert any(a < c0 < b for a, b in backward for _, c0, _, _ in iv["comm"])


def test_overlap_counts_only_the_time_comm_and_compute_share():
    assert merge([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert overlap_seconds([(0, 4)], [(1, 2), (3, 10)]) == pytest.approx(2.0)
    assert overlap_seconds([(0, 1)], [(1, 2)]) == 0.0
    assert overlap_seconds([(0, 2), (1, 3)], [(0, 3)]) == pytest.approx(3.0)  # comm in flight twice counts once


def test_the_timeline_widget_renders_a_profiled_run_headless(ddp_run):
    from scalelab.widgets import Timeline
    tl = Timeline(ddp_run)
    assert sorted(tl.lanes) == [0, 1]
    for lane in tl.lanes.values():
        assert lane["source"] == "trace"
        assert set(PHASES) <= {p for p, _, _ in lane["phases"]}
        assert {k for k, _, _ in lane["comm"]} == {"all_reduce"}
    assert tl.render("png").startswith(b"\x89PNG") and b"<svg" in tl.render("svg")
    assert "overlap" in tl.table.value and "all_reduce x" in tl.table.value
    labels = [t.get_text() for t in tl.fig.axes[0].get_legend().get_texts()]
    assert set(labels) >= {"forward", "backward", "optimizer", "all-reduce"}


def test_the_timeline_falls_back_to_step_events_without_traces(ddp_run, tmp_path):
    shutil.copytree(ddp_run.run_dir / "events", tmp_path / "events")
    lanes = timeline_lanes(run_timeline(tmp_path))
    assert sorted(lanes) == [0, 1]
    assert all(lane["source"] == "events" and lane["comm"] for lane in lanes.values())
    assert {p for p, _, _ in lanes[0]["phases"]} == {"data", "compute"}
    from scalelab.widgets import Timeline
    tl = Timeline(tmp_path)
    assert tl.summary == {} and "no traces" in tl.table.value


@pytest.mark.horovod
def test_a_profiled_horovod_run_writes_the_horovod_timeline(tmp_path):
    run = launch(tiny(tmp_path, "hvd", strategy="horovod", launcher="horovodrun",
                      **{**PROFILED, "model.width": 64}))
    run.wait(timeout=180)
    hvd = horovod_timeline(horovod_timeline_path(run.run_dir))
    names = {s[0] for s in hvd["spans"]}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= names and hvd["cycles"]
    assert trace_path(run.run_dir, 1).exists()
    from scalelab.widgets import Timeline
    assert len(Timeline(run).fig.axes) == 2  # the ranks' phases, and Horovod's coordinator below


def test_a_fsdp_trace_shows_all_gathers_and_reduce_scatters(tmp_path):
    run = launch(tiny(tmp_path, "fsdp", strategy="fsdp", **{**PROFILED, "model.width": 64}))
    run.wait(timeout=180)
    kinds = overlap_by_rank(run.run_dir)[0]["collectives"]
    assert kinds.get("all_gather") and kinds.get("reduce_scatter"), kinds


@pytest.mark.parametrize("change, field, hint", [
    ({"profile.active_steps": 0}, "profile.active_steps", "at least 1"),
    ({"profile.wait_steps": -1}, "profile.wait_steps", "at least 0"),
    ({"profile.enabled": "yes"}, "profile.enabled", "true or false"),
    ({"profile.enabled": True, "steps": 4}, "profile.active_steps", "raise steps"),
    ({"profile.enabled": True, "strategy": "horovod", "launcher": "horovodrun", "world.max_restarts": 1},
     "profile.enabled", "world.max_restarts=0"),
])
def test_a_bad_profile_field_names_the_field_and_the_fix(change, field, hint):
    with pytest.raises(SpecError) as err:
        preset("tiny").with_overrides(change)
    assert err.value.field == field and hint in str(err.value)


def test_an_unknown_profile_field_lists_the_known_ones():
    with pytest.raises(SpecError, match="known fields of profile: enabled, wait_steps"):
        preset("tiny").with_overrides(["profile.active=3"])


def test_a_truncated_trace_is_reported_with_what_to_check(tmp_path):
    bad = tmp_path / "rank-0.json"
    bad.write_text(json.dumps({"traceEvents": []})[:-3])
    with pytest.raises(ValueError, match="profile.enabled=true"):
        load_trace(bad)
