"""Evidence the grader works out itself from a run's files, for checks to hold records against.

A record is just a value the notebook displayed: a student can type `record("final_loss", 0.01)` without
training anything. What the engine writes while it runs — per-rank event files, `<run dir>/events/rank-N.jsonl`
— is harder to fake consistently, so after a run the grader scans the working copy for them and adds:

    grader.runs      {run dir relative to the working copy: summary re-derived from its events}
    grader.workdir   the working copy's absolute path (to relate absolute run dirs a notebook recorded)
    grader.parameters  the parameters the grader injected (`apply_parameters`, which also puts them in force in the
                     notebook's record of its parameters, `labNN_params`, and keeps what that said in
                     grader.changed_parameters where it differed)

A summary describes the run's *last launch* (what `Run.wait()` reported to the notebook; a resume appends a
second launch to the same files): world_size, steps, start_step, launches, final_loss, samples_per_s,
per_rank_samples_per_s, eval_accuracy, time_fraction, loss_curve, strategy, checkpoints, blocked_s,
checkpoint_history, t_start, t_end, total_steps and global_batch (rank 0's start event: the sizes the run was
given, to hold against the grader's parameters), lr_curve and step_numbers (rank 0's step events), wire_bytes_per_step (the median
of rank 0's step events: what a DDP rank sent per step, ring model), comm_hook, schedule, code (the start event's
{file: sha256} of code of the student's own the run imported), hosts (where the ranks started) and pipeline (a
pipelined run's schedule, activation bytes and bubble per stage from its `pipeline` events, else None) — and `implausible`, the reasons the events cannot come from a real run
(empty when none were found). Records named `grader.*` that the notebook made itself are dropped first (a
student cannot forge evidence by recording it). Checks read the evidence with `checks.evidence(r, run_dir)`,
which fails on an implausible run, and `checks.made_runs(r)`.

Plausibility (`implausible`) holds the events to what the engine's training loop cannot help writing:
rank files rank-0..N-1 whose start events all say world size N; every event of a file from its own rank, in
time order, stamped between the run's start (`started`, when the grader passes it) and the time of reading;
step numbers rising within a launch, after its start_step and up to its total_steps; each step's samples/s (where
written) equal to samples over step time, its data and compute time inside the step; the wall clock advancing between two step
events by at least the later step's own time; an end event whose elapsed time covers its launch and whose final
loss is the mean of the ranks' last losses.

Limit: the event files are written by processes the student's code controls too. A program that writes events
paced like a real run, with every number consistent, defeats this; so does running the engine and recording its
numbers while forging the values that no event backs (see docs/grading.md, "Forged records").
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from ..run.metrics import summarize
from .untrusted import UntrustedFileError, read_beneath

PREFIX = "grader."
RUNS = PREFIX + "runs"
WORKDIR = PREFIX + "workdir"
PARAMS = PREFIX + "parameters"
"""The parameters the grader injected (lab.yaml's grading parameters and --set): hidden checks compare the runs'
sizes with these, never with what the notebook recorded (`checks.param`, `checks.evidence(..., steps="steps")`)."""
NONCE = PREFIX + "nonce"
"""The grading's nonce (run/nonce.py): checks of a computation seeded from it (`checks.grading_nonce`) recompute
the seeds, so numbers copied from another grading do not fit."""
CHANGED = PREFIX + "changed_parameters"
"""{parameter: the value the notebook recorded} where a record of the lab's parameters (`labNN_params`) disagreed
with the grader's value: a cell changed the parameter after the grader injected it."""
PARAMS_RECORD = re.compile(r"lab\d{2}_params")
MAX_RUNS = 64
MAX_EVENT_BYTES = 32 * 2**20
MAX_DEPTH = 8
MAX_ENTRIES = 100_000  # names looked at in a working copy (the real labs' hold under 2 300): a folder of a million
# empty ones must not stall the grader or the instructors' dashboard
MAX_CURVE = 5000
MAX_REASONS = 5
CLOCK_SLACK_S = 2.0
"""Seconds of disagreement allowed between the run's clock and the grader's (same host: only rounding)."""
RANK_FILE = re.compile(r"rank-(\d{1,6})\.jsonl")
FIRST_START_FIELDS = ("strategy", "world_size", "global_batch", "total_steps", "start_step", "threads", "elastic")
"""What the summary keeps of rank 0's first start event (`first_start`): the launch a grader's re-run repeats."""


def strip_grader_records(records: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`records` without names in the grader's namespace; returns (kept, dropped names)."""
    dropped = sorted(n for n in records if n.startswith(PREFIX))
    return {k: v for k, v in records.items() if not k.startswith(PREFIX)}, dropped


def apply_parameters(records: dict[str, Any], parameters: dict[str, Any]) -> list[str]:
    """Make the grader's parameters the ones the checks read (`records` changed in place); notes for the student.

    Adds PARAMS (the grader's values). Every record of the lab's parameters (`lab01_params` ...: the values the
    notebook says it ran with) takes the grader's value for each parameter the grader set, so checks that hold a
    run against it hold it against the grader's sizes; where the notebook's value differed (a cell re-assigned the
    parameter after injection), CHANGED keeps what it recorded, and the note says which."""
    records[PARAMS] = dict(parameters)
    changed: dict[str, Any] = {}
    for name in sorted(n for n in records if PARAMS_RECORD.fullmatch(n)):
        value = records[name]
        if not isinstance(value, dict):
            continue
        value = dict(value)
        for key in sorted(set(value) & set(parameters)):
            if not _same_value(value[key], parameters[key]):
                changed.setdefault(key, value[key])
            value[key] = parameters[key]
        records[name] = value
    if changed:
        records[CHANGED] = changed
        said = ", ".join(f"{k}={_short(v)} (the grader set {_short(parameters[k])})" for k, v in changed.items())
        return [f"the notebook ran with {said}: parameters were changed after the grader injected them; checks "
                "hold the runs against the grader's values, and runs of other sizes lose their points"]
    return []


def _same_value(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_evidence(workdir: str | Path, started: float | None = None, now: float | None = None,
                 nonce: str | None = None) -> dict[str, Any]:
    """The `grader.*` records for a finished run's working copy (no symbolic link followed).

    started: wall-clock time (time.time()) before the working copy was made; events stamped earlier were not
    written by this run. None (the default) skips that bound. now: the upper bound, default the time of reading.
    nonce: the grading's nonce (run/nonce.py); every start event must carry it, else the run was made elsewhere."""
    workdir = Path(workdir)
    now = time.time() if now is None else now
    runs: dict[str, Any] = {}
    budget = MAX_EVENT_BYTES
    for rel_dir, filenames in _bounded_walk(workdir, MAX_DEPTH, MAX_ENTRIES):
        if rel_dir.name != "events" or len(runs) >= MAX_RUNS:
            continue
        rank_files = sorted((f for f in filenames if RANK_FILE.fullmatch(f)), key=lambda f: int(f[5:-6]))
        if not rank_files:
            continue
        files, budget = _read_events(workdir, rel_dir, rank_files, budget)
        runs[rel_dir.parent.as_posix()] = _summary(files, started, now, nonce)
    return {RUNS: runs, WORKDIR: str(workdir)}


def _bounded_walk(root: Path, max_depth: int, max_entries: int):
    """(folder relative to root, its file names), top down, no link followed, at most `max_depth` folders deep and
    `max_entries` names looked at in all (what lies beyond is not read)."""
    seen, stack = 0, [Path()]
    while stack:
        rel = stack.pop()
        files, folders = [], []
        try:
            with os.scandir(root / rel) as it:
                for entry in it:
                    seen += 1
                    if seen > max_entries:
                        break
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(entry.name)
                        elif entry.is_file(follow_symlinks=False):
                            files.append(entry.name)
                    except OSError:
                        continue
        except OSError:
            continue
        yield rel, files
        if seen > max_entries:
            return
        if len(rel.parts) < max_depth:
            stack.extend(rel / name for name in sorted(folders, reverse=True))


def _read_events(workdir: Path, rel_dir: Path, names: list[str], budget: int) -> tuple[dict[int, list], int]:
    """{rank: its events in file order}; a rank file that cannot be read counts as empty."""
    files: dict[int, list] = {}
    for name in names:
        events = files.setdefault(int(name[5:-6]), [])
        if budget <= 0:
            continue
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
    return files, budget


def _launches(events: list[dict]) -> list[list[dict]]:
    """A rank's events split at each start event (a resume appends a new launch to the same file)."""
    out: list[list[dict]] = []
    for e in events:
        if e.get("type") == "start" or not out:
            out.append([])
        out[-1].append(e)
    return out


def _summary(files: dict[int, list], started: float | None, now: float, nonce: str | None = None) -> dict[str, Any]:
    world_size = len(files)
    launches = {rank: _launches(events) for rank, events in files.items()}
    try:
        reasons = implausible(files, launches, started, now, nonce)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
        reasons = [f"malformed events ({type(e).__name__}: {e})"]
    last = [e for rank in sorted(launches) for e in (launches[rank][-1] if launches[rank] else [])]
    try:
        s = summarize(last, world_size)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        return {"error": f"event files could not be summarised ({type(e).__name__}: {e})", "world_size": world_size,
                "implausible": reasons or [f"event files could not be summarised ({type(e).__name__})"]}
    keep = ("world_size", "steps", "final_loss", "samples_per_s", "per_rank_samples_per_s", "eval_accuracy",
            "time_fraction", "loss_curve")
    out = {k: s.get(k) for k in keep}
    out["loss_curve"] = list(out["loss_curve"] or [])[:MAX_CURVE]
    if isinstance(out["final_loss"], float) and not math.isfinite(out["final_loss"]):
        out["final_loss"] = None
    main = launches.get(0, [[]])[-1] if launches.get(0) else []
    start = main[0] if main and main[0].get("type") == "start" else {}
    opening = launches[0][0] if launches.get(0) and launches[0][0] else []
    first = opening[0] if opening and opening[0].get("type") == "start" else {}  # rank 0's first launch
    steps = [e for e in main if e.get("type") == "step"]
    wire = [e.get("wire_bytes") for e in steps if isinstance(e.get("wire_bytes"), (int, float))]
    out.update(lr_curve=[e.get("lr") for e in steps][:MAX_CURVE], step_numbers=[e.get("step") for e in steps][:MAX_CURVE],
               evals=[[e.get("step"), e.get("accuracy")] for e in main if e.get("type") == "eval"][:MAX_CURVE],
               wire_bytes_per_step=sorted(wire)[len(wire) // 2] if wire else None,
               comm_hook=start.get("comm_hook"), schedule=start.get("schedule"),
               code=start.get("code") if isinstance(start.get("code"), dict) else {},
               hosts=sorted({str(e.get("host")) for r in sorted(launches) for e in
                             (launches[r][-1][:1] if launches[r] else []) if e.get("type") == "start"}))
    out.update(launches=len(launches.get(0, [])), start_step=start.get("start_step"), strategy=start.get("strategy"),
               total_steps=start.get("total_steps"), global_batch=start.get("global_batch"), nonce=start.get("nonce"),
               first_start={k: first.get(k) for k in FIRST_START_FIELDS},
               t_start=main[0].get("t") if main else None, t_end=main[-1].get("t") if main else None,
               **_checkpoints(main), implausible=reasons)
    out["pipeline"] = _pipeline(launches)
    return out


def _pipeline(launches: dict[int, list]) -> dict[str, Any] | None:
    """The pipeline events of a pipelined run's last launch (train/pipeline.py, record_pipeline), or None: its
    schedule, micro-batches and stages; per stage (from the lowest rank of each) the last step's
    activation_peak_bytes, peak_in_flight and operations in order (`ops`); the bubble of every step as rank 0
    wrote it (replayed from all stages' timelines) and `bubble`, the least after the first step (which pays for
    warm-up: load only ever adds to a step's bubble), with that step's idle fraction of each stage (`stage_idle`)."""
    per: dict[int, list] = {}
    for rank in sorted(launches):
        launch = launches[rank][-1] if launches[rank] else []
        events = [e for e in launch if e.get("type") == "pipeline"]
        if events:
            per[rank] = events
    if not per:
        return None
    main = per[min(per)]
    by_stage: dict = {}
    for rank in sorted(per):
        stage = per[rank][-1].get("stage")
        if isinstance(stage, int) and not isinstance(stage, bool) and stage not in by_stage:
            by_stage[stage] = per[rank][-1]
    stages = [by_stage[s] for s in sorted(by_stage)]
    measured = [e for e in main if isinstance(e.get("bubble"), (int, float)) and not isinstance(e.get("bubble"), bool)
                and math.isfinite(e["bubble"])]
    best = min(measured[1:] or measured, key=lambda e: e["bubble"], default=None)
    last = main[-1]
    return {"schedule": last.get("schedule"), "micro": last.get("micro"), "stages": last.get("stages"),
            "steps": len(main), "activation_peak_bytes": [e.get("activation_peak_bytes") for e in stages],
            "peak_in_flight": [e.get("peak_in_flight") for e in stages],
            "ops": [str(e.get("ops"))[:20_000] for e in stages],
            "bubble": best["bubble"] if best else None,
            "stage_idle": best.get("stage_idle") if best else None,
            "bubble_per_step": [e["bubble"] for e in measured][:MAX_CURVE]}


def _checkpoints(events: list[dict]) -> dict[str, Any]:
    """Rank 0's checkpoints of one launch: count, the time they blocked training (as the lab's timeline counts
    it: save calls plus waits for a flush still in flight), and their (step, metric) history."""
    saves = [e for e in events if e.get("type") == "checkpoint"]
    done = [e for e in events if e.get("type") == "checkpoint_done"]
    # (t) - (t - blocked_s), as the timeline computes it from the block's ends: the same rounding, the same sum
    blocked = sum(_num(e.get("t")) - (_num(e.get("t")) - _num(e.get("blocked_s"))) for e in saves) \
        + sum(_num(e.get("update_wait_s", 0.0)) for e in done)
    return {"checkpoints": len(saves), "blocked_s": blocked,
            "checkpoint_history": [{"step": e.get("step"), "metric": e.get("metric")} for e in saves][:MAX_CURVE]}


def _num(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {str(value)[:40]!r}")
    return float(value)


def implausible(files: dict[int, list], launches: dict[int, list], started: float | None, now: float,
                nonce: str | None = None) -> list[str]:
    """Why these rank files cannot be the events of one real run (the empty list: no reason found); with `nonce`,
    also why they cannot come from this grading's runs (a start event without it)."""
    reasons: list[str] = []
    n = len(files)
    if sorted(files) != list(range(n)):
        reasons.append(f"rank files {sorted(files)} are not rank-0 .. rank-{n - 1}")
    for rank, events in sorted(files.items()):
        if not events:
            reasons.append(f"rank {rank} wrote no events")
            continue
        reasons += _file_reasons(rank, events, n, started, now)
        if nonce is not None and any(e.get("nonce") != nonce for e in events if e.get("type") == "start"):
            reasons.append(f"rank {rank}: its start event carries another grading's nonce (or none): the run was not "
                           "made by this notebook while it was graded (copied from another run?)")
        for launch in launches[rank]:
            reasons += _launch_reasons(rank, launch)
        if len(reasons) >= MAX_REASONS:
            break
    if not reasons:
        reasons += _final_loss_reasons(launches)
    return reasons[:MAX_REASONS]


def _file_reasons(rank: int, events: list[dict], world_size: int, started: float | None, now: float) -> list[str]:
    """One rank file: its own rank only, a world size that matches the files, time that only moves forward and
    lies inside the run."""
    out = []
    times = [_num(e.get("t")) for e in events]
    if any(e.get("rank") != rank for e in events):
        out.append(f"rank-{rank}.jsonl holds events of another rank")
    sizes = {e.get("world_size") for e in events if e.get("type") == "start"}
    if sizes != {world_size}:
        out.append(f"rank {rank}: start events say world size {sorted(map(str, sizes))}, but there are "
                   f"{world_size} rank files")
    if any(b < a - 1e-3 for a, b in zip(times, times[1:])):
        out.append(f"rank {rank}: event times go backwards")
    if started is not None and min(times) < started - CLOCK_SLACK_S:
        out.append(f"rank {rank}: events stamped {started - min(times):.0f} s before this run started")
    if max(times) > now + CLOCK_SLACK_S:
        out.append(f"rank {rank}: events stamped {max(times) - now:.0f} s in the future")
    return out


def _launch_reasons(rank: int, launch: list[dict]) -> list[str]:
    """One launch of one rank: a start event, rising steps inside [start_step, total_steps], step numbers that
    follow from each other, wall time that covers the measured step times, an end event that covers the launch."""
    start = launch[0]
    if start.get("type") != "start":
        return [f"rank {rank}: events before any start event"]
    first, total = int(_num(start.get("start_step"))), int(_num(start.get("total_steps")))
    steps = [e for e in launch if e.get("type") == "step"]
    out, prev_step, prev_t = [], first, _num(start["t"])
    busy = 0.0
    for e in steps:
        step, t = _num(e.get("step")), _num(e.get("t"))
        step_s, samples = _num(e.get("step_s")), _num(e.get("samples"))
        if not prev_step < step <= total:
            out.append(f"rank {rank}: step {step:g} after step {prev_step:g} (steps {first}..{total})")
        if step_s <= 0 or samples <= 0 or ("samples_per_s" in e and not math.isclose(
                _num(e["samples_per_s"]), samples / step_s, rel_tol=1e-6)):
            out.append(f"rank {rank}, step {step:g}: samples/s is not samples over step time")
        if any(not 0 <= _num(e[k]) <= step_s * (1 + 1e-6) for k in ("data_s", "compute_s") if k in e):
            out.append(f"rank {rank}, step {step:g}: data or compute time outside the step")
        if t - prev_t < step_s * 0.99 - 2e-4:  # the step ran between the two events: the clock moved that far
            out.append(f"rank {rank}, step {step:g}: took {step_s:.4f} s, but only {max(t - prev_t, 0):.4f} s "
                       "passed since the event before")
        prev_step, prev_t, busy = step, t, busy + step_s
        if out:
            return out
    ends = [e for e in launch if e.get("type") == "end"]
    if ends:
        end = ends[-1]
        span = _num(end["t"]) - _num(start["t"])
        if steps and (prev_step != total or int(_num(end.get("steps", total))) != total):
            out.append(f"rank {rank}: the run ended at step {prev_step:g}, not at its total of {total}")
        if _num(end.get("elapsed_s", span)) < span - 0.5 or busy > span * 1.01 + 2e-3:
            out.append(f"rank {rank}: the end event's times do not cover the launch")
    return out


def _final_loss_reasons(launches: dict[int, list]) -> list[str]:
    """The end event's final loss is the mean of every rank's last step loss (the loop all-reduces it)."""
    last_losses, finals = [], []
    for rank in sorted(launches):
        launch = launches[rank][-1] if launches[rank] else []
        steps = [e for e in launch if e.get("type") == "step"]
        ends = [e for e in launch if e.get("type") == "end"]
        if not steps or not ends:
            return []  # a run that did not finish: nothing to compare
        last_losses.append(steps[-1].get("loss"))
        finals.append(ends[-1].get("final_loss"))
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in last_losses + finals):
        return []  # a diverged run (NaN) is a real outcome, not a forgery sign
    mean = sum(last_losses) / len(last_losses)
    if not all(math.isclose(f, mean, rel_tol=1e-4, abs_tol=1e-6) for f in finals):
        return [f"final loss {finals[0]:.6g} is not the mean {mean:.6g} of the ranks' last losses"]
    return []


def relative_run_dir(run_dir: str, workdir: str | None) -> str:
    """A recorded run dir as a key of `grader.runs`: relative to the working copy, '/'-separated."""
    text = str(run_dir)
    if workdir and os.path.isabs(text):
        try:
            text = os.path.relpath(text, workdir)
        except ValueError:
            return text
    return Path(os.path.normpath(text)).as_posix()


__all__ = ["PREFIX", "RUNS", "WORKDIR", "PARAMS", "NONCE", "CHANGED", "apply_parameters", "strip_grader_records", "run_evidence", "implausible", "relative_run_dir"]
