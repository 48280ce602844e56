"""Grading: execute notebooks with papermill (`execute`), check their records (`checks`), grade submissions
in a sandbox (`grader`, `sandbox`), write reports (`report`), release student copies (`release`), self-check
(`selfcheck`).

Importing this package is cheap: papermill, nbformat and psutil are imported only when a notebook runs, and the
grading modules only when one of their names is used.
"""
from __future__ import annotations

import importlib

from .execute import (
    NotebookCellError,
    NotebookCellTimeout,
    NotebookDeadKernel,
    NotebookError,
    NotebookMalformed,
    NotebookParameterError,
    NotebookResult,
    NotebookTimeout,
    execute_notebook,
)

_LAZY = {
    "grade": "grader", "GradeOptions": "grader", "Submission": "grader", "SubmissionResult": "grader",
    "BatchResult": "grader", "collect_submissions": "grader",
    "GradingError": "lab", "Lab": "lab", "load_lab": "lab",
    "release_lab": "release", "release_labs": "release", "ReleaseError": "release", "ReleaseReport": "release",
    "self_check": "selfcheck", "SelfCheckReport": "selfcheck",
    "SandboxPolicy": "sandbox", "SandboxError": "sandbox",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'scalelab.grade' has no attribute {name!r}")


__all__ = [
    "NotebookCellError", "NotebookCellTimeout", "NotebookDeadKernel", "NotebookError", "NotebookMalformed",
    "NotebookParameterError", "NotebookResult", "NotebookTimeout", "execute_notebook", *_LAZY,
]
