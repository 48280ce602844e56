"""Evidence the grader works out itself from a run's files, for checks to hold records against.

A record is just a value the notebook displayed: a student can type `record("final_loss", 0.01)` without
training anything. What the engine writes while it runs — per-rank event files, `<run dir>/events/rank-N.jsonl`
— is harder to fake consistently, so after a run the grader scans the working copy for them and adds:

    grader.runs      {run dir relative to the working copy: summary re-derived from its events
                      (steps, final_loss, samples_per_s, loss_curve, world_size)}
    grader.workdir   the working copy's absolute path (to relate absolute run dirs a notebook recorded)

Records named `grader.*` that the notebook made itself are dropped first (a student cannot forge evidence by
recording it). Checks read the evidence with `checks.evidence(r, run_dir)`.

Limit: the event files are written by processes the student's code controls too; a student who writes
plausible event files by hand defeats this. Evidence raises the cost of forging (the numbers must agree across
records, event files and the loss curve); hidden checks that recompute one number from several raise it more.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..run.metrics import summarize
from .untrusted import UntrustedFileError, read_beneath

PREFIX = "grader."
RUNS = PREFIX + "runs"
WORKDIR = PREFIX + "workdir"
MAX_RUNS = 64
MAX_EVENT_BYTES = 32 * 2**20
MAX_DEPTH = 8
MAX_CURVE = 5000


def strip_grader_records(records: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`records` without names in the grader's namespace; returns (kept, dropped names)."""
    dropped = sorted(n for n in records if n.startswith(PREFIX))
    return {k: v for k, v in records.items() if not k.startswith(PREFIX)}, dropped


def run_evidence(workdir: str | Path) -> dict[str, Any]:
    """The `grader.*` records for a finished run's working copy (no symbolic link followed)."""
    workdir = Path(workdir)
    runs: dict[str, Any] = {}
    budget = MAX_EVENT_BYTES
    for dirpath, dirnames, filenames in os.walk(workdir, followlinks=False):
        rel_dir = Path(dirpath).relative_to(workdir)
        if len(rel_dir.parts) >= MAX_DEPTH:
            dirnames[:] = []
        if rel_dir.name != "events" or len(runs) >= MAX_RUNS:
            continue
        rank_files = sorted(f for f in filenames if f.startswith("rank-") and f.endswith(".jsonl"))
        if not rank_files:
            continue
        events, budget = _read_events(workdir, rel_dir, rank_files, budget)
        runs[rel_dir.parent.as_posix()] = _summary(events, len(rank_files))
    return {RUNS: runs, WORKDIR: str(workdir)}


def _read_events(workdir: Path, rel_dir: Path, names: list[str], budget: int) -> tuple[list[dict], int]:
    events = []
    for name in names:
        if budget <= 0:
            break
        try:
            data = read_beneath(workdir, rel_dir / name, budget)
        except UntrustedFileError:
            continue
        budget -= len(data)
        for line in data.splitlines():
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line cut short by a killed rank, or junk: the rest still counts
            if isinstance(event, dict):
                events.append(event)
    return events, budget


def _summary(events: list[dict], world_size: int) -> dict[str, Any]:
    try:
        s = summarize(events, world_size)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return {"error": f"event files could not be summarised ({type(e).__name__}: {e})", "world_size": world_size}
    keep = ("world_size", "steps", "final_loss", "samples_per_s", "eval_accuracy", "loss_curve")
    out = {k: s.get(k) for k in keep}
    out["loss_curve"] = list(out["loss_curve"] or [])[:MAX_CURVE]
    if isinstance(out["final_loss"], float) and not math.isfinite(out["final_loss"]):
        out["final_loss"] = None
    return out


def relative_run_dir(run_dir: str, workdir: str | None) -> str:
    """A recorded run dir as a key of `grader.runs`: relative to the working copy, '/'-separated."""
    text = str(run_dir)
    if workdir and os.path.isabs(text):
        try:
            text = os.path.relpath(text, workdir)
        except ValueError:
            return text
    return Path(os.path.normpath(text)).as_posix()


__all__ = ["PREFIX", "RUNS", "WORKDIR", "strip_grader_records", "run_evidence", "relative_run_dir"]
