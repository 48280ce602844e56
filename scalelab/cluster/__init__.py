"""Slurm: the local cluster on this machine (local: daemons and state; conf: the slurm.conf text and the machine's
shape) and the one Slurm client everything else uses (slurm: commands, job states, which cluster).

`from scalelab.cluster import LocalCluster` keeps working for code written when this was one module.
"""
from __future__ import annotations


def __getattr__(name):
    if name in ("LocalCluster", "default_state_dir"):
        from . import local
        return getattr(local, name)
    raise AttributeError(f"module 'scalelab.cluster' has no attribute {name!r}")
