"""Packaging: a non-editable install must ship every subpackage the code imports."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_scalelab_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {"scalelab." + p.parent.name for p in (ROOT / "scalelab").glob("*/__init__.py")}
    present |= {"scalelab", "scalelab.widgets"}
    assert present - listed == set(), f"add to [tool.setuptools] packages: {sorted(present - listed)}"
