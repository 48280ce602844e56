"""Checks: small functions that judge the values a lab notebook recorded.

A lab folder holds `checks.py` (public: students run them through SelfCheck) and `hidden_checks.py` (kept out
of the student copy). Each defines checks with the `@check` decorator:

    from scalelab.grade.checks import check, partial

    @check(points=2)
    def speedup_is_real(r):
        '''Two workers must beat one on throughput.'''
        assert r["speedup"] > 1.2, f"speedup {r['speedup']:.2f} is below 1.2: did both ranks train?"

    @check(points=3)
    def efficiency(r):
        '''Weak-scaling efficiency close to ideal.'''
        return partial(min(1.0, r["efficiency"] / 0.9), f"efficiency {r['efficiency']:.2f} (target 0.9)")

`r` is a read-only mapping of the notebook's records; reading a name that was never recorded ends the check
as `missing` (no points) with the record's name. A check passes by returning None (full points), fails by
raising AssertionError (its message is shown to the student), and may return `partial(fraction, message)`.
Any other exception is an `error` outcome: a bug in the check or an unexpected value, reported as such.
Checks run in the grader's process on plain JSON values; they never see the student's objects.

Besides the notebook's own records, the grader adds evidence it derived itself from the run's event files
(`grader.runs`, see `scalelab.grade.evidence`); `evidence(r, r["run_dir"])` returns what the grader found for
the run a notebook says it made, so a check can hold a recorded number against it:

    @check(points=2)
    def loss_is_real(r):
        '''The recorded loss is the loss of the run the notebook made.'''
        found = evidence(r, r["run_dir"])
        assert abs(found["final_loss"] - r["final_loss"]) < 1e-6, "final_loss does not match the run's events"

A check declared with `needs_run=True` counts only if the notebook made at least one engine run whose event
files are plausible (`made_runs`): a notebook that types its numbers without running anything scores nothing on
it, even where no event backs the number the check judges (an in-process measurement, an exercise's answer).
"""
from __future__ import annotations

import importlib.util
import math
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

OUTCOMES = ("pass", "partial", "fail", "missing", "error")


@dataclass(frozen=True)
class Partial:
    """Partial credit: `fraction` of the check's points, with a message for the student."""

    fraction: float
    message: str = ""


def partial(fraction: float, message: str = "") -> Partial:
    """Partial credit in [0, 1] (clipped; NaN counts as 0)."""
    f = 0.0 if not math.isfinite(fraction) else min(1.0, max(0.0, float(fraction)))
    return Partial(f, message)


@dataclass
class Check:
    """One registered check."""

    name: str
    func: Callable[[Mapping], Any]
    points: float
    description: str
    hidden: bool = False
    needs_run: bool = False
    """Fail unless the notebook made a plausible engine run (see `made_runs`)."""


@dataclass
class CheckResult:
    """What one check concluded."""

    name: str
    outcome: str
    points: float
    max_points: float
    message: str = ""
    hidden: bool = False
    duration_s: float = 0.0
    detail: str = ""
    """Traceback of a check that crashed (for instructors; never shown for hidden checks)."""

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return dict(self.__dict__)


class MissingRecord(KeyError):
    """A check asked for a record the notebook never made."""


class Records(Mapping):
    """Read-only view of a notebook's records; a missing name raises MissingRecord."""

    def __init__(self, records: Mapping[str, Any]):
        self._data = dict(records)

    def __getitem__(self, name):
        try:
            return self._data[name]
        except KeyError:
            raise MissingRecord(name) from None

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


_LOADING = threading.local()  # .registry: the checks the file being loaded in this thread defines


def check(points: float = 1.0, name: str | None = None, needs_run: bool = False):
    """Register the decorated function as a check worth `points`; with needs_run, it fails unless the notebook
    made a plausible engine run."""
    if not (isinstance(points, (int, float)) and points > 0):
        raise ValueError(f"check points must be a number > 0, got {points!r}")

    def wrap(func):
        c = Check(name or func.__name__, func, float(points), (func.__doc__ or "").strip().splitlines()[0]
                  if func.__doc__ else func.__name__, needs_run=needs_run)
        registry = getattr(_LOADING, "registry", None)
        if registry is not None:
            registry.append(c)
        func.scalelab_check = c
        return func
    return wrap


def load_checks(path: str | Path, hidden: bool = False, hooks: dict | None = None) -> list[Check]:
    """The checks a checks file defines, in definition order (loaded as a fresh module each time). Safe to call
    from several threads at once (two grading batches in one process, the hub's dashboard): each thread collects
    into its own registry. With `hooks`, the file's GRADER_HOOKS (a dict: "heldout", the held-out set the grader
    scores the runs' checkpoints on, grade/heldout.py; "standing", records -> the student's place on a class board,
    grade/leaderboard.py) are added to it."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"scalelab_checks_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    previous, _LOADING.registry = getattr(_LOADING, "registry", None), []
    try:
        spec.loader.exec_module(module)
        found = list(_LOADING.registry)
    finally:
        _LOADING.registry = previous
    for c in found:
        c.hidden = hidden
    if hooks is not None and isinstance(getattr(module, "GRADER_HOOKS", None), dict):
        hooks.update({k: v for k, v in module.GRADER_HOOKS.items() if k in GRADER_HOOKS})
    return found


GRADER_HOOKS = ("heldout", "standing")
"""What a hidden checks file may hand the grader besides checks (its GRADER_HOOKS dict); a public checks file's are
never read (a student sees it)."""


_READS = threading.local()
"""The run folders `evidence` was asked for during the check running in this thread (grading runs threads)."""


def run_check(c: Check, records: Mapping[str, Any], reads: dict[str, list[str]] | None = None) -> CheckResult:
    """Run one check against the records and turn what it did into a CheckResult; `reads`, when given, gets
    {check name: the run folders the check read through `evidence`} (the runs behind its points)."""
    start = time.perf_counter()
    result = CheckResult(c.name, "pass", c.points, c.points, hidden=c.hidden)
    _READS.keys = []
    try:
        if c.needs_run:
            _gate(c, records)
        value = c.func(Records(records))
        if isinstance(value, Partial):
            result.points = round(c.points * value.fraction, 4)
            result.outcome = "pass" if value.fraction >= 1.0 else ("partial" if value.fraction > 0 else "fail")
            result.message = value.message
    except MissingRecord as e:
        result.outcome, result.points = "missing", 0.0
        result.message = f"the notebook did not record {e.args[0]!r}: run the cell that records it"
    except AssertionError as e:
        result.outcome, result.points = "fail", 0.0
        # A hidden check's docstring states its rule: never shown, not even for an assert without a message.
        result.message = str(e) or ("not met (a hidden check: its rule is not shown)" if c.hidden
                                    else f"{c.description}: not met")
    except Exception as e:  # noqa: BLE001 - a check that crashes must not crash the grader
        result.outcome, result.points = "error", 0.0
        result.message = f"check raised {type(e).__name__}: {e}"
        result.detail = traceback.format_exc(limit=3)
    result.duration_s = time.perf_counter() - start
    if reads is not None:
        reads[c.name] = list(dict.fromkeys(_READS.keys))
    return result


def _gate(c: Check, records: Mapping[str, Any]) -> None:
    """Fail a `needs_run` check when the notebook made no real run; a record it needs that was never made is
    reported first (`missing` says more: the run stopped before it)."""
    try:
        made_runs(Records(records))
    except AssertionError:
        try:
            c.func(Records(records))
        except MissingRecord:
            raise
        except Exception:  # noqa: BLE001 - the verdict is the missing run's, whatever the check would say
            pass
        raise


def run_checks(checks: list[Check], records: Mapping[str, Any],
               reads: dict[str, list[str]] | None = None) -> list[CheckResult]:
    """Run every check; one failing or crashing check never stops the others (`reads`: see run_check)."""
    return [run_check(c, records, reads) for c in checks]


def param(r: Mapping, name: str) -> Any:
    """The value the grader injected for parameter `name` (lab.yaml's grading parameters, or --set), None where the
    grader set no such parameter or the checks run outside the grader (SelfCheck, a test on records). Hidden checks
    size the runs they judge by it, never by what the notebook recorded: a cell may re-assign a parameter after
    injection, and the notebook's own record of it then says what ran, not what the grader asked for."""
    from .evidence import PARAMS
    given = r.get(PARAMS)
    return given.get(name) if isinstance(given, Mapping) else None


def grading_nonce(r: Mapping) -> str | None:
    """This grading's nonce (run/nonce.py), None outside the grader: a check of a computation the notebook seeded
    from it (`scalelab.run.nonce.mix_seed`) recomputes the seeds with it, so values copied from another grading,
    or computed on seeds of the student's choosing, do not fit."""
    from .evidence import NONCE
    given = r.get(NONCE)
    return given if isinstance(given, str) else None


def evidence(r: Mapping, run_dir: str, in_process: bool = False, **sizes) -> dict:
    """The grader's summary of the run in `run_dir` (from its event files); fails the check if there is none or
    if its events are not plausible.

    `sizes` hold the run to the grader's parameters: `field=value` for a field of the summary (`total_steps`,
    `steps`, `world_size`, `global_batch`, ...). A str value names a grader's parameter (`steps="panel_steps"`:
    the run's steps must be the grader's panel_steps); any other value is the expected value itself, worked out
    from `param(r, ...)` (None: not known outside the grader, not compared). A run of other sizes fails the check,
    and the message says the parameters were changed: its numbers count for nothing.

    A run made in the notebook's own process (strategy `single`: scalelab/experiments/own_step.py) is not an engine
    run and the grader does not re-run it (grade/reverify.py): it counts only where the check says `in_process=True`,
    so events labelled that way to escape re-verification do not stand in for an engine run."""
    from .evidence import RUNS, WORKDIR, relative_run_dir
    runs = r[RUNS]  # absent outside the grader and SelfCheck: the check ends as `missing`
    key = relative_run_dir(str(run_dir), r.get(WORKDIR))
    if not isinstance(runs, Mapping) or key not in runs:
        raise AssertionError(f"no event files were found for the run {run_dir!r}: the values checked must come "
                             "from a run this notebook made")
    found = runs[key]
    if isinstance(getattr(_READS, "keys", None), list):
        _READS.keys.append(key)
    if found.get("implausible"):
        raise AssertionError(f"the event files of the run {run_dir!r} cannot come from a real run "
                             f"({'; '.join(found['implausible'][:2])}): its numbers count for nothing")
    if found.get("strategy") == "single" and not in_process:
        raise AssertionError(f"the run {run_dir!r} ran in the notebook's own process (strategy 'single'); this check "
                             "needs a run of the engine (scalelab.launch)")
    for field_name, want in sizes.items():
        said = f"the grader set {want}={param(r, want)!r}" if isinstance(want, str) else \
            f"the grader's parameters make it {want!r}"
        if isinstance(want, str):
            want = param(r, want)
        if want is None:
            continue
        got = found.get(field_name)
        if got != want:
            raise AssertionError(f"the run {key!r} used {field_name}={got!r}, {said}: parameters were changed "
                                 "after injection, so this run's numbers count for nothing")
    return found


def made_runs(r: Mapping) -> dict:
    """Every run this notebook made whose events are plausible, by run dir; fails the check if there is none."""
    from .evidence import RUNS
    runs = r.get(RUNS)  # absent when no event file could be read: no real run either
    real = {k: v for k, v in runs.items() if isinstance(v, Mapping) and not v.get("implausible")} \
        if isinstance(runs, Mapping) else {}
    if not real:
        rejected = len(runs) if isinstance(runs, Mapping) else 0
        raise AssertionError("this notebook made no training run whose event files the grader could verify"
                             + (f" ({rejected} run(s) with implausible events were rejected)" if rejected else "")
                             + ": checks of measured numbers count only once the notebook's own runs have run")
    return real


def close(found, recorded, rel: float = 1e-6, what: str = "value") -> None:
    """Assert that a recorded number equals the one the grader re-derived (relative tolerance `rel`)."""
    ok = isinstance(found, (int, float)) and isinstance(recorded, (int, float)) and \
        math.isclose(found, recorded, rel_tol=rel, abs_tol=1e-12)
    assert ok, f"the recorded {what} ({recorded!r:.12}) is not what the run's event files show ({found!r:.12})"


def lab_checks(lab_dir: str | Path, include_hidden: bool = True, hooks: dict | None = None) -> list[Check]:
    """A lab's public checks (checks.py) and, unless excluded, its hidden ones (hidden_checks.py), whose
    GRADER_HOOKS go into `hooks` when given."""
    lab_dir = Path(lab_dir)
    checks = load_checks(lab_dir / "checks.py") if (lab_dir / "checks.py").exists() else []
    hidden = lab_dir / "hidden_checks.py"
    if include_hidden and hidden.exists():
        checks += load_checks(hidden, hidden=True, hooks=hooks)
    return checks


__all__ = ["check", "partial", "Partial", "param", "grading_nonce", "evidence", "made_runs", "close", "Check", "CheckResult", "MissingRecord", "Records", "OUTCOMES",
           "load_checks", "run_check", "run_checks", "lab_checks"]
