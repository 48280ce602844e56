"""Grading: check a notebook's records (`checks`, `evidence`), grade submissions confined (`grader`, `job`; the
grader's side of the sandbox in `sandbox`, the confined run's in `runner` and `confine`), write reports
(`report`), self-check (`selfcheck`). Executing notebooks and releasing student copies are the course's
(`scalelab.course.execute`, `scalelab.course.release`); their names are re-exported here for older callers.

Importing this package is cheap: papermill, nbformat and psutil are imported only when a notebook runs, and the
grading modules only when one of their names is used.
"""
from __future__ import annotations

import importlib

from ..course.execute import (NotebookCellError, NotebookCellTimeout, NotebookDeadKernel, NotebookError,
                              NotebookMalformed, NotebookParameterError, NotebookResult, NotebookTimeout,
                              execute_notebook)

_LAZY = {
    "grade": "grader", "GradeOptions": "grader", "Submission": "grader", "SubmissionResult": "grader",
    "BatchResult": "grader", "collect_submissions": "grader",
    "GradingError": "..course.lab", "Lab": "..course.lab", "load_lab": "..course.lab",
    "release_lab": "..course.release", "release_labs": "..course.release", "ReleaseError": "..course.release",
    "ReleaseReport": "..course.release",
    "self_check": "selfcheck", "SelfCheckReport": "selfcheck",
    "SandboxPolicy": "sandbox", "SandboxError": "sandbox",
}


def __getattr__(name):
    if name in _LAZY:
        module = _LAZY[name]
        return getattr(importlib.import_module(module if module.startswith(".") else f".{module}", __name__), name)
    raise AttributeError(f"module 'scalelab.grade' has no attribute {name!r}")


__all__ = [
    "NotebookCellError", "NotebookCellTimeout", "NotebookDeadKernel", "NotebookError", "NotebookMalformed",
    "NotebookParameterError", "NotebookResult", "NotebookTimeout", "execute_notebook", *_LAZY,
]
