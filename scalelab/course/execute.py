"""Execute a notebook with papermill, with limits papermill lacks, and return its records and a typed outcome.

    result = execute_notebook("labs/01_ddp/lab.ipynb", {"steps": 5}, output_path="out/lab.ipynb")
    result.raise_for_status().records          # or look at result.status / result.error yourself

`execute_notebook` never raises for what the *notebook* did (cell error, timeouts, dead kernel, malformed
file): that is `result.status` + `result.error`, and `raise_for_status()` raises the typed error. It raises
straight away only for a bad *call*: unknown or non-JSON parameters (`NotebookParameterError`) or a harness
failure (`NotebookError`, e.g. an unknown kernel name).

Why a child process: papermill has no whole-run limit, so execution runs in `python -c ...` (this interpreter)
that the parent can stop. On the total limit the parent kills the kernel first, so papermill notices a dead kernel
and still saves the output notebook cleanly; only then the child, and every process group the kernel owned.

Arguments: `parameters` must be JSON data (they cross a process boundary) and be declared in the cell tagged
`parameters`. `output_path` defaults to a new temporary folder; `cwd` (the kernel's working directory) to the
notebook's folder, as in JupyterLab. `cell_timeout` is rounded up to whole seconds (nbclient takes integers);
`total_timeout` counts from the call, kernel start-up included; None means no limit. `env` is merged over
os.environ for the kernel. Records are read back even when the run failed, up to the last cell saved.

Errors: with `continue_on_error` every cell runs even after one raised (as a grader wants: an unsolved exercise
must not cost the points of the independent parts after it); the status is still `cell_error`, located at the
*first* cell that raised. A timeout or a dead kernel still ends the run.

Output: `output_limit` (characters per cell; None: no limit) cuts what a cell prints *while it runs*: the rest of
its stream output is dropped with a note, and any other output bigger than the limit is replaced by a note
(recorded values are never cut). Papermill saves the notebook as it goes, so a cell printing gigabytes would
otherwise make the output notebook too big to read, its records with it.

Kernel: `kernel_name=None` (the default) means *this interpreter* (sys.executable), whatever the notebook's
metadata or a `python3` kernelspec elsewhere says: the child writes a private kernelspec into a temporary
JUPYTER_PATH entry. Pass a name to use an installed kernelspec instead.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ScalelabError
from ..record import iter_records
from .lab import cell_source

STATUSES = ("ok", "cell_error", "cell_timeout", "timeout", "dead_kernel", "malformed")
# papermill strips cells with this tag on re-execution; we tag our own markers with it too.
MARKER_TAG = "papermill-error-cell-tag"
INJECTED_TAG = "injected-parameters"
#: Tags that steer execution rather than name a cell (a student copy's exercise cells go on when they raise):
#: left out when a failure names the cell.
PLUMBING_TAGS = ("raises-exception",)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_KILL_GRACE_S = 15.0  # how long papermill gets to save the notebook after its kernel is killed


class NotebookError(ScalelabError):
    """A notebook could not be executed to the end; `path` is the notebook, `output_path` its executed copy."""

    def __init__(self, message: str, path: str | None = None, output_path: str | None = None):
        self.path, self.output_path = path, output_path
        super().__init__(message)

    def details(self) -> str:
        """Long form for humans: the message plus cell source and traceback where known."""
        return str(self)


class _CellFailure(NotebookError):
    """A failure located in one cell: index in the source notebook (papermill's cells not counted), id, tags."""

    def __init__(self, message, path, output_path, cell_index=None, cell_id=None, cell_tags=(), source=""):
        self.cell_index, self.cell_id = cell_index, cell_id
        self.cell_tags, self.source = tuple(cell_tags), source
        super().__init__(message, path, output_path)

    def details(self) -> str:
        """Message, the cell's source and, for cell errors, the traceback."""
        parts = [str(self), "--- cell source ---", self.source.rstrip()]
        if getattr(self, "traceback", ""):
            parts += ["--- traceback ---", self.traceback.rstrip()]
        return "\n".join(parts)


class NotebookCellError(_CellFailure):
    """A cell raised: `ename`, `evalue`, `traceback` (plain text) and the cell's index/id/tags/source."""

    def __init__(self, message, path, output_path, ename="", evalue="", traceback="", **cell):
        self.ename, self.evalue, self.traceback = ename, evalue, traceback
        super().__init__(message, path, output_path, **cell)


class NotebookCellTimeout(_CellFailure, TimeoutError):
    """One cell ran longer than `limit_s` seconds (the per-cell limit)."""

    def __init__(self, message, path, output_path, limit_s=None, **cell):
        self.limit_s = limit_s
        super().__init__(message, path, output_path, **cell)


class NotebookTimeout(_CellFailure, TimeoutError):
    """The whole run passed `limit_s` seconds; the cell fields name the cell that was running."""

    def __init__(self, message, path, output_path, limit_s=None, **cell):
        self.limit_s = limit_s
        super().__init__(message, path, output_path, **cell)


class NotebookDeadKernel(_CellFailure):
    """The kernel died (os._exit, a segfault, out of memory); the cell fields name the cell that was running."""


class NotebookMalformed(NotebookError):
    """The file is missing, not JSON, not a valid notebook, or lacks a `parameters` cell that is needed."""


class NotebookParameterError(NotebookError, ValueError):
    """Parameters the notebook does not declare (`unknown`, with `known` listed) or that are not JSON data."""

    def __init__(self, message, path=None, unknown=(), known=()):
        self.unknown, self.known = tuple(unknown), tuple(known)
        super().__init__(message, path)


@dataclass
class NotebookResult:
    """Outcome of one execution: `status` (one of STATUSES), `records`, `error` (typed, or None), timings."""

    path: str
    output_path: str | None
    status: str
    records: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    error: NotebookError | None = None

    @property
    def ok(self) -> bool:
        """True when every cell ran without error or limit."""
        return self.status == "ok"

    def raise_for_status(self) -> "NotebookResult":
        """Raise `error` unless the run was ok; returns self so calls chain (`.raise_for_status().records`)."""
        if self.error is not None:
            raise self.error
        return self


def execute_notebook(path, parameters: dict | None = None, *, output_path=None, cwd=None,
                     cell_timeout: float | None = 120, total_timeout: float | None = 600,
                     kernel_name: str | None = None, env: dict | None = None,
                     output_limit: int | None = None, continue_on_error: bool = False) -> NotebookResult:
    """Run `path` with papermill in a killable child; see the module docstring for the contract."""
    start = time.monotonic()
    path = Path(path).resolve()
    parameters = dict(parameters or {})
    if output_path and Path(output_path).resolve() == path:
        raise NotebookError(f"output_path {output_path} is the input notebook; papermill would overwrite it", str(path))

    problem = _malformed(path, parameters)
    if problem:
        err = NotebookMalformed(f"{path}: {problem}", str(path))
        return NotebookResult(str(path), None, "malformed", {}, time.monotonic() - start, err)
    _check_parameters(path, parameters)

    out = Path(output_path).resolve() if output_path else Path(tempfile.mkdtemp(prefix="scalelab-nb-")) / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    job = {"input": str(path), "output": str(out), "parameters": parameters,
           "cwd": str(Path(cwd).resolve() if cwd else path.parent), "kernel_name": kernel_name,
           "cell_timeout": None if cell_timeout is None else max(1, math.ceil(cell_timeout)),
           "output_limit": output_limit, "continue_on_error": continue_on_error}
    outcome, timed_out = _run_child(job, env, None if total_timeout is None else start + total_timeout)
    if outcome.get("status") == "internal" and not timed_out:
        raise NotebookError(f"could not execute {path}: {outcome['message']}", str(path), str(out))

    # A run that finished just as the limit hit is still a finished run.
    status = "timeout" if timed_out and outcome["status"] != "ok" else outcome["status"]
    nb = _read_json(out)
    records, cell = ({}, {}) if nb is None else (_records(nb), _running_cell(nb))
    if status == "cell_error" and nb is not None:
        cell = _first_error_cell(nb) or cell  # with continue_on_error the run went on past it
    error = _make_error(status, path, out, cell, cell_timeout, total_timeout, outcome.get("message", ""))
    if error is not None and nb is not None and status != "cell_error":  # papermill marks cell errors itself
        _annotate(nb, out, error)
    return NotebookResult(str(path), str(out), status, records, time.monotonic() - start, error)


def _records(nb: dict) -> dict[str, Any]:
    """`read_records`, up to the first malformed record output: the notebook's code can display any MIME bundle,
    and one it cannot decode must not turn the run's outcome into an exception (the grader reads records itself)."""
    records = {}
    try:
        for name, value, _ in iter_records(nb):
            records[name] = value
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError):  # RecordError is a ValueError
        pass
    return records


def _malformed(path: Path, parameters: dict) -> str | None:
    """Why `path` cannot be executed as a notebook, or None."""
    if not path.is_file():
        return "no such file"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"not valid JSON ({e})"
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or data.get("nbformat") != 4:
        return "not a Jupyter notebook (expected a JSON object with nbformat 4 and a 'cells' list)"
    import nbformat
    try:
        nbformat.validate(nbformat.from_dict(data))
    except nbformat.ValidationError as e:
        return f"not a valid notebook: {str(e).splitlines()[0]}"
    if parameters and not any("parameters" in c.get("metadata", {}).get("tags", []) for c in data["cells"]):
        return (f"parameters {sorted(parameters)} were given but no cell is tagged 'parameters' "
                "(tag the cell that holds the defaults)")
    return None


def _check_parameters(path: Path, parameters: dict) -> None:
    """Refuse parameters the notebook does not declare (papermill only warns) or that JSON cannot carry."""
    if not parameters:
        return
    from papermill import inspect_notebook
    known = sorted(inspect_notebook(str(path)))
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise NotebookParameterError(f"{path.name}: unknown parameter(s) {unknown}; the parameters cell "
                                     f"declares {known}", str(path), unknown, known)
    for name, value in parameters.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise NotebookParameterError(f"{path.name}: parameter {name!r} must be JSON data (numbers, str, bool, "
                                         f"None, lists/dicts): {e}", str(path), [name], known) from None


def _run_child(job: dict, env: dict | None, deadline: float | None) -> tuple[dict, bool]:
    """Run the child to completion or the deadline; returns (its outcome, whether the deadline hit)."""
    with tempfile.TemporaryDirectory(prefix="scalelab-exec-") as tmp:
        job_file, result_file, log_file = (Path(tmp) / n for n in ("job.json", "result.json", "child.log"))
        job["result"] = str(result_file)
        job_file.write_text(json.dumps(job))
        child_env = {**os.environ, **(env or {})}
        code = "import sys; from scalelab.course.execute_child import main; main(sys.argv[1])"
        with open(log_file, "wb") as log:
            # Own session: the child's group can be killed without touching ours.
            proc = subprocess.Popen([sys.executable, "-c", code, str(job_file)], stdout=log, stderr=subprocess.STDOUT,
                                    env=child_env, start_new_session=True)
        timed_out = False
        try:
            try:
                proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_descendants(proc.pid)  # the kernel: papermill then saves and the child exits
                try:
                    proc.wait(_KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            _kill_tree(proc)
        outcome = _read_json(result_file)
        if outcome is None and not timed_out:
            tail = log_file.read_text(errors="replace")[-3000:]
            outcome = {"status": "internal", "message": f"the executor exited {proc.returncode}:\n{tail}"}
        return outcome or {"status": "timeout"}, timed_out


def _kill_descendants(pid: int) -> None:
    """SIGKILL every descendant of `pid` and the process groups they lead (a kernel leads its own session)."""
    import psutil
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    ours = os.getpgid(0)
    for p in procs:
        try:
            pgid = os.getpgid(p.pid)
            if pgid == p.pid and pgid != ours:
                os.killpg(pgid, signal.SIGKILL)  # also catches the kernel's own subprocesses
            p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    psutil.wait_procs(procs, timeout=5)


def _kill_tree(proc: subprocess.Popen) -> None:
    """Make sure the child, its kernel and their groups are gone (no-op when they already exited)."""
    if proc.poll() is not None:
        return
    _kill_descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # missing, or cut short by a kill: the caller reports what it knows without it


def _running_cell(nb: dict) -> dict:
    """The last code cell papermill started (where a run stopped), with its index in the *source* notebook."""
    found, source_index = {}, -1
    for cell in nb.get("cells", []):
        tags = cell.get("metadata", {}).get("tags", [])
        if MARKER_TAG in tags or INJECTED_TAG in tags:
            continue
        source_index += 1
        if cell.get("cell_type") == "code" and cell.get("metadata", {}).get("papermill", {}).get("start_time"):
            found = {"cell": cell, "cell_index": source_index}
    return found


def _first_error_cell(nb: dict) -> dict:
    """The first code cell with an error output, with its index in the source notebook ({} when none)."""
    source_index = -1
    for cell in nb.get("cells", []):
        tags = cell.get("metadata", {}).get("tags", [])
        if MARKER_TAG in tags or INJECTED_TAG in tags:
            continue
        source_index += 1
        if any(o.get("output_type") == "error" for o in cell.get("outputs", []) if isinstance(o, dict)):
            return {"cell": cell, "cell_index": source_index}
    return {}


def _make_error(status, path, out, found, cell_timeout, total_timeout, message) -> NotebookError | None:
    """The typed error for `status`, located at the cell papermill was running."""
    if status == "ok":
        return None
    cell = found.get("cell", {})
    kw = {"cell_index": found.get("cell_index"), "cell_id": cell.get("id"),
          "cell_tags": [t for t in cell.get("metadata", {}).get("tags", []) if t not in PLUMBING_TAGS],
          "source": cell_source(cell)}
    where = f"cell {kw['cell_index']} (id {kw['cell_id']!r}, tags {list(kw['cell_tags'])})"
    paths = (str(path), str(out))
    if status == "cell_error":
        err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), {})
        ename, evalue = err.get("ename", "CellExecutionError"), err.get("evalue", "")
        tb = _ANSI.sub("", "\n".join(err.get("traceback", [])))
        return NotebookCellError(f"{path.name}: {where} raised {ename}: {evalue} (output: {out})", *paths,
                                 ename=ename, evalue=evalue, traceback=tb, **kw)
    if status == "cell_timeout":
        return NotebookCellTimeout(f"{path.name}: {where} ran past the per-cell limit of {cell_timeout} s "
                                   f"(output: {out})", *paths, limit_s=cell_timeout, **kw)
    if status == "timeout":
        return NotebookTimeout(f"{path.name}: the run passed its total limit of {total_timeout} s while in {where}; "
                               f"the kernel was killed (output: {out})", *paths, limit_s=total_timeout, **kw)
    if status == "dead_kernel":
        return NotebookDeadKernel(f"{path.name}: the kernel died in {where} (os._exit, crash or out of memory?)"
                                  f" (output: {out})", *paths, **kw)
    raise AssertionError(f"unexpected status {status!r}: {message}")


def _annotate(nb: dict, out: Path, error: NotebookError) -> None:
    """Put the failure at the top of the output notebook, tagged so papermill drops it on a re-run."""
    nb.setdefault("metadata", {})["scalelab"] = {"error": type(error).__name__, "message": str(error)}
    nb["cells"].insert(0, {"cell_type": "markdown", "id": "scalelab-error", "source": f"**scalelab:** {error}",
                           "metadata": {"tags": [MARKER_TAG]}})
    out.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
