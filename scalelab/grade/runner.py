"""The sandboxed side of grading one submission: `python -m scalelab.grade.runner JOB.json`.

The grader writes JOB.json (notebook, working copy, parameters, limits, sandbox plan) and starts this module in
its own session. It confines itself (`apply_sandbox`) before anything of the student's runs, executes the
notebook with `execute_notebook`, and writes what happened to JOB["outcome"] as JSON. The grader treats that
file like everything else in the job folder: as data the student could have written.

Parameters the submission's `parameters` cell no longer declares, or all of them when no cell is tagged
`parameters` any more, are left out (with a note) rather than failing the whole run: the student then runs with
their own values of those.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..course.execute import NotebookError, NotebookParameterError, NotebookResult, execute_notebook
from ..run.procs import kill_processes
from .sandbox import SandboxError, SandboxPlan
from .confine import apply_sandbox

MAX_TRACEBACK_CHARS = 8000


def main(argv: list[str]) -> int:
    """Run one job; the exit status is 0 whenever an outcome file was written."""
    job = json.loads(Path(argv[0]).read_text())
    start = time.monotonic()
    try:
        apply_sandbox(SandboxPlan.from_dict(job["sandbox"]))
    except (SandboxError, OSError) as e:
        _write(job, {"status": "grader_error", "message": f"the sandbox could not be set up: {e}"})
        return 0
    os.chdir(job["cwd"])
    outcome = _execute(job)
    _reap_descendants()
    outcome["duration_s"] = round(time.monotonic() - start, 3)
    _write(job, outcome)
    return 0


def _execute(job: dict) -> dict:
    notes = []
    parameters = dict(job["parameters"])
    if parameters and not _has_parameters_cell(job["notebook"]):
        notes.append("your notebook has no cell tagged 'parameters' (was the tag removed?): the grader's "
                     f"parameters {sorted(parameters)} could not be set, so your own values were used")
        parameters = {}
    kw = dict(output_path=job["output"], cwd=job["cwd"], cell_timeout=job["cell_timeout"],
              total_timeout=job["total_timeout"])
    try:
        try:
            result = execute_notebook(job["notebook"], parameters, **kw)
        except NotebookParameterError as e:
            if not e.unknown:
                raise
            notes.append(f"your notebook's parameters cell does not declare {list(e.unknown)}: the grader could not "
                         "set them, so your own values were used")
            result = execute_notebook(job["notebook"], {k: v for k, v in parameters.items() if k not in e.unknown},
                                      **kw)
    except NotebookParameterError as e:
        return {"status": "malformed", "message": str(e), "notes": notes}
    except NotebookError as e:
        return {"status": "grader_error", "message": f"the notebook could not be executed: {e}", "notes": notes}
    return {**describe(result), "notes": notes}


def _has_parameters_cell(path: str) -> bool:
    """Whether a cell is tagged `parameters` (a file that is no notebook: True, execute_notebook says why)."""
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
        return any("parameters" in c.get("metadata", {}).get("tags", []) for c in cells)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True


def describe(result: NotebookResult) -> dict:
    """A NotebookResult as JSON data: status, and where and how it failed (no records: the grader reads those)."""
    out = {"status": result.status, "message": ""}
    err = result.error
    if err is None:
        return out
    out["message"] = str(err)
    for name in ("cell_index", "cell_id", "ename", "evalue", "limit_s"):
        if getattr(err, name, None) is not None:
            out[name] = getattr(err, name)
    if getattr(err, "cell_tags", None):
        out["cell_tags"] = list(err.cell_tags)
    if getattr(err, "source", ""):
        out["source"] = err.source[:MAX_TRACEBACK_CHARS]
    if getattr(err, "traceback", ""):
        out["traceback"] = err.traceback[-MAX_TRACEBACK_CHARS:]
    return out


def _reap_descendants() -> None:
    # We are a subreaper: whatever the run left behind (a daemon it double-forked) is our descendant by now.
    import psutil
    kill_processes(psutil.Process().children(recursive=True), grace_s=0, tree=False)


def _write(job: dict, outcome: dict) -> None:
    tmp = Path(job["outcome"] + ".tmp")
    tmp.write_text(json.dumps(outcome, default=str))
    tmp.replace(job["outcome"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
