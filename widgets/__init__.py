"""ipywidgets front ends over the core library, imported as `scalelab.widgets`; one widget per module.

Each widget only wires plain functions in the core (which tests call directly); button clicks never fire under
papermill, so every action a button triggers is also a method a notebook cell can call.
"""
from __future__ import annotations

import importlib

_WIDGETS = {
    "LaunchPanel": "launch_panel",
    "ScalingExplorer": "scaling_explorer",
    "PipelineView": "pipeline_view",
    "CheckpointTimeline": "checkpoint_timeline",
    "FaultTimeline": "fault_timeline",
    "SelfCheck": "self_check",
    "ClusterStatus": "cluster_status",
    "ParallelismPlanner": "parallelism_planner",
    "Timeline": "timeline",
    "ResumeOffer": "resume_offer",
}


def __getattr__(name):
    if name in _WIDGETS:
        return getattr(importlib.import_module(f".{_WIDGETS[name]}", __name__), name)
    raise AttributeError(f"module 'scalelab.widgets' has no attribute {name!r}")


__all__ = list(_WIDGETS)
