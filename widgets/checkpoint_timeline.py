"""CheckpointTimeline: training steps vs checkpoint blocking time, one row per strategy (sync, async, sharded).

    from scalelab.widgets import CheckpointTimeline
    CheckpointTimeline({"sync": run_sync.events(), "async": run_async.events()})
    CheckpointTimeline(...).save("timeline.png")

Each row shows the steps (grey), the time a save blocked training (red) and, just below, when the background
flush wrote the bytes (blue): with async and sharded saves the blue runs while grey goes on. The numbers come
from `scalelab.ckpt.timeline.timeline`; this module only draws them.
"""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import ipywidgets as w
from matplotlib.figure import Figure

from scalelab.experiments.ckpt_timeline import timeline

COLORS = {"steps": "#bbbbbb", "blocks": "#c44e52", "flushes": "#4c72b0"}


def timeline_figure(runs: dict, title: str = "training steps vs checkpoint blocking") -> Figure:
    """One row per run label: steps and blocking on the row, background flushes in a thin band below it."""
    lines = {label: timeline(events) for label, events in runs.items()}
    fig = Figure(figsize=(10, 1.1 + 0.9 * len(lines)))
    ax = fig.subplots()
    labelled = set()  # each kind once in the legend
    for y, (label, tl) in enumerate(lines.items()):
        for kind, band in (("steps", (y - 0.3, 0.5)), ("blocks", (y - 0.3, 0.5)), ("flushes", (y + 0.25, 0.15))):
            bars = [(a, b - a) for a, b, _ in tl[kind]]
            if bars:
                ax.broken_barh(bars, band, facecolors=COLORS[kind], label=None if kind in labelled else kind)
                labelled.add(kind)
    ax.set_yticks(range(len(lines)), [f"{k}\nblocked {v['blocked_s']:.2f} s" for k, v in lines.items()])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the rank started")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    return fig


def totals_html(runs: dict) -> str:
    """Blocked time, flush time and blocked fraction per run, as a table."""
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{t['checkpoints']}</td><td>{t['blocked_s']:.3f}</td>"
                   f"<td>{t['flush_s']:.3f}</td><td>{100 * t['blocked_fraction']:.1f} %</td></tr>"
                   for k, t in ((k, timeline(v)) for k, v in runs.items()))
    head = "<tr><th>run</th><th>checkpoints</th><th>blocked s</th><th>flush s</th><th>blocked share</th></tr>"
    return f"<table style='font-size:90%'>{head}{rows}</table>"


class CheckpointTimeline(w.VBox):
    """Timeline figure and totals for {label: events}."""

    def __init__(self, runs: dict, **kwargs):
        self.image, self.table = w.HTML(), w.HTML()
        super().__init__([self.image, self.table], **kwargs)
        self.show(runs)

    def show(self, runs: dict) -> None:
        """Draw these runs (replacing what is shown)."""
        self.runs = runs
        self.fig = timeline_figure(runs)
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=100)
        self._png = buf.getvalue()
        self.image.value = f"<img src='data:image/png;base64,{base64.b64encode(self._png).decode()}' " \
                           "style='max-width:100%'/>"
        self.table.value = totals_html(runs)

    def save(self, path) -> Path:
        """Write the figure as a PNG file; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self._png)
        return path


__all__ = ["CheckpointTimeline", "timeline_figure", "totals_html"]
