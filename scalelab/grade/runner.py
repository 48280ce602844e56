"""The sandboxed side of grading one submission: `main([JOB.json])`, started by job.py (`RUNNER_MAIN`).

The grader writes JOB.json (notebook, working copy, parameters, limits, sandbox plan) and starts this module, as
root, in its own session. The runner itself never runs student code and keeps its uid: it forks the confined run
(`start_sandboxed`: an init in new namespaces, and under it the confined process, which drops to the throwaway
uid, executes the notebook with `execute_notebook` and sends what happened through a pipe). Once the run's PID
namespace is gone, the runner writes the outcome to JOB["outcome"], a file in the grader's own folder that the
run cannot reach. So no file the student's code writes decides the status: a run that kills the process
holding the pipe gets `killed`, and one that writes an outcome file of its own only wrote a file.

What the notebook's code does to the processes running it is the student's, never the grader's: once the kernel
exists (`KernelWatch` sees the executor's child from this process, which the run cannot touch: every file and
message the executor leaves can be rewritten by the student's code, which runs as the same uid), a failure of the
executor (its process killed, its temporary folder jammed, its output rewritten into something it cannot read
back) is the student's `killed` (a signal) or `crashed` status, told without the grader's paths or logs (those go
to the runner's log, for the instructor). Only a failure before any kernel existed is a `grader_error`. A kernel
that cannot start at all on this machine therefore reads as `crashed` in every submission: the runner's log says
why, and the lab's reference, graded first, shows it.

Parameters the submission's `parameters` cell no longer declares, or all of them when no cell is tagged
`parameters` any more, are left out (with a note) rather than failing the whole run: the student then runs with
their own values of those.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import sys
import threading
import time
import traceback
from pathlib import Path

from ..course.execute import (INJECTED_TAG, MARKER_TAG, PLUMBING_TAGS, NotebookError, NotebookParameterError,
                              NotebookResult, execute_notebook)
from ..run.procs import kill_processes
from .sandbox import SandboxError, SandboxPlan
from .confine import start_sandboxed, wait_status

MAX_TRACEBACK_CHARS = 8000
MAX_OUTCOME_BYTES = 2**20


def main(argv: list[str]) -> int:
    """Run one job; the exit status is 0 whenever an outcome file was written."""
    job = json.loads(Path(argv[0]).read_text())
    start = time.monotonic()
    read_end, write_end = os.pipe()
    try:
        pid = start_sandboxed(SandboxPlan.from_dict(job["sandbox"]), report_fd=write_end)
    except (SandboxError, OSError) as e:
        _write(job, {"status": "grader_error", "message": f"the sandbox could not be set up: {e}"})
        return 0
    if pid == 0:  # the confined process: run the notebook, send the outcome, leave nothing behind
        os.close(read_end)
        try:
            os.chdir(job["cwd"])
            outcome = _execute(job)
        except BaseException as e:  # noqa: BLE001 - whatever happens here is reported, not raised
            outcome = _failure(job, e, f"the runner failed: {type(e).__name__}: {e}")
        _reap_descendants()
        _send(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    data = _read_all(read_end, MAX_OUTCOME_BYTES)
    code = wait_status(pid)
    outcome = _outcome_from(data, code)
    outcome["duration_s"] = round(time.monotonic() - start, 3)
    _write(job, outcome)
    return 0


def _send(fd: int, outcome: dict) -> None:
    data = json.dumps(outcome, default=str).encode()
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)


def _read_all(fd: int, limit: int) -> bytes:
    """Everything written to the pipe until every writer is gone (the run's PID namespace with it), up to `limit`."""
    chunks, size = [], 0
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        if size < limit:
            chunks.append(chunk[:limit - size])
        size += len(chunk)
    os.close(fd)
    return b"".join(chunks)


def _outcome_from(data: bytes, code: int) -> dict:
    """The confined process's outcome, or what its end says when it sent none."""
    try:
        outcome = json.loads(data) if data else None
    except (ValueError, RecursionError):
        outcome = None
    if isinstance(outcome, dict) and isinstance(outcome.get("status"), str):
        return outcome
    if code > 128:
        sig = code - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        return {"status": "killed", "message": f"the run's grading process was killed ({name}) before the notebook "
                                               "finished: by the notebook's own code, or for using more memory than "
                                               "allowed", "signal": sig}
    return {"status": "grader_error", "message": f"the run ended (exit {code}) without saying what happened"}


def _execute(job: dict) -> dict:
    if job.get("reverify"):  # the grader's re-runs of the notebook's runs (grade/reverify.py), no notebook
        from .reverify import rerun_all
        return rerun_all(job["reverify"], job["nonce"], job["total_timeout"])
    notes = []
    parameters = dict(job["parameters"])
    if parameters and not _has_parameters_cell(job["notebook"]):
        notes.append("your notebook has no cell tagged 'parameters' (was the tag removed?): the grader's "
                     f"parameters {sorted(parameters)} could not be set, so your own values were used")
        parameters = {}
    _KERNEL_WATCH.start()
    kw = dict(output_path=job["output"], cwd=job["cwd"], cell_timeout=job["cell_timeout"],
              total_timeout=job["total_timeout"], output_limit=job.get("output_limit"),
              continue_on_error=job.get("continue_on_error", True))
    try:
        try:
            result = execute_notebook(job["notebook"], parameters, **kw)
        except NotebookParameterError as e:
            if not e.unknown:
                raise
            notes.append(f"your notebook's parameters cell does not declare {list(e.unknown)}: the grader could not "
                         "set them, so your own values were used")
            result = execute_notebook(job["notebook"], {k: v for k, v in parameters.items() if k not in e.unknown},
                                      **kw)
    except NotebookParameterError as e:
        return {"status": "malformed", "message": str(e), "notes": notes}
    except NotebookError as e:
        return {**_failure(job, e, f"the notebook could not be executed: {e}"), "notes": notes}
    return {**describe(result), "notes": notes}


def _failure(job: dict, error: BaseException, message: str) -> dict:
    """The outcome of an executor or runner failure: the student's `killed`/`crashed` once their code had run (the
    details go to the runner's log only), else the grader's own `grader_error`."""
    sys.stderr.write(f"{message}\n{traceback.format_exc()[-MAX_TRACEBACK_CHARS:]}\n")
    sys.stderr.flush()
    if not _KERNEL_WATCH.seen.is_set():
        return {"status": "grader_error", "message": message,
                "traceback": traceback.format_exc()[-MAX_TRACEBACK_CHARS:]}
    where = _started_cell(job["output"])
    signalled = re.search(r"the executor exited -(\d+)\b", str(error))
    if signalled:
        sig = int(signalled.group(1))
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        return {"status": "killed", "signal": sig, **where,
                "message": f"the process running the notebook (the kernel's parent) was killed ({name})"}
    return {"status": "crashed", **where,
            "message": "the process running the notebook (the kernel's parent) failed after the notebook's code "
                       "had started: that code killed, stopped or disturbed it (its files or temporary folder)"}


MAX_STARTED_BYTES = 64 * 2**20


class KernelWatch:
    """Whether the kernel was ever started, seen from the confined runner itself (not dumpable: the run can neither
    trace it nor write to it): a thread looks every POLL_S for a grandchild, the executor's child. Nothing of the
    notebook runs before the kernel exists, so a failure before that is the grader's."""

    POLL_S = 0.1

    def __init__(self):
        self.seen = threading.Event()
        self._thread = None

    def start(self) -> None:
        """Start looking (once), in a daemon thread that ends when the kernel is seen."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._look, name="kernel-watch", daemon=True)
            self._thread.start()

    def _look(self) -> None:
        import psutil
        me = os.getpid()
        while not self.seen.is_set():
            try:
                if any(p.ppid() != me for p in psutil.Process(me).children(recursive=True)):
                    self.seen.set()
                    return
            except psutil.Error:
                pass
            time.sleep(self.POLL_S)


_KERNEL_WATCH = KernelWatch()


def _started_cell(output: str) -> dict:
    """Where the run was, as the executed notebook papermill keeps says (the last cell it marked as started:
    {"cell_index", "cell_tags"}); {} when it says nothing readable. A hint for the message only: the notebook's own
    code may have rewritten the file."""
    try:
        st = os.lstat(output)
    except OSError:
        return {}
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STARTED_BYTES:
        return {}
    try:
        with open(output, "rb") as f:
            cells = json.loads(f.read(MAX_STARTED_BYTES))["cells"]
        found, index = {}, -1
        for cell in cells:
            meta = cell.get("metadata") or {}
            tags = [t for t in meta.get("tags") or [] if isinstance(t, str)]
            if INJECTED_TAG in tags or MARKER_TAG in tags:
                continue
            index += 1
            if (meta.get("papermill") or {}).get("start_time"):
                found = {"cell_index": index, "cell_tags": [t for t in tags if t not in PLUMBING_TAGS][:20]}
        return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}


def _has_parameters_cell(path: str) -> bool:
    """Whether a cell is tagged `parameters` (a file that is no notebook: True, execute_notebook says why)."""
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
        return any("parameters" in c.get("metadata", {}).get("tags", []) for c in cells)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True


def describe(result: NotebookResult) -> dict:
    """A NotebookResult as JSON data: status, and where and how it failed (no records: the grader reads those)."""
    out = {"status": result.status, "message": ""}
    err = result.error
    if err is None:
        return out
    out["message"] = str(err)
    for name in ("cell_index", "cell_id", "ename", "evalue", "limit_s"):
        if getattr(err, name, None) is not None:
            out[name] = getattr(err, name)
    if getattr(err, "cell_tags", None):
        out["cell_tags"] = list(err.cell_tags)
    if getattr(err, "source", ""):
        out["source"] = err.source[:MAX_TRACEBACK_CHARS]
    if getattr(err, "traceback", ""):
        out["traceback"] = err.traceback[-MAX_TRACEBACK_CHARS:]
    return out


def _reap_descendants() -> None:
    # What the notebook started and left (the init above us kills the rest: daemons that re-parented to it).
    import psutil
    kill_processes(psutil.Process().children(recursive=True), grace_s=0, tree=False)


def _write(job: dict, outcome: dict) -> None:
    tmp = Path(job["outcome"] + ".tmp")
    tmp.write_text(json.dumps(outcome, default=str))
    tmp.replace(job["outcome"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
