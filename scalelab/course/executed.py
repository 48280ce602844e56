"""A lab's executed reference notebook, made once per version of the lab and reused: the site's pages and the lab
tests both start from it, so a CI run executes each lab once.

`ensure_executed(lab_dir)` executes the lab under papermill at its grading parameters into
build/executed/<lab>/ unless an executed copy of the same version (`lab_hash`: the student files' names and bytes)
is there; the stamp beside it (executed.json) says when, how long, at which parameters and on what machine
(`measured_on` turns that into a page's sentence).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ScalelabError
from ..machine import gpu_device_files, memory_bytes
from ..paths import checkout_root
from .lab import NOTEBOOK, Lab, load_lab, student_files

EXECUTED = checkout_root() / "build" / "executed"
CACHE_VERSION = "1"
STAMP = "executed.json"


class SiteBuildError(ScalelabError):
    """The site could not be built; the message says which lab or page and what to do."""


class LabExecutionFailed(SiteBuildError):
    """One or more labs did not execute to the end; `failures` maps lab name to its message."""

    def __init__(self, failures: dict[str, str]):
        self.failures = dict(failures)
        names = ", ".join(failures)
        body = "\n\n".join(f"--- lab {name} ---\n{msg}" for name, msg in failures.items())
        super().__init__(f"{len(failures)} lab(s) failed to execute: {names}\n{body}\n\nFix the lab, then run "
                         f"`scalelab site build` again (labs that executed are reused).")


@dataclass
class ExecutedLab:
    """A lab's executed reference notebook and how it was obtained."""

    name: str
    notebook: Path
    """The executed notebook (papermill's output, solutions still in)."""
    source_hash: str
    reused: bool
    """True when an up-to-date executed copy from an earlier build was used."""
    duration_s: float
    """How long the execution took (when it ran, then or in the build that made the reused copy)."""


def lab_hash(lab_dir: str | Path) -> str:
    """Hash of what a lab's execution depends on: its student files' names and bytes (lab.yaml included)."""
    root = Path(lab_dir)
    h = hashlib.sha256(f"scalelab-site {CACHE_VERSION}\n".encode())
    for rel in student_files(root):
        h.update(rel.as_posix().encode() + b"\0")
        h.update((root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def ensure_executed(lab_dir: str | Path, executed_root: str | Path = EXECUTED, force: bool = False) -> ExecutedLab:
    """The executed notebook of a lab, executed now unless an up-to-date copy exists; LabExecutionFailed if it fails.

    Lab tests may call this too, so that a CI run executes each lab once for both the tests and the site.
    """
    lab = load_lab(lab_dir)
    work = Path(executed_root) / lab.name
    digest = lab_hash(lab.path)
    stamp = _read_stamp(work / STAMP)
    if not force and stamp.get("hash") == digest and (work / NOTEBOOK).is_file():
        return ExecutedLab(lab.name, work / NOTEBOOK, digest, True, float(stamp.get("duration_s", 0.0)))
    return _execute(lab, work, digest)


def _execute(lab: Lab, work: Path, digest: str) -> ExecutedLab:
    from .execute import NotebookError, execute_notebook
    if work.exists():
        shutil.rmtree(work)  # runs from an older version of the lab must not linger
    work.mkdir(parents=True)
    for rel in student_files(lab.path):
        if rel != Path(NOTEBOOK):
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lab.path / rel, work / rel)
    g = lab.grading
    load_before = _load()
    try:
        result = execute_notebook(lab.notebook, g.parameters, output_path=work / NOTEBOOK, cwd=work,
                                  cell_timeout=g.cell_timeout_s, total_timeout=g.total_timeout_s)
    except NotebookError as e:  # a bad call: lab.yaml names a parameter the notebook lacks, ...
        raise LabExecutionFailed({lab.name: str(e)}) from None
    if not result.ok:
        raise LabExecutionFailed({lab.name: f"{result.error.details()}\nexecuted copy: {result.output_path}"})
    stamp = {"hash": digest, "lab": lab.name, "parameters": g.parameters, "duration_s": round(result.duration_s, 1),
             "executed_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
             "machine": machine_summary(), "load": {"before": load_before, "after": _load()}}
    _write_if_changed(work / STAMP, json.dumps(stamp, indent=1) + "\n")
    return ExecutedLab(lab.name, work / NOTEBOOK, digest, False, result.duration_s)


def adopt_executed(lab_dir: str | Path, notebook: dict, duration_s: float, executed_by: str,
                   executed_root: str | Path = EXECUTED) -> ExecutedLab:
    """Keep a notebook of this lab executed elsewhere at its grading parameters (the grader's run of the reference,
    say) as its executed copy, so the site reuses it instead of executing the lab again; the stamp says by what."""
    lab = load_lab(lab_dir)
    work = Path(executed_root) / lab.name
    digest = lab_hash(lab.path)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    _write_if_changed(work / NOTEBOOK, json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    load = _load()
    stamp = {"hash": digest, "lab": lab.name, "parameters": lab.grading.parameters,
             "duration_s": round(duration_s, 1), "executed_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
             "executed_by": executed_by, "machine": machine_summary(), "load": {"before": load, "after": load}}
    _write_if_changed(work / STAMP, json.dumps(stamp, indent=1) + "\n")
    return ExecutedLab(lab.name, work / NOTEBOOK, digest, False, duration_s)


def machine_summary() -> dict:
    """What the numbers on a page were measured on: CPUs (and their model), memory, GPUs."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = memory_bytes() / 2**30
    return {"cpus": os.cpu_count() or 0, "cpu_model": model, "memory_gib": round(mem, 1),
            "gpus": len(gpu_device_files())}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def measured_on(stamp: dict) -> str:
    """One sentence for a page: the machine and the load its numbers were measured under."""
    m, load = stamp.get("machine") or {}, stamp.get("load") or {}
    if not m:
        return ""
    what = f"{m.get('cpus')} CPUs" + (f" ({m['cpu_model']})" if m.get("cpu_model") else "")
    what += f", {m.get('memory_gib')} GiB of memory, " + (f"{m['gpus']} GPUs" if m.get("gpus") else "no GPU")
    text = f"**Measured on:** {what}"
    if load.get("before") is not None and load.get("after") is not None:
        busy = max(load["before"], load["after"]) > (m.get("cpus") or 1)
        text += (f"; load average {load['before']:g} before the run and {load['after']:g} after" +
                 (" — the machine was busy with other work, so speed-ups here are lower than on a quiet one"
                  if busy else ""))
    if stamp.get("executed_at"):
        text += f" ({stamp['executed_at']})"
    return text + "."


def _read_stamp(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_if_changed(path: Path, content: str | bytes) -> None:
    """Write atomically, and only when the bytes differ (Sphinx rebuilds what has a new mtime)."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


__all__ = ["SiteBuildError", "LabExecutionFailed", "ExecutedLab", "lab_hash", "ensure_executed", "adopt_executed",
           "machine_summary", "measured_on", "EXECUTED", "STAMP"]
