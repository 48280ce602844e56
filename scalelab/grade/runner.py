"""The sandboxed side of grading one submission: `main([JOB.json])`, started by job.py (`RUNNER_MAIN`).

The grader writes JOB.json (notebook, working copy, parameters, limits, sandbox plan) and starts this module, as
root, in its own session. The runner itself never runs student code and keeps its uid: it forks the confined run
(`start_sandboxed`: an init in new namespaces, and under it the confined process, which drops to the throwaway
uid, executes the notebook with `execute_notebook` and sends what happened through a pipe). Once the run's PID
namespace is gone, the runner writes the outcome to JOB["outcome"], a file in the grader's own folder that the
run cannot reach. So no file the student's code writes decides the status: a run that kills the process
holding the pipe gets `killed`, and one that writes an outcome file of its own only wrote a file.

Parameters the submission's `parameters` cell no longer declares, or all of them when no cell is tagged
`parameters` any more, are left out (with a note) rather than failing the whole run: the student then runs with
their own values of those.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ..course.execute import NotebookError, NotebookParameterError, NotebookResult, execute_notebook
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
            import traceback
            outcome = {"status": "grader_error", "message": f"the runner failed: {type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-MAX_TRACEBACK_CHARS:]}
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
    notes = []
    parameters = dict(job["parameters"])
    if parameters and not _has_parameters_cell(job["notebook"]):
        notes.append("your notebook has no cell tagged 'parameters' (was the tag removed?): the grader's "
                     f"parameters {sorted(parameters)} could not be set, so your own values were used")
        parameters = {}
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
        return {"status": "grader_error", "message": f"the notebook could not be executed: {e}", "notes": notes}
    return {**describe(result), "notes": notes}


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
