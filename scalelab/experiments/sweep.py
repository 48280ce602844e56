"""Scaling sweeps: run a list of RunSpecs one after another and turn their summaries into speedup and efficiency.

    specs = sweep_specs(preset("tiny"), mode="weak", workers=[1, 2])
    summaries = run_sweep(specs)                     # sequential: runs must not compete for the same cores
    rows = scaling_table(specs, summaries, "weak")   # speedup, ideal, efficiency, time breakdown per run
    print(format_table(rows))

Modes:
- weak: each rank keeps `batch_per_worker`; N ranks do N times the work per step. Ideal: samples/s x N.
- strong: the global batch stays fixed and is split over N ranks (batch_per_worker = G / N). Ideal: N times
  fewer seconds per step, which at a fixed global batch is again samples/s x N.
- batch: ranks fixed, batch_per_worker varies. There is no ideal; `speedup` is the throughput gain over the
  smallest batch (what a larger batch buys per sample), and `efficiency` equals it.

`ScalingExplorer` (scalelab.widgets) only wires these functions to a form and plots.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ScalelabError, SpecError

MODES = ("weak", "strong", "batch")


class SweepStopped(ScalelabError):
    """A sweep was asked to stop (its `on_result` callback raised this); runs done so far are in `summaries`."""

    def __init__(self, message: str = "sweep stopped", summaries=None):
        self.summaries = list(summaries or [])
        super().__init__(message)


def sweep_specs(base, mode: str = "weak", workers=(1, 2), batches=(16, 32, 64), global_batch: int | None = None,
                name: str = "sweep", out_dir: str | Path = "runs") -> list:
    """One validated RunSpec per point of the sweep, each with its own output_dir under `out_dir`."""
    if mode not in MODES:
        raise SpecError("mode", f"got {mode!r}; choose one of {', '.join(MODES)}")
    points = []
    if mode == "weak":
        points = [(n, base.optim.batch_per_worker) for n in workers]
    elif mode == "strong":
        g = global_batch or base.optim.batch_per_worker * max(workers)
        for n in workers:
            if g % n:
                raise SpecError("global_batch", f"got {g}, which {n} workers cannot split evenly; pick a multiple "
                                                f"of every worker count in {list(workers)}")
            points.append((n, g // n))
    else:
        points = [(base.world.workers_per_node, b) for b in batches]
    specs = []
    for n, b in points:
        label = f"{name}-{mode}-{n}w-{b}b"
        specs.append(base.with_overrides({"name": label, "world.workers_per_node": n, "optim.batch_per_worker": b,
                                          "output_dir": str(Path(out_dir) / label)}))
    return specs


def spec_key(spec) -> str:
    """What makes two runs the same measurement: the spec without its name and output folder."""
    import json
    d = spec.to_dict()
    d.pop("name")
    d.pop("output_dir")
    return json.dumps(d, sort_keys=True)


def run_sweep(specs, timeout: float = 600, on_result=None, cache: dict | None = None) -> list[dict]:
    """Launch each spec in turn and wait for it; returns the summaries in order.

    `on_result(index, spec, summary)` is called after each run (a widget's progress). `cache` (spec_key ->
    summary) lets a second sweep reuse a run it already measured, e.g. the 1-worker run shared by weak and strong
    sweeps. A failed run raises RunFailed: the sweep stops there; so does SweepStopped raised by `on_result`.
    """
    from ..launch import launch
    summaries = []
    for i, spec in enumerate(specs):
        key = spec_key(spec)
        if cache is not None and key in cache:
            summary = cache[key]
        else:
            summary = launch(spec).wait(timeout=timeout)
            if cache is not None:
                cache[key] = summary
        summaries.append(summary)
        if on_result:
            try:
                on_result(i, spec, summary)
            except SweepStopped as e:
                raise SweepStopped(str(e), summaries) from None
    return summaries


def time_breakdown(summary) -> dict:
    """Fractions of step time in data, compute and communication that add up to 1.

    The engine measures DDP's communication from bucket launch to completion, overlapping backward: there the
    compute share already contains it, so compute is reduced by it (an upper bound of the exposed comm).
    """
    f = summary.get("time_fraction") or {}
    data, compute, comm = (max(float(f.get(k, 0.0)), 0.0) for k in ("data", "compute", "comm"))
    if data + compute + comm > 1.02:  # overlapped: comm is counted inside compute
        compute = max(compute - comm, 0.0)
    total = data + compute + comm or 1.0
    return {"data": data / total, "compute": compute / total, "comm": comm / total}


def scaling_table(specs, summaries, mode: str) -> list[dict]:
    """Rows of a sweep: workers, batch, samples/s, seconds per step, speedup, ideal speedup, efficiency, breakdown."""
    if mode not in MODES:
        raise SpecError("mode", f"got {mode!r}; choose one of {', '.join(MODES)}")
    rows = []
    for spec, s in zip(specs, summaries):
        sps = s["samples_per_s"]
        rows.append({"workers": spec.world_size, "batch_per_worker": spec.optim.batch_per_worker,
                     "global_batch": spec.global_batch, "samples_per_s": sps,
                     "per_rank_samples_per_s": s.get("per_rank_samples_per_s", []),
                     "step_s": spec.global_batch / sps if sps > 0 else float("inf"),
                     "final_loss": s.get("final_loss"), "time_fraction": time_breakdown(s)})
    if not rows:
        return rows
    first = rows[0]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / first["samples_per_s"] if first["samples_per_s"] > 0 else 0.0
        r["ideal_speedup"] = 1.0 if mode == "batch" else r["workers"] / first["workers"]
        r["efficiency"] = r["speedup"] / r["ideal_speedup"]
    return rows


def format_table(rows) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'workers':>7} {'batch/w':>7} {'global':>6} {'samples/s':>10} {'s/step':>8} {'speedup':>7} " \
           f"{'ideal':>5} {'eff':>5} {'data':>5} {'comp':>5} {'comm':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["time_fraction"]
        lines.append(f"{r['workers']:>7} {r['batch_per_worker']:>7} {r['global_batch']:>6} {r['samples_per_s']:>10.0f} "
                     f"{r['step_s']:>8.4f} {r['speedup']:>7.2f} {r['ideal_speedup']:>5.1f} {r['efficiency']:>5.2f} "
                     f"{t['data']:>5.2f} {t['compute']:>5.2f} {t['comm']:>5.2f}")
    return "\n".join(lines)
