"""scalelab: a course kit for distributed deep learning on HPC.

The notebook facade. Labs (and students' copies of them) import only from here, `scalelab.widgets`,
`scalelab.experiments` and `scalelab.record`, so the library behind them can move without breaking a notebook:

    from scalelab import RunSpec, preset, launch, record, SpmdPool, run_spmd, ScalelabError

    spec = preset("tiny").with_overrides({"world.workers_per_node": 2})   # SpecError names a bad field
    summary = launch(spec).wait()

Everything but `record` and `ScalelabError` is loaded on first use: `import scalelab` stays cheap (no torch) for
the CLI, the hub and the grader. The layout of the library is in docs/architecture.md.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

from .errors import ScalelabError  # noqa: E402
# Bound eagerly (neither imports anything heavy): a lazy lookup would be shadowed by the submodule
# `scalelab.record` / the subpackage `scalelab.launch` as soon as anything imported them (scalelab.launch.chain,
# for one), and `from scalelab import launch` would give the package instead of the function.
from .launch import launch  # noqa: E402
from .record import record  # noqa: E402

# name -> the module that defines it (loaded on first use)
_EXPORTS = {
    "RunSpec": "scalelab.run.spec", "preset": "scalelab.run.spec", "load_spec": "scalelab.run.spec",
    "PRESETS": "scalelab.run.spec",
    "Run": "scalelab.run.handle",
    "SpmdPool": "scalelab.launch.spmd", "run_spmd": "scalelab.launch.spmd",
    "submit_chain": "scalelab.launch.chain", "run_in_time_slices": "scalelab.launch.chain",
    "SpecError": "scalelab.errors", "LaunchError": "scalelab.errors", "RunFailed": "scalelab.errors",
    "RunTimeout": "scalelab.errors",
}
_RENAMED = {"load_spec": "load"}


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module 'scalelab' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


# Modules as they were named before the library was arranged in wings (docs/architecture.md). Student copies
# and submissions made from earlier releases import these names; each resolves to the module that now holds the
# same code, so old notebooks still run and grade, with a FutureWarning naming the new module. New code imports the
# new names (tests/test_architecture.py fails on an old name anywhere but tests/fixtures/legacy); the names go in
# the release LEGACY_REMOVED_IN.
LEGACY_REMOVED_IN = "0.3.0"
LEGACY_MODULES = {
    "scalelab.spec": "scalelab.run.spec",
    "scalelab.validate": "scalelab.run.validate",
    "scalelab.events": "scalelab.run.events",
    "scalelab.metrics": "scalelab.run.metrics",
    "scalelab.sweep": "scalelab.experiments.sweep",
    "scalelab.site_build": "scalelab.course.site",
    "scalelab.cluster_conf": "scalelab.cluster.conf",
    "scalelab.grade.lab": "scalelab.course.lab",
    "scalelab.grade.execute": "scalelab.course.execute",
    "scalelab.grade.release": "scalelab.course.release",
    "scalelab.data.measure": "scalelab.experiments.data_pipeline",
    "scalelab.data.straggler": "scalelab.experiments.straggler",
    "scalelab.ckpt.measure": "scalelab.experiments.checkpointing",
    "scalelab.ckpt.timeline": "scalelab.experiments.ckpt_timeline",
    "scalelab.ckpt.chain": "scalelab.launch.chain",
}


class _LegacyAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a legacy module name as the module that now holds its code (the very same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in LEGACY_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module):
        # importlib hands back whatever sys.modules holds after exec: the new module, with its own __spec__ intact
        old, new = module.__name__, LEGACY_MODULES[module.__name__]
        import warnings
        warnings.warn(f"{old} is the old name of {new}: import {new} instead ({old} goes in scalelab "
                      f"{LEGACY_REMOVED_IN})", FutureWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(new)


if not any(isinstance(f, _LegacyAlias) for f in sys.meta_path):
    sys.meta_path.append(_LegacyAlias())

__all__ = ["ScalelabError", "launch", "record", "__version__", *_EXPORTS]
