"""Student copies of the labs: solutions removed, outputs stripped, hidden checks left out.

    scalelab labs release                    # every labs/*/ into build/student/labs/ (what the hub hands out)
    scalelab labs release 01_ddp --out DIR

In a code cell of the notebook, and in any Python module of the lab (worker code lives in modules, so
exercises can too), the lines from `# BEGIN SOLUTION` to `# END SOLUTION` (both included) become, at the
indentation of the BEGIN line:

    # YOUR CODE HERE
    raise NotImplementedError("exercise")

and, from the first exercise on, every code cell is tagged `raises-exception`: Run All (JupyterLab's, and
papermill's) goes on past an unsolved exercise, and past the cells that use its answer, to the rest of the lab;
each error stays visible where it happened (and papermill still reports the first one). Student copies open on the course kernel (`COURSE_KERNELSPEC`).

A marker without its partner, or a nested BEGIN, is a ReleaseError naming the lab, the cell and the line: a
half-stripped solution must never reach students. lab.yaml and checks.py are kept (SelfCheck needs them);
everything `lab.PRIVATE` names (hidden_checks.py, solutions/, dot files, caches) is left out, and so is the
folder the notebook's `out_dir` parameter names by default (the instructor's own runs, figures, traces).
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import labs_dir, student_labs_dir
from .solutions import replace_solutions
from .lab import NOTEBOOK, GradingError, cell_source, find_labs, student_files

PLACEHOLDER = ("# YOUR CODE HERE", 'raise NotImplementedError("exercise")')
#: The course kernel (kernels/scalelab, installed by the hub and `scalelab kernels install`): student copies open on it.
COURSE_KERNELSPEC = {"name": "scalelab", "display_name": "Python 3 (scalelab course)", "language": "python"}
#: JupyterLab's Run All and nbclient go on past a cell with this tag when it raises: an unsolved exercise does not
#: stop the rest of the lab.
GOES_ON_TAG = "raises-exception"
# Notebook metadata that only says how the reference was last executed.
_RUN_METADATA = ("papermill", "execution", "scalelab")




class ReleaseError(GradingError):
    """A lab cannot be released as it is (unbalanced solution markers, a bad output folder)."""


@dataclass
class ReleaseReport:
    """What releasing one lab did."""

    lab: str
    out: Path
    exercises: int = 0
    """Solution blocks replaced."""
    files: list[str] = field(default_factory=list)
    """Files written (relative to `out`)."""
    left_out: list[str] = field(default_factory=list)
    """Private files not copied (hidden checks, solutions, caches)."""


def strip_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """`source` with each solution block replaced by the placeholder; returns (new source, blocks replaced)."""
    return replace_solutions(source, PLACEHOLDER, where, ReleaseError)


def student_notebook(nb: dict, where: str = "lab.ipynb") -> tuple[dict, int]:
    """A student copy of a notebook (JSON dict): solutions replaced, outputs and run metadata stripped."""
    nb = copy.deepcopy(nb)
    total = 0
    goes_on = False  # from the first exercise on, every code cell goes on when it raises (it may use an answer)
    for index, cell in enumerate(nb.get("cells", [])):
        meta = cell.setdefault("metadata", {})
        for key in _RUN_METADATA:
            meta.pop(key, None)
        if cell.get("cell_type") != "code":
            continue
        source = cell_source(cell)
        new, blocks = strip_solutions(source, f"{where}: cell {index} (id {cell.get('id')!r})")
        cell["source"], cell["outputs"], cell["execution_count"] = new, [], None
        goes_on = goes_on or bool(blocks)
        if goes_on and GOES_ON_TAG not in meta.setdefault("tags", []):
            meta["tags"].append(GOES_ON_TAG)
        total += blocks
    for key in _RUN_METADATA:
        nb.get("metadata", {}).pop(key, None)
    nb.setdefault("metadata", {})["kernelspec"] = dict(COURSE_KERNELSPEC)
    return nb, total


def student_file(lab_dir: str | Path, rel: str | Path) -> tuple[bytes, int]:
    """The student version of one lab file and its solution blocks replaced: notebooks (also outputs stripped)
    and Python modules (worker code lives in modules, so exercises do too) are stripped; others are as is."""
    path, rel = Path(lab_dir) / rel, Path(rel)
    where = f"{Path(lab_dir).name}/{rel.as_posix()}"
    if rel.suffix == ".ipynb":
        nb, blocks = student_notebook(json.loads(path.read_text(encoding="utf-8")), where)
        return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode("utf-8"), blocks
    if rel.suffix == ".py":
        text, blocks = strip_solutions(path.read_text(encoding="utf-8"), where)
        return text.encode("utf-8"), blocks
    return path.read_bytes(), 0


def release_lab(lab_dir: str | Path, out_dir: str | Path) -> ReleaseReport:
    """Write the student copy of one lab into `out_dir` (replacing what was there)."""
    lab_dir, out_dir = Path(lab_dir).resolve(), Path(out_dir).resolve()
    if not (lab_dir / NOTEBOOK).is_file():
        raise ReleaseError(f"{lab_dir} is not a lab folder: it has no {NOTEBOOK}")
    if out_dir == lab_dir or lab_dir in out_dir.parents or out_dir in lab_dir.parents:
        raise ReleaseError(f"the student copy {out_dir} would overwrite or contain the reference lab {lab_dir}; "
                           "pick another --out")
    report = ReleaseReport(lab_dir.name, out_dir)
    kept = student_files(lab_dir)
    report.left_out = sorted(str(p.relative_to(lab_dir)) for p in lab_dir.rglob("*")
                             if p.is_file() and p.relative_to(lab_dir) not in set(kept))
    versions = {rel: student_file(lab_dir, rel) for rel in kept}  # every marker checked before anything is written
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for rel, (data, blocks) in versions.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            shutil.copymode(lab_dir / rel, target)
            report.files.append(str(rel))
            report.exercises += blocks
        staging.chmod(0o755)  # mkdtemp makes it 0700; students (other users) must read it
        if out_dir.exists():
            shutil.rmtree(out_dir)  # a file left out now (renamed, made private) must not linger from last time
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


def release_labs(names: list[str] | None = None, labs_root: str | Path | None = None,
                 out_root: str | Path | None = None) -> list[ReleaseReport]:
    """Release the named labs (folder names or paths), or every lab under `labs_root` (the checkout's labs/), into
    `out_root`/<name> (build/student/labs)."""
    labs_root, out_root = labs_root or labs_dir(), out_root or student_labs_dir()
    if names:
        dirs = [resolve_lab(n, labs_root) for n in names]
    else:
        dirs = find_labs(labs_root)
        if not dirs:
            raise ReleaseError(f"no labs found under {labs_root} (folders holding a {NOTEBOOK})")
    return [release_lab(d, Path(out_root) / d.name) for d in dirs]


def resolve_lab(name: str | Path, labs_root: str | Path | None = None) -> Path:
    """A lab folder from a path, or from a folder name under `labs_root` (the checkout's labs/)."""
    labs_root = labs_root or labs_dir()
    path = Path(name)
    if path.name == NOTEBOOK:
        path = path.parent
    for cand in (path, Path(labs_root) / str(name)):
        if (cand / NOTEBOOK).is_file():
            return cand.resolve()
    known = ", ".join(p.name for p in find_labs(labs_root)) or "none"
    raise ReleaseError(f"no lab {str(name)!r}: not a folder with a {NOTEBOOK}, nor a lab under {labs_root} "
                       f"(labs there: {known})")


__all__ = ["ReleaseError", "ReleaseReport", "strip_solutions", "student_notebook", "student_file", "release_lab", "release_labs",
           "resolve_lab", "PLACEHOLDER"]
