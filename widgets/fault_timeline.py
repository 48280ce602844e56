"""FaultTimeline: what each rank did around a failure — steps, the fault, its detection, the recovery, the lost work.

    from scalelab.widgets import FaultTimeline
    FaultTimeline({"restart": elastic_run.events(), "forward": forward_run.events()}).save("faults.png")

One panel per run, one row per rank: grey bars are steps, a red cross the injected fault, an orange tick an error
(a rank noticing the failure), green a recovery (a restarted worker's start, or the survivors' re-formed group),
purple a preemption. Steps done twice (after a restart from a checkpoint) are the lost work: hatched. The numbers
come from `scalelab.experiments.resilience`; this module only draws them.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

import ipywidgets as w
from matplotlib.figure import Figure

from scalelab.experiments.resilience import recovery, timeline_rows

MARKS = {"fault": ("x", "#c44e52", "fault"), "error": ("|", "#dd8452", "error (detection)"),
         "recovered": ("^", "#55a868", "recovery"), "preempted": ("s", "#8172b3", "preempted"),
         "end": ("o", "#333333", "end")}


def fault_figure(runs: dict, title: str = "ranks around a failure") -> Figure:
    """One panel per run label, one row per rank."""
    fig = Figure(figsize=(10, 0.6 + 1.2 * sum(max(len(timeline_rows(ev)), 1) for ev in runs.values()) / 2 + 0.8))
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (label, events) in zip(axes, runs.items()):
        rows, seen = timeline_rows(events), set()
        for y, (rank, row) in enumerate(rows.items()):
            ax.broken_barh(row["steps"], (y - 0.3, 0.6), facecolors="#bbbbbb")
            restarts = row["start"][1:]  # a second start on a rank: its worker was restarted
            for kind, (marker, color, name) in MARKS.items():
                times = row[kind] + (restarts if kind == "recovered" else [])
                if times:
                    ax.scatter(times, [y] * len(times), marker=marker, color=color, s=60, zorder=3,
                               label=None if name in seen else name)
                    seen.add(name)
        _shade_lost_work(ax, events, len(rows))
        ax.set_yticks(range(len(rows)), [f"rank {r}" for r in rows])
        ax.invert_yaxis()
        ax.set_title(f"{label}: {_caption(events)}", fontsize=9, loc="left")
        ax.legend(loc="upper right", fontsize=7, ncol=5)
    axes[-1].set_xlabel("seconds since the run's first event")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _shade_lost_work(ax, events, n_rows) -> None:
    """Hatch the span between the checkpoint a restart resumed from and the fault: that work was done twice."""
    if not any(e["type"] == "fault" for e in events):
        return
    r = recovery(events)
    if r["steps_redone"] <= 0:
        return
    t0 = min(e["t"] for e in events)
    fault = next(e for e in events if e["type"] == "fault")
    first = [e for e in events if e["type"] == "step" and e["rank"] == 0 and e["t"] < fault["t"]]
    since = [e for e in first if e["step"] > fault["step"] - r["steps_redone"]]
    if since:
        a = since[0]["t"] - since[0]["step_s"] - t0
        ax.axvspan(a, fault["t"] - t0, ymin=0, ymax=1, hatch="//", fill=False, edgecolor="#c44e52", alpha=0.5,
                   label="lost work")


def _caption(events) -> str:
    if not any(e["type"] == "fault" for e in events):
        return "no fault injected"
    r = recovery(events)
    again = f"training again after {r['training_again_s']:.2f} s" if r["training_again_s"] is not None else \
        "did not recover"
    return f"{r['how']}, {again}, {r['steps_redone']} step(s) redone"


class FaultTimeline(w.VBox):
    """The fault timeline figure for {label: events}."""

    def __init__(self, runs: dict, **kwargs):
        self.runs = dict(runs)
        self.image = w.HTML()
        super().__init__([self.image], **kwargs)
        self.refresh()

    def refresh(self) -> None:
        """Redraw from the events held."""
        buf = io.BytesIO()
        fault_figure(self.runs).savefig(buf, format="png", dpi=90)
        self.image.value = f"<img src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'/>"

    def save(self, path) -> Path:
        """Write the figure as PNG; returns the path."""
        path = Path(path)
        fault_figure(self.runs).savefig(path, dpi=90)
        return path
