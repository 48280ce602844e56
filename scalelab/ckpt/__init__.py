"""Checkpoints: atomic writes (temp file, fsync, rename), a manifest with checksums, keep-last-k, resume.

A checkpoint is `step-<N>.pt` plus an entry in `manifest.json`; the manifest is rewritten atomically after
the file is complete, so a run killed mid-write leaves at most a stray temp file, which is never loaded.
"""
from __future__ import annotations

from .sync import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
