"""Lab 04's runs across nodes: the same global batch as 1 node × 2 ranks and as 2 nodes × 1 rank, and (when asked)
once more with every node's link shaped slow, on a multi-node Slurm (`scalelab cluster up --nodes 2`).

    rows = cross_node_runs(preset("tiny"), out / "nodes", slow_link="100mbit")

Each row: layout, nodes, ranks_per_node, link, samples_per_s, comm_fraction (exposed all-reduce share of a step),
comm_ms_per_step (that share of the mean step time), comm_in_flight, hosts (where the ranks ran, from their start events) and run_dir (for the grader's evidence).
Shaping a link changes the cluster (tc on each node's veth), so it needs root and the namespace cluster that
$SLURM_CONF names; the shaping is taken off again afterwards, whatever happened.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import LaunchError


def cross_node_runs(base, out_dir: str | Path, slow_link: str = "", timeout: float = 600) -> list[dict]:
    """Launch the layouts one after another (launcher slurm) and return one row per run."""
    from ..launch import launch
    layouts = [("1 node x 2 ranks", 1, 2, None), ("2 nodes x 1 rank", 2, 1, None)]
    if slow_link:
        layouts.append((f"2 nodes x 1 rank, {slow_link} links", 2, 1, slow_link))
    cluster = _shaper() if slow_link else None
    rows = []
    try:
        for label, nodes, per_node, rate in layouts:
            if cluster is not None:
                cluster.set_link_rate(rate)
            spec = base.with_overrides({"name": f"nodes-{nodes}x{per_node}" + (f"-{rate}" if rate else ""),
                                        "launcher": "slurm", "world.nodes": nodes, "world.workers_per_node": per_node,
                                        "output_dir": str(Path(out_dir) / label.replace(" ", "").replace(",", "-"))})
            run = launch(spec)
            summary = run.wait(timeout=timeout)
            step_s = spec.global_batch / summary["samples_per_s"] if summary["samples_per_s"] else 0.0
            rows.append({"layout": label, "nodes": nodes, "ranks_per_node": per_node, "link": rate or "unshaped",
                         "samples_per_s": summary["samples_per_s"],
                         "comm_fraction": summary["time_fraction"]["comm"],
                         "comm_ms_per_step": 1000 * summary["time_fraction"]["comm"] * step_s,
                         "comm_in_flight": summary["comm_in_flight"],
                         "hosts": sorted({e.get("host", "") for e in run.events() if e.get("type") == "start"}),
                         "run_dir": str(run.run_dir)})
    finally:
        if cluster is not None:
            cluster.set_link_rate(None)
    return rows


def _shaper():
    """The namespace cluster behind $SLURM_CONF, to shape its links; LaunchError saying what is needed otherwise."""
    from ..cluster.nodes import NodesCluster
    conf = os.environ.get("SLURM_CONF", "")
    if os.geteuid() != 0:
        raise LaunchError("shaping the nodes' links needs root (tc on each node's link): leave slow_link empty, or "
                          "start the cluster shaped: sudo scalelab cluster up --nodes 2 --link-rate 100mbit")
    if not conf or not (Path(conf).parent / "nodes.json").exists():
        raise LaunchError(f"slow_link needs the namespace cluster (scalelab cluster up --nodes 2) as $SLURM_CONF; "
                          f"SLURM_CONF is {conf or 'not set'}")
    return NodesCluster(Path(conf).parent)


__all__ = ["cross_node_runs"]
