"""Timeline: per-rank lanes of step phases (data, forward, backward, optimizer) with each collective below.

    from scalelab.widgets import Timeline
    run = launch(spec.with_overrides({"profile.enabled": True}))
    run.wait()
    tl = Timeline(run)                   # or Timeline("runs/x"): a run directory
    tl.summary                           # {rank: {"overlap": 0.9, "comm_s": ..., "collectives": {...}}}
    tl.save("timeline.png")              # or .svg

A profiled run is drawn from its traces (`<run>/traces/rank-<r>.json`): with DDP the bucket all-reduces run
during backward (the overlap), with FSDP the all-gathers and reduce-scatters show, and with Horovod a second
panel draws the coordinator's timeline (negotiation, fused all-reduces, cycles). A run without traces is drawn
from its step events, coarser. The numbers come from `scalelab.experiments.profiling`; this module only shows them.
"""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import ipywidgets as w

from scalelab.experiments.profiling import overlap_by_rank, run_timeline, timeline_figure, timeline_lanes


def _run_dir(source) -> Path:
    return Path(getattr(source, "run_dir", source))


def _percent(ratio) -> str:
    return "-" if ratio is None else f"{100 * ratio:.0f} %"


def summary_html(summary: dict) -> str:
    """Per rank: step ms, comm ms, overlapped ms, overlap ratio and collectives, as a table."""
    head = ("<tr><th>rank</th><th>step ms</th><th>comm ms</th><th>hidden under compute</th><th>overlap</th>"
            "<th>collectives</th></tr>")
    rows = "".join(
        f"<tr><td>{r}</td><td>{1e3 * s['step_s']:.1f}</td><td>{1e3 * s['comm_s']:.1f}</td>"
        f"<td>{1e3 * s['overlapped_s']:.1f} ms</td>"
        f"<td>{_percent(s['overlap'])}</td>"
        f"<td>{html.escape(', '.join(f'{k} x{n}' for k, n in s['collectives'].items()) or 'none traced')}</td></tr>"
        for r, s in sorted(summary.items()))
    return f"<table style='font-size:90%'>{head}{rows}</table>"


class Timeline(w.VBox):
    """The timeline figure and the per-rank overlap table of one run (a Run, or its directory)."""

    def __init__(self, source, title: str = "", **kwargs):
        self.image, self.table = w.HTML(), w.HTML()
        super().__init__([self.image, self.table], **kwargs)
        self.show(source, title)

    def show(self, source, title: str = "") -> None:
        """Draw this run (replacing what is shown)."""
        self.run_dir = _run_dir(source)
        self.timeline = run_timeline(self.run_dir)
        self.lanes = timeline_lanes(self.timeline)
        """{rank: {"phases": [(phase, start, end)], "comm": [(kind, start, end)], "source": ...}}"""
        self.summary = overlap_by_rank(self.run_dir)
        """trace_summary per profiled rank (empty for a run without traces)."""
        self.fig = timeline_figure(self.timeline, title)
        self._png = self.render("png")
        self.image.value = (f"<img src='data:image/png;base64,{base64.b64encode(self._png).decode()}' "
                            "style='max-width:100%'/>")
        self.table.value = summary_html(self.summary) if self.summary else \
            "<i>no traces: drawn from step events (set profile.enabled=true for phases and collectives)</i>"

    def render(self, fmt: str = "png") -> bytes:
        """The figure as PNG or SVG bytes."""
        buf = io.BytesIO()
        self.fig.savefig(buf, format=fmt, dpi=100)
        return buf.getvalue()

    def save(self, path) -> Path:
        """Write the figure (PNG, or SVG for a .svg path); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.render("svg") if path.suffix == ".svg" else self._png)
        return path


__all__ = ["Timeline", "summary_html"]
