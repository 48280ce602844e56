"""Shared helpers of the lab tests (tests/test_lab0N_*.py): student copies, grading, the reference run.

A student copy is built the way `scalelab labs release` builds it (solution blocks replaced by a stub, hidden
checks left out); `grade` runs a lab's public and hidden checks on records; `run_reference` executes a lab's
reference notebook under papermill at its grading parameters once per test module, as the site build does.
"""
from __future__ import annotations

import copy
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from scalelab.course.release import strip_solutions
from scalelab.grade.checks import lab_checks, run_checks
from scalelab.grade.evidence import run_evidence
from scalelab.course.executed import ensure_executed
from scalelab.record import read_records

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"


def student_source(source: str) -> str:
    """A cell's source as the release writes it: each solution block (markers included) becomes the exercise stub."""
    return strip_solutions(source)[0]


def student_copy(lab_dir: Path, dest: Path) -> Path:
    """Copy a lab without hidden checks and with its solutions removed; returns the copy's folder."""
    dest = Path(dest) / lab_dir.name
    shutil.copytree(lab_dir, dest, ignore=shutil.ignore_patterns("hidden_checks.py", "runs", "__pycache__"))
    nb = json.loads((lab_dir / "lab.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["source"] = student_source("".join(cell["source"]))
    (dest / "lab.ipynb").write_text(json.dumps(nb, indent=1))
    return dest


def grading_parameters(lab_dir: Path) -> dict:
    """The small CPU parameters lab.yaml gives for CI and grading."""
    return yaml.safe_load((lab_dir / "lab.yaml").read_text())["grading"]["parameters"]


def grade(lab_dir: Path, records: dict) -> tuple[float, float, list]:
    """(points, max points, results) of the lab's public and hidden checks on `records`."""
    results = run_checks(lab_checks(lab_dir), records)
    return sum(r.points for r in results), sum(r.max_points for r in results), results


def failures(results) -> list[str]:
    """Readable lines for every check that did not fully pass."""
    return [f"{r.name}: {r.outcome} {r.points}/{r.max_points} {r.message}" for r in results if r.outcome != "pass"]



def run_reference(lab_dir: Path) -> tuple[dict, float]:
    """Execute the reference notebook with lab.yaml's grading parameters: (records with the grader's evidence,
    seconds).

    It is the site build's execution (`ensure_executed`, into build/executed/<lab>/), always run anew here since the
    tests are about today's library; the site test later in the same run reuses that copy instead of executing every
    lab a third time (besides test_grade_labs)."""
    executed = ensure_executed(lab_dir, force=True)
    # the grader's evidence from the runs' event files, as `scalelab grade` adds it
    records = {**read_records(executed.notebook), **run_evidence(executed.notebook.parent)}
    return records, executed.duration_s


def assert_full_marks_within(lab_dir: Path, reference: tuple[dict, float], budget_s: float) -> None:
    """Every check passes on the reference's records, and the run stayed within its time budget."""
    records, seconds = reference
    points, most, results = grade(lab_dir, records)
    assert points == most, "\n".join(failures(results))
    assert seconds < budget_s, f"{lab_dir.name} took {seconds:.0f} s under papermill; the budget is {budget_s:g} s"


def assert_check_notices(lab_dir: Path, records: dict, forge, check_name: str) -> None:
    """`forge` (applied to a copy of `records`) makes check `check_name` fail, find a record missing, or give
    partial credit: the check guards the value it claims to."""
    records = copy.deepcopy(records)
    forge(records)
    outcome = {r.name: r.outcome for r in grade(lab_dir, records)[2]}[check_name]
    assert outcome in ("fail", "missing", "partial"), f"{check_name} did not notice: {outcome}"


class TwoInFlight:
    """`work(name)` for each of an ordered selection of names, two in flight: asking for one's result starts it
    (if not yet) and the next selected one beside it, so each is the other's load and both cores stay busy (one
    lab's grading at a time kept them 64 % busy). `close()` waits for what runs and cancels what has not begun."""

    def __init__(self, selected, work, prefix: str = "in-flight"):
        self.selected, self.work, self.lock, self.futures = list(selected), work, threading.Lock(), {}
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=prefix)

    def start(self, name):
        with self.lock:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self.work, name)

    def result(self, name):
        later = self.selected[self.selected.index(name) + 1:] if name in self.selected else []
        for n in (name, *later[:1]):
            self.start(n)
        return self.futures[name].result()

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)

