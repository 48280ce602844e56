"""Reading a profiled run: where each rank's step time goes, and how much communication hides under compute.

A run with `profile.enabled` leaves a Chrome trace per rank (`<run>/traces/rank-<r>.json`, written by
`scalelab.train.profiling`) and, for strategy horovod, Horovod's timeline. This module turns them into plain
intervals on one clock (seconds since the epoch, the clock of the run's events):

    trace = load_trace(run.run_dir / "traces" / "rank-0.json")
    iv = trace_intervals(trace)      # {"phases": [...], "comm": [...], "compute": [...], "steps": [...]}
    overlap_ratio(iv)                # time communication overlaps compute / total communication time
    overlap_by_rank(run.run_dir)     # {rank: {"overlap": ..., "comm_s": ..., "collectives": {...}}}

On CPU (gloo) a collective is the `gloo:<op>` range its worker thread records from start to finish, and compute
is the union of the aten ops the training thread runs, less the time it spends inside collective calls (a comm
hook that waits for its all-reduce inside backward's gradient bookkeeping is waiting, not computing). On GPU it
is the NCCL kernels against every other kernel. Horovod's collectives run in its own background thread, which
torch.profiler does not see: `horovod_timeline` reads Horovod's own file instead (its clock starts at hvd.init).
`event_lanes` draws the same phases, coarser, from the step events of any run, profiled or not.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..paths import read_beneath
from ..run.events import EventReader
from ..train.profiling import PREFIX, horovod_timeline_path, trace_dir
from .horovod_port import horovod_timeline

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "send_recv")
"""The collective kinds a trace's communication is sorted into."""
_KIND_PATTERNS = [("all_reduce", r"all_?reduce"), ("all_gather", r"all_?gather"),
                  ("reduce_scatter", r"reduce_?scatter"), ("broadcast", r"broadcast"), ("barrier", r"barrier"),
                  ("send_recv", r"send|recv")]
_DIST_OPS = re.compile(r"c10d|distributed|^gloo:|^nccl:|ncclDevKernel|ncclKernel", re.I)


def load_trace(path) -> dict:
    """A Chrome trace as written by torch.profiler (the dict with traceEvents)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable Chrome trace ({e}); was the run profiled "
                         "(profile.enabled=true) and did it reach its active steps?") from None
    if isinstance(data, list):  # the bare array form of the format
        data = {"traceEvents": data}
    if "traceEvents" not in data:
        raise ValueError(f"{path} has no traceEvents: not a Chrome trace")
    return data


def comm_kind(name: str) -> str | None:
    """all_reduce, all_gather, ... for a collective's event name; None for anything else."""
    if not _DIST_OPS.search(name):
        return None
    for kind, pattern in _KIND_PATTERNS:
        if re.search(pattern, name, re.I):
            return kind
    return None


def classify(event: dict, gpu: bool = False) -> str | None:
    """What a trace event is: a phase (data, forward, backward, optimizer), 'step', a collective kind ('comm'
    events carry it in comm_kind), 'compute', or None (metadata, flows, ignored ops)."""
    if event.get("ph") != "X":
        return None
    name, cat = event.get("name", ""), event.get("cat", "")
    if cat == "gpu_user_annotation":  # the GPU stream's copy of a step or phase range: counted once, on the CPU
        return None
    if name.startswith(PREFIX):
        return name[len(PREFIX):]
    if name.startswith("ProfilerStep#"):
        return "step"
    if gpu:
        if cat != "kernel":
            return None
        return "comm" if "nccl" in name.lower() else "compute"
    if cat == "user_annotation" and name.startswith("gloo:") and comm_kind(name):
        return "comm"
    if cat == "cpu_op" and not _DIST_OPS.search(name):
        return "compute"
    return None


def trace_intervals(trace: dict, rank: int | None = None) -> dict:
    """Phases, collectives, compute and steps of one rank's trace as (start, end) seconds since the epoch.

    phases: [(phase, start, end)], comm: [(kind, start, end, name)], compute: merged [(start, end)] on the
    training thread (CPU) or the GPU, steps: [(step number, start, end)], issued: [(kind, start, end)] of the
    collective calls the training thread made (on a CPU run: where DDP's hooks sent each bucket).
    """
    events = trace["traceEvents"]
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    gpu = any(e.get("cat") == "kernel" for e in events)
    main_tid = next((e.get("tid") for e in events if e.get("name", "").startswith("ProfilerStep#")), None)
    phases, comm, compute, steps, issued, waiting = [], [], [], [], [], []
    for e in events:
        what = classify(e, gpu)
        if what is None:
            if e.get("name", "").startswith("c10d::") and e.get("tid") == main_tid and comm_kind(e["name"]):
                issued.append((float(e["ts"]), comm_kind(e["name"])))
                waiting.append(_span(e, base_us))
            continue
        span = _span(e, base_us)
        if what == "comm":
            comm.append((comm_kind(e["name"]) or "all_reduce", *span, e["name"]))
        elif what == "compute":
            if gpu or (e.get("tid") == main_tid and e.get("name", "").startswith("aten::")):
                compute.append(span)
        elif what == "step":
            steps.append((int(e["name"].split("#", 1)[1]), *span))
        else:
            phases.append((what, *span))
    comm.sort(key=_start)
    if not gpu and len(issued) == len(comm):
        # gloo runs a reduce-scatter as an all-reduce: name each collective by what the training thread issued
        comm = [(kind, a, b, name) for (_, kind), (_, a, b, name) in zip(sorted(issued), comm)]
    if rank is None:
        rank = (trace.get("distributedInfo") or {}).get("rank")
    calls = sorted((kind, *span) for (_, kind), span in zip(issued, waiting))
    return {"rank": rank, "gpu": gpu, "phases": sorted(phases, key=_start),
            "comm": comm, "compute": subtract(compute, waiting), "steps": sorted(steps),
            "issued": sorted(calls, key=_start)}


def _span(event: dict, base_us: float) -> tuple[float, float]:
    start = (base_us + float(event["ts"])) / 1e6
    return start, start + float(event.get("dur", 0.0)) / 1e6


def _start(item):
    return item[1]


def subtract(spans, cut) -> list[tuple[float, float]]:
    """The union of `spans` with every moment inside the union of `cut` removed, as sorted, disjoint spans."""
    out, cut = [], merge(cut)
    for a, b in merge(spans):
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def merge(spans) -> list[tuple[float, float]]:
    """The union of (start, end) spans as sorted, disjoint spans."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_seconds(spans, cover) -> float:
    """Seconds of the union of `spans` that also lie inside the union of `cover`."""
    spans, cover = merge(spans), merge(cover)
    total, j = 0.0, 0
    for a, b in spans:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return total


def overlap_ratio(intervals: dict) -> float | None:
    """Time communication overlaps compute / total communication time (None: no communication in the trace)."""
    comm = merge((a, b) for _, a, b, _ in intervals["comm"])
    comm_s = sum(b - a for a, b in comm)
    if comm_s <= 0:
        return None
    return overlap_seconds(comm, intervals["compute"]) / comm_s


def trace_summary(intervals: dict) -> dict:
    """Per-rank totals: steps, seconds per phase, comm seconds, overlapped seconds, ratio, collectives by kind."""
    comm = merge((a, b) for _, a, b, _ in intervals["comm"])
    comm_s = sum(b - a for a, b in comm)
    phase_s: dict[str, float] = {}
    for name, a, b in intervals["phases"]:
        phase_s[name] = phase_s.get(name, 0.0) + (b - a)
    kinds: dict[str, int] = {}
    for kind, *_ in intervals["comm"]:
        kinds[kind] = kinds.get(kind, 0) + 1
    steps = intervals["steps"]
    return {"rank": intervals["rank"], "steps": len(steps),
            "step_s": sum(b - a for _, a, b in steps) / max(len(steps), 1), "phase_s": phase_s,
            "comm_s": comm_s, "compute_s": sum(b - a for a, b in intervals["compute"]),
            "overlapped_s": overlap_seconds(comm, intervals["compute"]),
            "overlap": overlap_ratio(intervals), "collectives": kinds}


def rank_traces(run_dir) -> dict[int, Path]:
    """{rank: trace path} of a profiled run."""
    found = {}
    for p in sorted(trace_dir(run_dir).glob("rank-*.json")):
        try:
            found[int(p.stem.split("-", 1)[1])] = p
        except ValueError:
            continue
    return found


def overlap_by_rank(run_dir) -> dict[int, dict]:
    """`trace_summary` of every rank's trace in a run directory."""
    return {rank: trace_summary(trace_intervals(load_trace(p), rank)) for rank, p in rank_traces(run_dir).items()}


def event_lanes(events) -> dict[int, list[tuple[str, float, float]]]:
    """Per-rank (phase, start, end) from step and checkpoint events, for any run (profiled or not).

    A step event carries its duration split into data and compute, laid end to end before the event's time, and
    its comm time, drawn as ending with the step (Horovod's is exposed; DDP's buckets hide under backward).
    """
    lanes: dict[int, list] = {}
    for e in events:
        rank, t = e.get("rank"), e.get("t")
        if e.get("type") == "step" and t is not None:
            start = t - e["step_s"]
            data_end = start + e.get("data_s", 0.0)
            compute_end = data_end + e.get("compute_s", 0.0)
            lane = lanes.setdefault(rank, [])
            lane += [("data", start, data_end), ("compute", data_end, compute_end)]
            if e.get("comm_s"):  # ends with the step: exposed (Horovod) or under backward (DDP's buckets)
                lane.append(("comm", max(t - e["comm_s"], data_end), t))
        elif e.get("type") == "checkpoint" and t is not None:
            lanes.setdefault(rank, []).append(("checkpoint", t - e.get("blocked_s", 0.0), t))
    return lanes


def run_events(run_dir) -> list[dict]:
    """Every event a run directory holds (all ranks)."""
    reader = EventReader(run_dir)
    reader.poll()
    return reader.all


def read_run_file(workdir, path, max_bytes: int = 64 * 2**20) -> str:
    """The text of a file a run wrote, at a recorded path (absolute, or relative to `workdir`), read beneath
    `workdir` with no symbolic link followed and at most `max_bytes` read (how a grader reads a submission's
    traces: as data that may be hostile)."""
    rel = os.path.relpath(str(path), str(workdir)) if os.path.isabs(str(path)) else str(path)
    return read_beneath(workdir, Path(os.path.normpath(rel)).as_posix(), max_bytes).decode("utf-8")


def run_timeline(run_dir) -> dict:
    """Everything a Timeline draws from a run directory: events, per-rank trace intervals, Horovod's timeline."""
    traces = {rank: trace_intervals(load_trace(p), rank) for rank, p in rank_traces(run_dir).items()}
    hvd = horovod_timeline_path(run_dir)
    return {"events": run_events(run_dir), "traces": traces,
            "horovod": horovod_timeline(hvd) if hvd.exists() and hvd.stat().st_size else None}


# -- the figure ---------------------------------------------------------------------------------------------
PHASE_COLORS = {"data": "#dd8452", "forward": "#8fbc8f", "backward": "#55a868", "optimizer": "#8172b3",
                "compute": "#bbbbbb", "checkpoint": "#c44e52"}
"""One colour per step phase (grey compute and red checkpoint stall as in CheckpointTimeline)."""
COMM_COLORS = {"all_reduce": "#4c72b0", "all_gather": "#64b5cd", "reduce_scatter": "#937860",
               "broadcast": "#da8bc3", "barrier": "#8c8c8c", "send_recv": "#8c8c8c", "comm": "#4c72b0"}
"""One colour per collective kind."""


def timeline_lanes(timeline: dict) -> dict[int, dict]:
    """{rank: {"phases": [(phase, start, end)], "comm": [(kind, start, end)], "source": "trace" | "events"}}:
    the trace's phases where the rank was profiled, else the coarser ones of its step events; checkpoint
    stalls always from the events."""
    from_events = event_lanes(timeline.get("events", []))
    lanes = {}
    for rank in sorted(set(from_events) | set(timeline.get("traces", {}))):
        tr = timeline.get("traces", {}).get(rank)
        ev = from_events.get(rank, [])
        stalls = [x for x in ev if x[0] == "checkpoint"]
        if tr is not None:
            lo, hi = (tr["steps"][0][1], tr["steps"][-1][2]) if tr["steps"] else (float("-inf"), float("inf"))
            stalls = [x for x in stalls if x[2] >= lo and x[1] <= hi]
            lanes[rank] = {"phases": tr["phases"] + stalls, "comm": [c[:3] for c in tr["comm"]], "source": "trace"}
        else:
            lanes[rank] = {"phases": [x for x in ev if x[0] != "comm"],
                           "comm": [x for x in ev if x[0] == "comm"], "source": "events"}
    return lanes


def timeline_figure(timeline: dict, title: str = ""):
    """Per-rank lanes of step phases with each collective in a band below; Horovod's timeline (when there is
    one) in a second panel: negotiation, each fused all-reduce, and the coordinator's cycles."""
    from matplotlib.figure import Figure
    lanes = timeline_lanes(timeline)
    hvd = timeline.get("horovod")
    fig = Figure(figsize=(10, 1.4 + 0.8 * max(len(lanes), 1) + (1.8 if hvd else 0)))
    axes = fig.subplots(2 if hvd else 1, 1, squeeze=False, height_ratios=[max(len(lanes), 1), 2] if hvd else None)
    ax = axes[0][0]
    t0 = min((x[1] for lane in lanes.values() for x in lane["phases"] + lane["comm"]), default=0.0)
    seen: set[str] = set()
    for y, (rank, lane) in enumerate(lanes.items()):
        _bars(ax, lane["phases"], (y - 0.35, 0.45), t0, PHASE_COLORS, seen)
        lane["comm"] = sorted(lane["comm"], key=_start)
        rows = _stagger(lane["comm"])  # collectives in flight together (two buckets) get a row each
        for k in range(max(rows, default=-1) + 1):
            h = 0.27 / (max(rows) + 1)
            _bars(ax, [c for c, row in zip(lane["comm"], rows) if row == k], (y + 0.12 + k * h, h), t0,
                  COMM_COLORS, seen, edge=True)
    ax.set_yticks(range(len(lanes)), [f"rank {r}\n({lane['source']})" for r, lane in lanes.items()])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first step shown")
    ax.set_title(title or "where each rank's step time goes (collectives in the band below each lane)",
                 fontsize=10, pad=22)
    if seen:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=len(seen), frameon=False)
    if hvd:
        _horovod_panel(axes[1][0], hvd)
    fig.tight_layout()
    return fig


def _stagger(spans, max_rows: int = 3) -> list[int]:
    """A row per span so that spans in flight at the same time do not hide each other (greedy, by start)."""
    ends: list[float] = []
    rows = []
    for _, a, b in sorted(spans, key=_start):
        row = next((i for i, end in enumerate(ends) if end <= a), None)
        if row is None and len(ends) < max_rows:
            ends.append(b)
            row = len(ends) - 1
        elif row is None:  # more in flight than rows: share the row that frees first
            row = min(range(len(ends)), key=ends.__getitem__)
        ends[row] = max(ends[row], b)
        rows.append(row)
    return rows


def _bars(ax, items, band, t0, colors, seen, edge=False):
    by_kind: dict[str, list] = {}
    for kind, a, b in items:
        by_kind.setdefault(kind, []).append(((a - t0) * 1e3, max((b - a) * 1e3, 1e-3)))
    for kind, bars in by_kind.items():
        ax.broken_barh(bars, band, facecolors=colors.get(kind, "#8c8c8c"), edgecolors="black" if edge else None,
                       linewidth=0.4 if edge else 0, label=None if kind in seen else kind.replace("_", "-"))
        seen.add(kind)


_HVD_ROWS = ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER")


def _horovod_panel(ax, hvd: dict) -> None:
    spans = [s for s in hvd["spans"] if s[0] in _HVD_ROWS]
    if not spans:
        return
    hi = spans[-1][2]
    lo = max(spans[0][1], hi - 0.25)  # the last quarter second: a few steps, cycles still distinguishable
    colors = ("#cccccc", "#4c72b0", "#dd8452", "#dd8452")
    for y, (row, color) in enumerate(zip(_HVD_ROWS, colors)):
        bars = [((a - lo) * 1e3, (b - a) * 1e3) for name, a, b, _ in spans if name == row and b >= lo]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolors="black", linewidth=0.3)
    for c in hvd["cycles"]:
        if lo <= c <= hi:
            ax.axvline((c - lo) * 1e3, color="#c44e52", linewidth=0.3, alpha=0.5)
    ax.set_yticks(range(len(_HVD_ROWS)), [r.lower().replace("_", " ") for r in _HVD_ROWS], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (Horovod timeline, rank 0's coordinator; red ticks: cycle starts)")


__all__ = ["COMM_KINDS", "load_trace", "comm_kind", "classify", "trace_intervals", "merge", "subtract",
           "overlap_seconds", "overlap_ratio", "trace_summary", "rank_traces", "overlap_by_rank", "event_lanes",
           "run_events", "horovod_timeline", "read_run_file", "run_timeline", "PHASE_COLORS", "COMM_COLORS",
           "timeline_lanes", "timeline_figure"]
