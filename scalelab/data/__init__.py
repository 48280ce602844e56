"""Data for training runs: seeded generators, on-disk arrays, and distributed loaders."""
from __future__ import annotations

from .loader import build_dataset, build_loader

__all__ = ["build_dataset", "build_loader"]
