"""Lab 02, gradient compression: the same DDP training with different communication hooks, side by side.

Each variant is a real engine run (`launch`) whose ranks register the hook `optim.comm_hook` names: torch's
all-reduce, a cast or PowerSGD, or the student's own hook from a module beside the notebook (the launcher copies it
into the run's code/ folder). What each step handed to torch.distributed and sent is in the run's step events
(`wire_bytes`, ring model), so the comparison, and the grader, read bytes, step time and loss from the events.

A variant whose hook is not written yet (the released `raise NotImplementedError("exercise")`) fails in its ranks;
`compare` reports it as not implemented yet and goes on with the others.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from ..errors import RunFailed
from ..run.spec import RunSpec

TAIL_STEPS = 10
"""The loss a variant reached: the mean of rank 0's last TAIL_STEPS step losses (one step's loss is noisy)."""


def tail_loss(losses: list[float], tail: int = TAIL_STEPS) -> float:
    """The mean of the last `tail` losses."""
    last = [float(x) for x in losses[-tail:]]
    return sum(last) / len(last) if last else float("nan")


def compare(spec: RunSpec, variants: list[dict], out: str | Path, timeout: float = 300, nodes: int = 1,
            link_rate: str = "") -> list[dict]:
    """Run `spec` once per variant ({"name", "overrides"}), one after another; returns a row per variant: name,
    comm_hook, run_dir, wire_bytes (per step, rank 0, median), collectives per step, step_ms (median), tail_loss,
    loss_curve, eval_accuracy, hosts, or `error` where the run failed (an unsolved hook: "not implemented yet").

    nodes >= 2: every variant runs as `nodes` nodes x 1 rank (launcher slurm); link_rate (e.g. "10mbit") also
    shapes each node's link of the namespace cluster ($SLURM_CONF, root) to that rate for the duration, taken off
    again afterwards whatever happened."""
    if nodes >= 2:
        spec = spec.with_overrides({"launcher": "slurm", "world.nodes": nodes, "world.workers_per_node": 1})
    if link_rate:
        from .multinode import _shaper
        cluster = _shaper()
        cluster.set_link_rate(link_rate)
        try:
            return compare(spec, variants, out, timeout)
        finally:
            cluster.set_link_rate(None)
    from ..launch import launch
    rows = []
    for v in variants:
        run_spec = spec.with_overrides({**v.get("overrides", {}), "output_dir": str(Path(out) / v["name"])})
        row = {"name": v["name"], "comm_hook": run_spec.optim.comm_hook, "run_dir": run_spec.output_dir}
        try:
            run = launch(run_spec)
            summary = run.wait(timeout=timeout)
        except RunFailed as e:
            unsolved = "NotImplementedError" in str(e)
            row["error"] = "not implemented yet" if unsolved else str(e)
            print(f"{v['name']}: {'not implemented yet (your hook raised NotImplementedError)' if unsolved else e}")
            rows.append(row)
            continue
        steps = [e for e in run.events() if e.get("type") == "step" and e.get("rank") == 0]
        row.update(wire_bytes=statistics.median(e.get("wire_bytes", 0) for e in steps),
                   collectives=statistics.median(e.get("collectives", 0) for e in steps),
                   step_ms=1e3 * statistics.median(e["step_s"] for e in steps),
                   loss_curve=[e["loss"] for e in steps], tail_loss=tail_loss([e["loss"] for e in steps]),
                   eval_accuracy=summary.get("eval_accuracy"),
                   hosts=sorted({str(e.get("host")) for e in run.events() if e.get("type") == "start"}))
        rows.append(row)
    return rows


def figure(rows: list[dict]):
    """Loss curves (left) and bytes sent per step relative to plain all-reduce (right), for the variants that ran."""
    from matplotlib.figure import Figure
    ran = [r for r in rows if "error" not in r]
    fig = Figure(figsize=(10, 3.6))
    left, right = fig.subplots(1, 2)
    for r in ran:
        left.plot(range(1, len(r["loss_curve"]) + 1), r["loss_curve"], label=r["name"])
    left.set(xlabel="step", ylabel="training loss (rank 0)", title="Same seed, different hooks")
    left.legend(fontsize=8)
    plain = next((r["wire_bytes"] for r in ran if r["name"] == "allreduce"), None)
    if plain:
        shares = [100 * r["wire_bytes"] / plain for r in ran]
        bars = right.bar([r["name"] for r in ran], shares)
        right.bar_label(bars, labels=[f"{s:.1f} %" for s in shares], fontsize=8)
        right.set_yscale("log")
        right.set(ylabel="bytes sent per step, % of all-reduce", title="What each rank sends")
        right.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    return fig
