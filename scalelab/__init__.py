"""scalelab: a course kit for distributed deep learning on HPC.

The core library: no Jupyter imports here. Labs call `scalelab.record(name, value)` to hand values to
their checks, and build runs from a `RunSpec` (see `scalelab.spec`).
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import ScalelabError  # noqa: E402
# Bound eagerly (record.py imports nothing heavy): a lazy lookup would be shadowed by the submodule
# `scalelab.record` as soon as anything imported it, and `from scalelab import record` would give the module.
from .record import record  # noqa: E402


def __getattr__(name):
    # Lazy: `import scalelab` must stay cheap (no torch) for the CLI, the hub and the grader.
    if name in ("RunSpec", "preset"):
        from . import spec
        return getattr(spec, name)
    if name == "launch":
        from .launch import launch
        return launch
    raise AttributeError(f"module 'scalelab' has no attribute {name!r}")


__all__ = ["ScalelabError", "RunSpec", "preset", "record", "launch", "__version__"]
