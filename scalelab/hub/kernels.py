"""The course kernels shipped in `kernels/`: filled in for this environment and installed where servers find them.

    scalelab kernels install                  # into this environment (sys.prefix), preset local
    scalelab kernels install --preset cluster # at a site: leave the network interfaces to the site
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import SetupError
from ..paths import kernels_dir

PRESETS = ("local", "cluster")
_NOT_INSTALLED = {"presets.json"}


def kernel_spec(name: str, preset: str = "local", python: str | None = None, source: Path | None = None) -> dict:
    """The kernel.json of kernel `name` for `preset`, `@PYTHON@` replaced by `python` (default: this interpreter)."""
    if preset not in PRESETS:
        raise SetupError(f"kernel preset {preset!r} is unknown; use one of {list(PRESETS)}")
    folder = (source or kernels_dir()) / name
    spec = json.loads((folder / "kernel.json").read_text(encoding="utf-8"))
    python = python or sys.executable
    spec["argv"] = [python if a == "@PYTHON@" else a for a in spec["argv"]]
    presets_file = folder / "presets.json"
    if presets_file.is_file():
        spec.setdefault("env", {}).update(json.loads(presets_file.read_text(encoding="utf-8")).get(preset, {}))
    return spec


def kernel_names(source: Path | None = None) -> list[str]:
    """Names of the kernels shipped (folders holding a kernel.json)."""
    source = source or kernels_dir()
    return sorted(p.name for p in source.iterdir() if (p / "kernel.json").is_file()) if source.is_dir() else []


def install_kernels(preset: str = "local", prefix: str | None = None, user: bool = False,
                    python: str | None = None, source: Path | None = None) -> list[Path]:
    """Install every course kernel into `prefix` (default sys.prefix) or the user's Jupyter dir; return their paths."""
    from jupyter_client.kernelspec import KernelSpecManager

    names = kernel_names(source)
    if not names:
        raise SetupError(f"no kernel specs found in {source or kernels_dir()} (each needs NAME/kernel.json)")
    ksm = KernelSpecManager()
    installed = []
    for name in names:
        spec = kernel_spec(name, preset, python, source)
        with tempfile.TemporaryDirectory() as tmp:
            staged = Path(tmp) / name
            shutil.copytree((source or kernels_dir()) / name, staged,
                            ignore=lambda d, names: [n for n in names if n in _NOT_INSTALLED])
            (staged / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
            where = ksm.install_kernel_spec(str(staged), name, user=user,
                                            prefix=None if user else (prefix or sys.prefix))
        os.chmod(where, 0o755)
        installed.append(Path(where))
    return installed
