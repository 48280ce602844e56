"""Plot data and figures shared by the widgets: plain functions, no widget or IPython state.

`run_series(events)` turns a run's events into per-rank series (what LaunchPanel plots and tests inspect);
`run_figure` and `scaling_figure` draw them with matplotlib's object API; `png_bytes` renders a figure.
"""
from __future__ import annotations

import io

from matplotlib.figure import Figure

METRICS = ("loss", "samples_per_s")


def run_series(events, since: dict | None = None) -> dict:
    """{"loss": {rank: [(step, loss), ...]}, "samples_per_s": {rank: [...]}} from step events, in step order.

    Pass the previous result as `since` to extend it with new events (the widget polls incrementally).
    """
    out = since if since is not None else {m: {} for m in METRICS}
    for e in events:
        if e.get("type") != "step":
            continue
        for m in METRICS:
            out[m].setdefault(e["rank"], []).append((e["step"], e[m]))
    for m in METRICS:
        for series in out[m].values():
            series.sort()
    return out


def run_figure(series: dict, title: str = "") -> Figure:
    """Per-rank loss and samples/s against step, side by side."""
    fig = Figure(figsize=(9, 3.2))
    axes = fig.subplots(1, 2)
    for ax, metric, label in zip(axes, METRICS, ("loss", "samples/s per rank")):
        for i, (rank, pts) in enumerate(sorted(series.get(metric, {}).items())):
            if not pts:
                continue
            steps, values = [p[0] for p in pts], [p[1] for p in pts]
            if metric == "loss" and len(pts) > 4:  # the raw loss is noisy: draw it faint, its trend bold
                ax.plot(steps, values, color=f"C{i}", lw=0.8, alpha=0.35)
                ax.plot(steps, smooth(values), color=f"C{i}", lw=1.8, label=f"rank {rank} (smoothed)")
            else:
                ax.plot(steps, values, color=f"C{i}", label=f"rank {rank}", lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if series.get(metric):
            ax.legend(fontsize=8)
    axes[0].set_title(title or "per-rank loss", fontsize=10)
    axes[1].set_title("per-rank throughput", fontsize=10)
    fig.tight_layout()
    return fig


def smooth(values: list[float], alpha: float = 0.2) -> list[float]:
    """Exponential moving average, bias-corrected (as TensorBoard smooths): the trend of a noisy curve."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg / (1 - (1 - alpha) ** i))
    return out


def scaling_figure(rows, x_key: str = "workers", title: str = "") -> Figure:
    """Speedup vs ideal, efficiency, and where the time went (stacked data/compute/comm) for a sweep's rows."""
    fig = Figure(figsize=(11, 3.2))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    xs = [r[x_key] for r in rows]
    ax1.plot(xs, [r["speedup"] for r in rows], "o-", label="measured")
    ax1.plot(xs, [r["ideal_speedup"] for r in rows], "k--", lw=1, label="ideal")
    ax1.set_xlabel(x_key)
    ax1.set_ylabel("speedup")
    ax1.set_title(title or "speedup", fontsize=10)
    ax1.legend(fontsize=8)
    ax2.plot(xs, [r["efficiency"] for r in rows], "o-")
    ax2.axhline(1.0, color="k", ls="--", lw=1)
    note = efficiency_note(rows)
    if note:  # above ideal is not physics: say what it is where the point is drawn
        ax2.text(0.02, 0.02, note, transform=ax2.transAxes, fontsize=7, color="#a11", wrap=True, va="bottom")
    ax2.set_ylim(0, max(1.1, max(r["efficiency"] for r in rows) * 1.1))
    ax2.set_xlabel(x_key)
    ax2.set_ylabel("efficiency")
    ax2.set_title("efficiency vs ideal", fontsize=10)
    bottom = [0.0] * len(rows)
    labels = [str(x) for x in xs]
    for part, color in (("data", "#dd8452"), ("compute", "#4c72b0"), ("comm", "#55a868")):
        vals = [r["time_fraction"].get(part, 0.0) for r in rows]
        ax3.bar(labels, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax3.set_xlabel(x_key)
    ax3.set_ylabel("fraction of step time")
    ax3.set_title("where the time goes", fontsize=10)
    ax3.legend(fontsize=8)
    fig.tight_layout()
    return fig


EFFICIENCY_SLACK = 1.05


def efficiency_note(rows) -> str:
    """A warning when a sweep's efficiency is above 1 (+5 %): more than ideal is measurement, not speed."""
    high = [r for r in rows if r.get("efficiency", 0) > EFFICIENCY_SLACK]
    if not high:
        return ""
    worst = max(r["efficiency"] for r in high)
    return (f"efficiency {worst:.2f} > 1: faster than ideal means the 1-run baseline was slowed (warm-up, a busy "
            "machine, caches); run longer or repeat before reading it")


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (for an Image widget or IPython's display)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return buf.getvalue()
