"""The one flow every run takes: a validated `RunSpec` (spec, its field groups in field_groups, validate), the
per-rank JSONL events every rank writes (events; the worker that writes them is `scalelab.train.worker`), the
numbers a run is judged by (metrics), the `Run` handle a notebook, widget or CLI holds (handle), and the process
helpers every launcher shares (procs).

`from scalelab.run import Run` keeps working for code written when this was one module.
"""
from __future__ import annotations


def __getattr__(name):
    if name == "Run":
        from .handle import Run
        return Run
    raise AttributeError(f"module 'scalelab.run' has no attribute {name!r}")
