"""Code of the student's own that a run executes: a `module:function` named by a spec field.

A spec field such as `optim.comm_hook = "my_hooks:topk_hook"` or `optim.schedule = "my_schedule:lr_at"` names a
function in a module beside the notebook. At launch, `copy_user_code` copies each such module's file into the run's
`code/` folder: every rank imports it from there (on any node that sees the run folder), and the run keeps the code
it ran next to its events. The start event names each file with its SHA-256 (`code`), so the grader can tell which
version of the student's code produced the run.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from ..errors import LaunchError

CODE_DIR = "code"
CODE_FIELDS = ("optim.schedule", "optim.comm_hook", "optim.kfac_factor", "pipeline.schedule")
"""The spec fields that may name code of the student's own."""


def code_refs(spec) -> dict[str, str]:
    """{field: "module:function"} for the spec's fields that name code rather than a built-in choice."""
    refs = {}
    for name in CODE_FIELDS:
        group, _, field = name.partition(".")
        value = getattr(getattr(spec, group), field)
        if isinstance(value, str) and ":" in value:
            refs[name] = value
    return refs


def copy_user_code(spec, run_dir: Path, source_dir: str | Path | None = None) -> dict[str, str]:
    """Copy each referenced top-level module found in `source_dir` (default: the working folder) into
    run_dir/code/; returns {module file name: sha256}. A module that is neither there nor importable is an error that
    names the field and what to do."""
    source_dir = Path(source_dir or os.getcwd())
    copied: dict[str, str] = {}
    for field, ref in code_refs(spec).items():
        module = ref.partition(":")[0]
        top = module.split(".")[0]
        src = source_dir / f"{top}.py"
        if "." not in module and src.is_file():
            dest_dir = run_dir / CODE_DIR
            dest_dir.mkdir(parents=True, exist_ok=True)
            dest = dest_dir / src.name
            shutil.copyfile(src, dest)
            copied[src.name] = hashlib.sha256(dest.read_bytes()).hexdigest()
        elif importlib.util.find_spec(top) is None:
            raise LaunchError(f"{field}: {ref!r} names module {module!r}, but there is no {top}.py in {source_dir} "
                              f"and no installed module of that name; write it beside the notebook (e.g. "
                              f"%%writefile {top}.py) or fix the name")
    return copied


def code_hashes(run_dir: str | Path) -> dict[str, str]:
    """{file name: sha256} of the run's code/ folder (what its ranks imported)."""
    folder = Path(run_dir) / CODE_DIR
    if not folder.is_dir():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.py"))}


def use_run_code(run_dir: str | Path) -> None:
    """Put the run's code/ folder first on the import path of this rank."""
    folder = Path(run_dir) / CODE_DIR
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def resolve_code(ref: str, field: str):
    """The function `ref` ("module:function") names, for the spec field `field`; errors say which field."""
    module_name, _, name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise LaunchError(f"{field}: cannot import {module_name!r} for {ref!r}: {e}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise LaunchError(f"{field}: module {module_name!r} has no function {name!r}") from None
