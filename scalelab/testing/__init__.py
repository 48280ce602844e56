"""Harnesses for tests and benchmarks: run a lab notebook and read its records (labs), a real hub on free ports
(hub). Production code never imports this package.

`from scalelab.testing import run_lab` keeps working for code written when this was one module.
"""
from __future__ import annotations


def __getattr__(name):
    from . import labs
    try:
        return getattr(labs, name)
    except AttributeError:
        raise AttributeError(f"module 'scalelab.testing' has no attribute {name!r}") from None
