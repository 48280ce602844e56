"""ClusterStatus: the Slurm cluster as a student sees it — nodes, partitions, my jobs, my allocation, the queue.

    status = ClusterStatus()               # SLURM_CONF as set (the hub sets it), /etc/slurm, or the local cluster
    status                                 # in JupyterLab: the tables and a Refresh button
    status.refresh()                       # what the button calls; status.snapshot is the plain data behind it

Works against any Slurm: the data comes from `scalelab.cluster.slurm.snapshot` (scontrol and squeue), which
never raises; a cluster that does not answer shows its error instead of the tables.
"""
from __future__ import annotations

import html

import ipywidgets as W

from scalelab.cluster.slurm import snapshot

_STATE_COLOURS = {"idle": "#2a7", "mixed": "#c80", "allocated": "#c50", "down": "#c22", "drain": "#c22"}


def _table(headers: list[str], rows: list[list], empty: str) -> str:
    if not rows:
        return f"<p><i>{html.escape(empty)}</i></p>"
    head = "".join(f"<th style='text-align:left;padding-right:1em'>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td style='padding-right:1em'>{c}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _state(state: str) -> str:
    colour = next((c for k, c in _STATE_COLOURS.items() if k in state), "#555")
    return f"<span style='color:{colour}'>{html.escape(state)}</span>"


def render(snap: dict) -> str:
    """The snapshot as HTML: one section per question a student asks (pure: tested without a kernel)."""
    if snap["error"]:
        return (f"<p style='color:#c22'>cluster not reachable: {html.escape(snap['error'])}</p>"
                f"<p style='color:#777'>SLURM_CONF={html.escape(snap['conf'])}</p>")
    alloc = snap["allocation"]
    mine = (f"job {alloc['job_id']}: {alloc['nodes']} node(s) {html.escape(alloc['nodelist'])}, CPUs per node "
            f"{alloc['cpus_per_node']} — runs with launcher slurm start as job steps here"
            if alloc else "none (runs with launcher slurm submit a new job)")
    nodes = [[html.escape(n["name"]), _state(n["state"]), f"{n['cpus_alloc']}/{n['cpus']}", n["gpus"],
              html.escape(n.get("addr") or "")] for n in snap["nodes"]]
    parts = [[html.escape(p["name"]) + (" (default)" if p["default"] else ""), html.escape(p["nodes"] or ""),
              p["cpus"], p["gpus"]] for p in snap["partitions"]]
    jobs = [[html.escape(j[k]) for k in ("job_id", "user", "name", "state", "nodes", "nodelist", "reason", "time")]
            for j in snap["queue"]]
    mine_jobs = [row for row, j in zip(jobs, snap["queue"]) if j in snap["mine"]]
    headers = ["job", "user", "name", "state", "nodes", "node list", "reason", "time"]
    return "".join([
        f"<p><b>My allocation:</b> {mine}</p>",
        "<h4>Nodes</h4>", _table(["node", "state", "CPUs used", "GPUs", "address"], nodes, "no nodes"),
        "<h4>Partitions</h4>", _table(["partition", "nodes", "CPUs", "GPUs"], parts, "no partitions"),
        "<h4>My jobs</h4>", _table(headers, mine_jobs, "you have no jobs"),
        "<h4>Queue</h4>", _table(headers, jobs, "the queue is empty"),
        f"<p style='color:#777'>SLURM_CONF={html.escape(snap['conf'])}</p>",
    ])


class ClusterStatus:
    """Nodes, partitions, my jobs, my allocation and the queue of a Slurm cluster, refreshed on demand."""

    def __init__(self, env: dict | None = None, user: str | None = None):
        self.env, self.user = env, user
        self.snapshot: dict = {}
        self.view = W.HTML()
        self.refresh_button = W.Button(description="Refresh", icon="refresh")
        self.refresh_button.on_click(lambda _: self.refresh())
        self.widget = W.VBox([self.refresh_button, self.view])
        self.refresh()

    def refresh(self) -> dict:
        """Ask Slurm again (what the Refresh button calls); returns the new snapshot."""
        self.snapshot = snapshot(self.env, self.user)
        self.view.value = render(self.snapshot)
        return self.snapshot

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)

    def __repr__(self) -> str:
        s = self.snapshot
        return (f"<ClusterStatus {len(s.get('nodes', []))} nodes, {len(s.get('queue', []))} jobs queued, "
                f"{len(s.get('mine', []))} mine{', error' if s.get('error') else ''}>")
