"""Profiling: traces per rank, the comm/compute overlap read from them, and the Timeline widget drawn from them."""
from __future__ import annotations

import json
import shutil

import pytest

from scalelab import launch, run_spmd
from scalelab.errors import SpecError, UntrustedFileError
from scalelab.experiments.ddp_internals import timeline_record
from scalelab.experiments.horovod_port import fusion_summary, horovod_timeline_text
from scalelab.experiments.profiling import (horovod_timeline, load_trace, merge, overlap_by_rank, overlap_ratio,
                                            overlap_seconds, read_run_file, run_timeline, subtract, timeline_lanes,
                                            trace_intervals)
from scalelab.experiments.single_device import phase_shares
from scalelab.run.spec import preset
from scalelab.train.profiling import PHASES, horovod_timeline_path, trace_path

from helpers import tiny

# an mlp of about 0.65 M parameters (2.6 MB of gradients): DDP's first bucket holds 1 MB, so every step sends at
# least two bucket all-reduces, the first while backward is still computing the earlier layers' gradients. 128
# samples per rank give that remaining backward a few ms of matmuls: at 16 a loaded 2-core machine could run the
# whole first all-reduce while the training thread waited for a core inside the call that issued it (overlap 0.0
# on a rank in one CI; 0.03-0.12 under two busy loops, against 0.11-0.54 at 128)
PROFILED = {"model.name": "mlp", "model.width": 512, "model.depth": 3, "optim.batch_per_worker": 128,
            "data.samples": 1024, "steps": 5,
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
        # how much of the all-reduce time backward shared is the machine's to decide: on a loaded 2-core machine
        # gloo's thread may get a core only after backward ends (0.0 on a rank in one CI run)
        assert s["comm_s"] > 0 and 0 <= s["overlap"] <= 1, (rank, s)
        assert s["overlapped_s"] == pytest.approx(s["overlap"] * s["comm_s"])
    # what DDP decides, on every rank and in every active step: its hooks send a bucket while backward still runs
    # (the training thread's collective call lies inside backward) and the later buckets after it
    for rank in (0, 1):
        iv = trace_intervals(load_trace(trace_path(ddp_run.run_dir, rank)), rank)
        backward = [(a, b) for p, a, b in iv["phases"] if p == "backward"]
        assert len(backward) == 3, iv["phases"]
        for a, b in backward:
            sent = [c0 for kind, c0, _ in iv["issued"] if kind == "all_reduce" and a <= c0 <= b]
            assert len(sent) >= 2 and min(sent) < b - 1e-4, (rank, a, b, sent)


def test_overlap_counts_only_the_time_comm_and_compute_share():
    assert merge([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert overlap_seconds([(0, 4)], [(1, 2), (3, 10)]) == pytest.approx(2.0)
    assert overlap_seconds([(0, 1)], [(1, 2)]) == 0.0
    assert overlap_seconds([(0, 2), (1, 3)], [(0, 3)]) == pytest.approx(3.0)  # comm in flight twice counts once


def test_spans_minus_a_cut_keep_only_the_moments_outside_it():
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert subtract([(0, 2), (1, 4)], [(3, 9)]) == [(0, 3)]
    assert subtract([(0, 1)], [(0, 5)]) == []


def _x(name, ts_ms, dur_ms, tid, cat="cpu_op"):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts_ms * 1e3, "dur": dur_ms * 1e3, "tid": tid}


def test_a_comm_hook_waiting_inside_backward_is_not_compute():
    # the engine's hook waits for its last bucket inside autograd's AccumulateGrad range: that range is not
    # compute, and neither is the time the training thread spends in the collective call itself
    trace = {"traceEvents": [
        _x("ProfilerStep#1", 0, 12, 1, "user_annotation"),
        _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 0, 10, 1),
        _x("aten::mm", 0, 2, 1), _x("c10d::allreduce_", 2, 1, 1), _x("aten::add_", 2.5, 0.2, 1),
        _x("gloo:all_reduce", 2, 7, 2, "user_annotation")]}
    iv = trace_intervals(trace, 0)
    assert iv["compute"] == [(0.0, 0.002)]
    assert [c[0] for c in iv["comm"]] == ["all_reduce"] and overlap_ratio(iv) == 0.0


def test_phase_shares_of_a_profiled_run_add_up_and_follow_the_trace(ddp_run):
    shares = phase_shares(ddp_run.run_dir)
    assert set(shares["shares"]) == set(PHASES) and shares["steps"] == 3
    assert sum(shares["shares"].values()) == pytest.approx(1.0)
    ratio = shares["ms_per_step"]["backward"] / shares["ms_per_step"]["forward"]
    assert shares["shares"]["backward"] / shares["shares"]["forward"] == pytest.approx(ratio)
    record = timeline_record(ddp_run.run_dir)
    assert sorted(record["ranks"]) == ["0", "1"] and all(x["allreduces"] >= 6 for x in record["ranks"].values())


def test_a_run_file_is_read_beneath_the_working_copy_and_never_through_a_link(ddp_run, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(ddp_run.run_dir, work / "runs" / "x")
    rel, absolute = "runs/x/traces/rank-0.json", str(work / "runs" / "x" / "traces" / "rank-0.json")
    assert read_run_file(work, rel) == read_run_file(work, absolute) == (work / rel).read_text()
    (work / "runs" / "link").symlink_to(work / "runs" / "x")
    with pytest.raises(UntrustedFileError):
        read_run_file(work, "runs/link/traces/rank-0.json")
    with pytest.raises(UntrustedFileError):
        read_run_file(work / "runs" / "x", str(work / "runs" / "link" / "traces" / "rank-0.json"))  # outside


def test_bucket_traces_hold_one_all_reduce_per_bucket_per_traced_step(tmp_path):
    spec = preset("tiny").with_overrides({"model.name": "mlp", "model.width": 256, "model.depth": 8,
                                         "data.samples": 256, "optim.batch_per_worker": 32})
    bk = run_spmd("scalelab.experiments.ddp_internals:bucket_sweep", world=2, threads=1, run_dir=tmp_path / "ranks",
                  kwargs={"spec": spec.to_dict(), "caps_mb": [0.1, 25.0], "steps": 2, "warmup": 1,
                          "trace_dir": str(tmp_path / "traces"), "trace_steps": 2})
    counts = []
    for row in bk[0]["rows"]:
        iv = trace_intervals(load_trace(row["trace"]))
        assert len(iv["steps"]) == row["traced_steps"] == 2
        assert {p for p, _, _ in iv["phases"]} == {"forward", "backward", "optimizer"}
        assert len(iv["comm"]) == row["buckets"] * 2, row
        counts.append(len(iv["comm"]))
    assert counts[0] > counts[1]  # a smaller cap: more buckets, more all-reduces
    assert (tmp_path / "traces" / "cap-0.1" / "rank-1.json").exists()


def test_fusion_counts_tensors_whose_all_reduces_overlap_as_one():
    def span(name, tensor_pid, a, b):
        return [{"ph": "B", "name": name, "pid": tensor_pid, "tid": 0, "ts": a}, {"ph": "E", "pid": tensor_pid,
                                                                                "tid": 0, "ts": b}]
    events = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": f"allreduce.l{p}.weight"}}
              for p in (1, 2, 3)]
    events += span("NEGOTIATE_ALLREDUCE", 1, 0, 100) + span("ALLREDUCE", 1, 100, 200)
    events += span("NEGOTIATE_ALLREDUCE", 2, 0, 100) + span("ALLREDUCE", 2, 101, 199)  # fused with pid 1
    events += span("ALLREDUCE", 3, 300, 400)  # a cycle later, alone
    events += [{"ph": "i", "name": "CYCLE_START", "ts": t} for t in (0, 250)]
    f = fusion_summary(horovod_timeline_text(json.dumps(events)[:-1] + ","))  # cut short, as a killed job leaves it
    assert (f["tensors"], f["allreduces"], f["fused_allreduces"], f["cycles"]) == (3, 3, 2, 2)
    assert f["tensors_per_fused"] == 1.5 and f["negotiate_ms"] == pytest.approx(0.1)


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
    fusion = fusion_summary(hvd)
    assert fusion["tensors"] >= 2 and fusion["allreduces"] >= fusion["fused_allreduces"] >= 1
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


def test_json_lines_keeps_every_object_and_skips_what_a_kill_or_a_student_left():
    """The one JSON-lines reader of the logs the labs and the grader read (paths.json_lines): a line cut short by a
    kill, junk, a value that is not an object or one nested past the parser's depth is skipped; the rest is kept,
    in order."""
    from scalelab.paths import json_lines
    deep = "[" * 100000 + "]" * 100000
    text = '{"a": 1}\n\n[1, 2]\n"x"\nnot json\n' + deep + '\n{"b": {"c": 2}}\n{"cut": tr'
    assert json_lines(text) == [{"a": 1}, {"b": {"c": 2}}]
    assert json_lines(text.encode()) == [{"a": 1}, {"b": {"c": 2}}]
    from scalelab.experiments import kill_resume, timing
    assert timing.read_log(text) == kill_resume.read_log(text) == json_lines(text)
