"""PipelineView: read / decode / consume timeline per worker, queue occupancy over time, stall time.

    from scalelab.widgets import PipelineView
    run = measure.prefetch_run(...)            # or Prefetcher(...).trace.to_dict()
    PipelineView(run["trace"])                 # shows the figure and the summary
    PipelineView(run["trace"]).save("pipeline.png")   # the same figure as a file (static pages, papermill)

`pipeline_figure(trace)` is the plain function that draws it (tests call it); the widget only wraps it with an
ipywidgets view, and `show(trace)` switches to another trace (a dropdown of runs can call it).
"""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import ipywidgets as w
from matplotlib.figure import Figure

COLORS = {"read": "#4c72b0", "decode": "#dd8452", "consume": "#55a868", "wait": "#c44e52"}
"""Span colours: I/O, CPU decoding, the training step, and the consumer's stalls."""


def lanes(trace: dict) -> list[str]:
    """Timeline rows, top to bottom: the consumer, then the workers in name order."""
    who = {row[0] for row in trace["spans"]}
    return ["consumer"] + sorted(who - {"consumer"})


def pipeline_figure(trace: dict, title: str = "") -> Figure:
    """Spans as horizontal bars per lane (one colour per kind), and queue occupancy as a step line."""
    fig = Figure(figsize=(10, 4.2))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    rows = lanes(trace)
    for kind, colour in COLORS.items():
        labelled = False  # each kind once in the legend
        for y, lane in enumerate(rows):
            bars = [(s, e - s) for who, k, s, e, _ in trace["spans"] if who == lane and k == kind]
            if bars:
                top.broken_barh(bars, (y - 0.38, 0.76), facecolors=colour, label=None if labelled else kind)
                labelled = True
    top.set_yticks(range(len(rows)), rows)
    top.invert_yaxis()
    top.legend(loc="upper right", fontsize=8, ncol=4)
    s = trace.get("summary", {})
    top.set_title(title or f"stall {s.get('stall_s', 0):.2f} s of {s.get('elapsed_s', 0):.2f} s "
                           f"({100 * s.get('stall_fraction', 0):.0f} %), mean queue {s.get('mean_occupancy', 0):.1f}",
                  fontsize=10)
    occ = sorted(trace.get("occupancy", []))
    if occ:
        bottom.step([t for t, _ in occ], [n for _, n in occ], where="post", color="#333")
    bottom.set_ylabel("ready in queue")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    return fig


def summary_html(trace: dict) -> str:
    """The trace's summary as a small table."""
    s = trace.get("summary", {})
    keys = ("items", "elapsed_s", "stall_s", "stall_fraction", "read_s", "decode_s", "consume_s", "mean_occupancy")
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(s.get(k))}</td></tr>" for k in keys if k in s)
    return f"<table style='font-size:90%'>{cells}</table>"


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))


def png_bytes(fig: Figure) -> bytes:
    """The figure rendered as PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


class PipelineView(w.VBox):
    """The pipeline figure and summary of one trace (a `PipelineTrace.to_dict()`)."""

    def __init__(self, trace: dict, title: str = "", **kwargs):
        self.image = w.HTML()
        self.table = w.HTML()
        super().__init__([self.image, self.table], **kwargs)
        self.title = title
        self.show(trace)

    def show(self, trace: dict) -> None:
        """Draw `trace` (replacing what is shown)."""
        self.trace = trace
        self.fig = pipeline_figure(trace, self.title)
        data = base64.b64encode(png_bytes(self.fig)).decode()
        self.image.value = f"<img src='data:image/png;base64,{data}' style='max-width:100%'/>"
        self.table.value = summary_html(trace)

    def save(self, path) -> Path:
        """Write the figure as a PNG file; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png_bytes(self.fig))
        return path


__all__ = ["PipelineView", "pipeline_figure", "lanes", "summary_html"]
