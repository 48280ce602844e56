"""Code of the student's own that a lab's measurement runs in the notebook's process, and the record of what ran.

An engine run imports a student's module from its run folder's `code/` copy (scalelab/run/user_code.py). A lab's
in-process measurement does the same here: `load_own("my_timer:time_steps", run_dir)` copies the module file
beside the notebook into `run_dir/code/` and imports that copy under a name of its own. So a module that a
`%%writefile` cell rewrote since an earlier import runs as it is *now* (Python's import cache would keep running the
old one), and the SHA-256 written next to the run's evidence is that of the code that ran. Without a run folder the
module is imported fresh from beside the notebook, nothing is copied.

An exercise that is not written yet raises NotImplementedError where the lab calls it (`not_written`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from ..errors import ScalelabError
from ..run.user_code import CODE_DIR
from ..run.validate import CODE_REF


class OwnCodeError(ScalelabError):
    """A module:function of the student's own is misnamed, missing, or returned what it must not; the message says
    which and what to do."""


def load_own(ref: str, run_dir=None, source_dir=None):
    """(the function `ref` = "module:function" names, {module file name: sha256}); the module is the file
    `<module>.py` in `source_dir` (default: the working folder), imported fresh from its copy in run_dir/code/."""
    module, _, name = str(ref).partition(":")
    if not CODE_REF.match(str(ref)) or "." in module:
        raise OwnCodeError(f"{ref!r} must name a function in a module beside the notebook, as module:function "
                           "(e.g. my_timer:time_steps)")
    src = Path(source_dir or os.getcwd()) / f"{module}.py"
    if not src.is_file():
        raise OwnCodeError(f"{ref!r}: there is no {src}; run the %%writefile cell that writes it")
    path = src
    if run_dir is not None:
        path = Path(run_dir) / CODE_DIR / src.name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    spec = importlib.util.spec_from_file_location(f"scalelab_own_{module}_{sha[:16]}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)  # the student's module: an error in it is theirs to see, as raised
    function = getattr(loaded, name, None)
    if not callable(function):
        raise OwnCodeError(f"{ref!r}: {src.name} defines no function {name!r}")
    return function, {src.name: sha}


def not_written(ref: str) -> NotImplementedError:
    """The error an exercise's function raised because it is not written yet, saying which one."""
    module, _, name = ref.partition(":")
    return NotImplementedError(f"{name} in {module}.py is not written yet: write its solution, run that cell (it "
                               "writes the file), then this one")


__all__ = ["OwnCodeError", "load_own", "not_written"]
