"""Launchers: turn a RunSpec into processes or a batch job and hand back a `Run`.

One module per launcher (local, torchrun, horovodrun, mpirun, slurm, srun); all start the same worker,
`python -m scalelab.train.worker --spec <run dir>/spec.json`, and all are observed the same way.
"""
from __future__ import annotations

import importlib

from ..errors import SpecError

MODULES = {"local": "local", "torchrun": "torchrun", "horovodrun": "horovodrun", "mpirun": "mpirun", "slurm": "slurm",
           "srun": "srun"}


def launch(spec, **options):
    """Validate `spec`, write its run directory, start it with the launcher it names; returns the Run."""
    spec.validate()
    if spec.launcher not in MODULES:
        raise SpecError("launcher", f"got {spec.launcher!r}; choose one of {', '.join(MODULES)}")
    module = importlib.import_module(f".{MODULES[spec.launcher]}", __name__)
    return module.launch(spec, **options)


__all__ = ["launch"]
