"""pytest-facing helpers for lab tests: run a lab's notebook and get its records, or a readable test failure.

    from scalelab.testing import run_lab

    def test_lab01_speedup_is_recorded():
        records = run_lab("labs/01_ddp", steps=5, workers=2)
        assert records["speedup"] > 1.0

The lab runs in its own folder (as it would in JupyterLab), its executed copy goes to a fresh temporary
folder (named in the failure message and kept when the run fails; `run_lab` removes it after a run that
passed), and any failure fails the test with
the failing cell's source and traceback instead of a papermill stack.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..course.execute import NotebookResult, execute_notebook

LAB_NOTEBOOK = "lab.ipynb"


def lab_notebook(lab_dir: str | Path) -> Path:
    """The notebook of a lab: `<lab_dir>/lab.ipynb`, or `lab_dir` itself when it is an .ipynb file."""
    path = Path(lab_dir)
    return path if path.suffix == ".ipynb" else path / LAB_NOTEBOOK


def execute_lab(lab_dir: str | Path, parameters: dict | None = None, *, output_dir: str | Path | None = None,
                **execute_kwargs: Any) -> NotebookResult:
    """Execute a lab with `parameters` (options as for `execute_notebook`); fails the test unless it ran ok."""
    nb = lab_notebook(lab_dir)
    out_dir = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix=f"scalelab-{nb.parent.name}-"))
    result = execute_notebook(nb, parameters, output_path=out_dir / nb.name, **execute_kwargs)
    if not result.ok:
        import pytest
        pytest.fail(format_failure(result), pytrace=False)
    return result


def run_lab(lab_dir: str | Path, /, **parameters: Any) -> dict[str, Any]:
    """Execute a lab with these parameters and return its records; fails the test readably otherwise."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"scalelab-{lab_notebook(lab_dir).parent.name}-"))
    records = execute_lab(lab_dir, parameters, output_dir=out_dir).records
    shutil.rmtree(out_dir, ignore_errors=True)  # kept only when the run failed (pytest.fail skips this line)
    return records


def format_failure(result: NotebookResult) -> str:
    """A failed run as text for a test report: what failed, the cell's source and traceback, the records so far."""
    assert result.error is not None, "format_failure() needs a failed result"
    lines = [f"notebook {result.path} did not run to the end (status {result.status!r})",
             result.error.details(),
             f"records before the failure: {sorted(result.records)}"]
    if result.output_path:
        lines.append(f"executed notebook: {result.output_path}")
    return "\n".join(lines)
