"""ParallelismPlanner: pick a model, a cluster and a tp x pp layout (dp fills the rest); see memory and traffic per
GPU, which groups talk over which link, and whether it fits.

    from scalelab.widgets import ParallelismPlanner
    planner = ParallelismPlanner(model="70b", nodes=8)
    planner.tp.value, planner.pp.value = 8, 4      # observers recompute, as a click would
    planner.result["feasible"], planner.result["memory_gb"]

The arithmetic is `scalelab.experiments.planner.plan` (tests call it directly); this module only draws controls
and a table over it. `best()` picks the first feasible layout of `layouts()`.
"""
from __future__ import annotations

import html

import ipywidgets as w

from scalelab.experiments.planner import ClusterShape, ModelShape, layouts, plan


class ParallelismPlanner(w.VBox):
    """Controls for model, cluster and layout; a table of the plan below them."""

    def __init__(self, model: str = "7b", nodes: int = 1, gpus_per_node: int = 8, gpu_gb: float = 80.0,
                 tp: int = 1, pp: int = 1, zero: int = 3, micro: int = 8):
        self.model = w.Dropdown(options=["7b", "13b", "70b"], value=model, description="model")
        self.nodes = w.BoundedIntText(value=nodes, min=1, max=1024, description="nodes")
        self.gpus_per_node = w.BoundedIntText(value=gpus_per_node, min=1, max=16, description="GPUs/node")
        self.gpu_gb = w.BoundedFloatText(value=gpu_gb, min=1, max=1024, description="GB/GPU")
        self.tp = w.BoundedIntText(value=tp, min=1, max=64, description="tp")
        self.pp = w.BoundedIntText(value=pp, min=1, max=512, description="pp")
        self.zero = w.Dropdown(options=[0, 1, 2, 3], value=zero, description="ZeRO")
        self.micro = w.BoundedIntText(value=micro, min=1, max=1024, description="micro-batches")
        self.table = w.HTML()
        self.result: dict = {}
        controls = [self.model, self.nodes, self.gpus_per_node, self.gpu_gb, self.tp, self.pp, self.zero, self.micro]
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        super().__init__([w.HBox(controls[:4]), w.HBox(controls[4:]), self.table])
        self.update()

    def cluster(self) -> ClusterShape:
        """The cluster the controls describe."""
        return ClusterShape(nodes=self.nodes.value, gpus_per_node=self.gpus_per_node.value, gpu_gb=self.gpu_gb.value)

    def update(self) -> dict:
        """Recompute the plan for the controls' values (dp = GPUs / (tp x pp)) and redraw the table."""
        gpus = self.nodes.value * self.gpus_per_node.value
        dp = max(gpus // (self.tp.value * self.pp.value), 1)
        self.result = plan(ModelShape.named(self.model.value), self.cluster(), dp, self.tp.value, self.pp.value,
                           self.zero.value, self.micro.value)
        self.table.value = table_html(self.result)
        return self.result

    def best(self) -> dict:
        """Set tp and pp to the best feasible layout for this model and cluster; returns its plan (or the
        least bad one, with its problems, if none fits)."""
        top = layouts(ModelShape.named(self.model.value), self.cluster(), self.zero.value, self.micro.value)[0]
        self.tp.value, self.pp.value = top["tp"], top["pp"]
        return self.update()


def table_html(p: dict) -> str:
    """A plan as a small HTML table, its verdict first."""
    verdict = "fits" if p["feasible"] else "does not work: " + "; ".join(p["problems"])
    rows = [("layout", f"dp {p['dp']} x tp {p['tp']} x pp {p['pp']} = {p['world']} GPUs, ZeRO-{p['zero']}"),
            ("memory per GPU", f"{p['memory_gb']:.1f} GB (state {p['state_gb']:.1f}, activations "
                               f"{p['activation_gb']:.1f})"),
            ("links", ", ".join(f"{k} over {'NVLink' if v == 'intra' else 'the network'}"
                                for k, v in p["links"].items())),
            ("traffic per GPU per step", ", ".join(f"{k} {v:.2f} GB" for k, v in p["traffic_gb"].items())),
            ("communication time (est.)", ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in p["comm_s"].items())),
            ("pipeline bubble", f"{p['bubble']:.2f}"), ("verdict", verdict)]
    cells = "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>" for a, b in rows)
    return f"<table style='font-size:90%'>{cells}</table>"
