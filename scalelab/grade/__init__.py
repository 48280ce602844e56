"""Grading: execute notebooks with papermill (`execute`), then check their records.

Importing this package is cheap: papermill, nbformat and psutil are imported only when a notebook runs.
"""
from __future__ import annotations

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

__all__ = [
    "NotebookCellError", "NotebookCellTimeout", "NotebookDeadKernel", "NotebookError", "NotebookMalformed",
    "NotebookParameterError", "NotebookResult", "NotebookTimeout", "execute_notebook",
]
