"""Figures for the labs, drawn with matplotlib's object API (no pyplot state) and saved as PNG.

Each function takes plain rows (what the experiment returned and the notebook recorded) and returns the
`Figure`; `save(fig, path)` writes it. A notebook then shows the file with `IPython.display.Image`, so the
picture is in the executed notebook whatever the matplotlib backend.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def save(fig: Figure, path: str | Path) -> str:
    """Write `fig` as a PNG (folders created); returns the path as text."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    return str(path)


def bars(labels, values, title: str, ylabel: str, notes=None, ref: float | None = None,
         ref_label: str = "") -> Figure:
    """A bar chart with an optional note on top of each bar and an optional horizontal reference line."""
    fig = Figure(figsize=(max(4.5, 1.1 * len(labels)), 3.2))
    ax = fig.add_subplot()
    ax.bar(range(len(values)), values, color="#4c72b0")
    ax.set_xticks(range(len(values)), [str(x) for x in labels], rotation=20 if len(labels) > 4 else 0, ha="right"
                  if len(labels) > 4 else "center")
    for i, note in enumerate(notes or []):
        ax.annotate(note, (i, values[i]), ha="center", va="bottom", fontsize=8)
    if ref is not None:
        ax.axhline(ref, color="k", ls="--", lw=1, label=ref_label or None)
        if ref_label:
            ax.legend(fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max([*values, ref or 0]) * 1.18 or 1)
    return fig


def ladder_figure(rows) -> Figure:
    """Samples/s per rung of an optimisation ladder, each bar labelled with its speedup over the baseline."""
    return bars([r["name"] for r in rows], [r["samples_per_s"] for r in rows], "Optimisation ladder",
                "samples/s", notes=[f"{r['speedup']:.2f}x" for r in rows])


def loader_figure(rows, data_ceiling=None) -> Figure:
    """Samples/s against DataLoader workers."""
    fig = Figure(figsize=(4.8, 3.2))
    ax = fig.add_subplot()
    w = [r["workers"] for r in rows]
    ax.plot(w, [r["samples_per_s"] for r in rows], "o-", label="measured (full step)")
    if data_ceiling:
        ax.plot(w, [data_ceiling(x) for x in w], "k--", lw=1, label="storage-bound ceiling")
    ax.set_xlabel("DataLoader workers")
    ax.set_ylabel("samples/s")
    ax.set_title("Loader workers")
    ax.legend(fontsize=8)
    return fig


def allreduce_figure(rows, world: int) -> Figure:
    """Allreduce time and bus bandwidth against message size (log-log)."""
    fig = Figure(figsize=(8.5, 3.2))
    ax1, ax2 = fig.subplots(1, 2)
    size = [r["bytes"] for r in rows]
    ax1.loglog(size, [r["time_s"] * 1e6 for r in rows], "o-")
    ax1.set_xlabel("message size (bytes)")
    ax1.set_ylabel("time (µs)")
    ax1.set_title(f"allreduce on {world} ranks")
    ax2.semilogx(size, [r.get("busbw_GBps", 0) for r in rows], "o-")
    ax2.set_xlabel("message size (bytes)")
    ax2.set_ylabel("bus bandwidth (GB/s)")
    ax2.set_title("bandwidth reached")
    fig.tight_layout()
    return fig


def curves_figure(curves: dict, title: str, ylabel: str = "loss", xlabel: str = "step", logx: bool = False) -> Figure:
    """Several named curves (name -> list of y, or of (x, y) pairs, drawn with markers) on one axis."""
    fig = Figure(figsize=(5.2, 3.2))
    ax = fig.add_subplot()
    for name, ys in curves.items():
        if ys and isinstance(ys[0], (list, tuple)):
            ax.plot([p[0] for p in ys], [p[1] for p in ys], "o-", label=str(name))
        else:
            ax.plot(range(1, len(ys) + 1), ys, label=str(name))
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
