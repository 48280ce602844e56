"""Values a notebook hands to its checks: `record(name, value)` in a lab, `read_records(nb)` in the grader.

Inside a Jupyter kernel a record is a display output with the MIME type `application/vnd.scalelab.record+json`
carrying `{"name": ..., "value": ...}` (plus a one-line text/plain fallback), so it survives in the executed
notebook and is read back with nbformat alone: pure JSON, nothing executed or unpickled.

Values are JSON data: numbers, str, bool, None, lists and str-keyed dicts of these. numpy scalars/arrays and
torch tensors become plain Python (`.tolist()`), tuples become lists. JSON has no NaN or infinity, so a
non-finite float is stored as `{"$float": "nan" | "inf" | "-inf"}` and decoded back to a float by
`read_records`; a dict whose only key is "$float" is therefore refused.

Outside a kernel (a plain script, a worker) `record` still returns the value, and when the environment
variable SCALELAB_RECORD_FILE names a file it appends one JSON line `{"name":..., "value":...}` to it (it does
so inside a kernel too). Read such a file back with `read_record_file`.

Every `record` also lands in an in-process registry, `recorded()`, holding the value exactly as the grader will
read it back (after the JSON round trip): SelfCheck runs a lab's public checks against it in the kernel.

This module imports nothing from IPython/Jupyter at import time (core-library rule).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from .errors import ScalelabError

MIME = "application/vnd.scalelab.record+json"
RECORD_FILE_ENV = "SCALELAB_RECORD_FILE"
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
_FLOAT_KEY = "$float"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_RECORDED: dict[str, Any] = {}


class RecordError(ScalelabError, ValueError):
    """A record has a bad name or a value that cannot be stored as JSON; `name` is the record's name."""

    def __init__(self, name: Any, message: str):
        self.name = name
        super().__init__(f"record {name!r}: {message}")


class RecordCell(NamedTuple):
    """Where a record was found in a notebook: position in `nb.cells`, the cell's id and tags."""

    index: int
    cell_id: str | None
    tags: tuple[str, ...]


def record(name: str, value: Any) -> Any:
    """Hand `value` to the notebook's checks under `name`; returns `value` unchanged."""
    _check_name(name)
    encoded = encode_value(name, value)
    payload = {"name": name, "value": encoded}
    _RECORDED[name] = decode_value(json.loads(json.dumps(encoded)))  # a copy: later edits of `value` don't leak in
    path = os.environ.get(RECORD_FILE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(payload, allow_nan=False) + "\n")
    _display_in_kernel(payload, name, value)
    return value


def recorded() -> dict[str, Any]:
    """Everything recorded in this process so far, {name: value} as the grader would read it; a later one wins."""
    return decode_value(json.loads(json.dumps({k: encode_value(k, v) for k, v in _RECORDED.items()})))


def clear_recorded() -> None:
    """Forget this process's records (the notebook's outputs keep theirs)."""
    _RECORDED.clear()


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RecordError(name, "a record name must match [A-Za-z_][A-Za-z0-9_.-]* (e.g. 'loss' or 'speedup.4')")


def _display_in_kernel(payload: dict, name: str, value: Any) -> None:
    # If IPython was never imported we cannot be in a kernel: do not pay for importing it.
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    shell = get_ipython()
    # A terminal IPython has no kernel and would only print a dict repr: treat it like a plain script.
    if shell is None or getattr(shell, "kernel", None) is None:
        return
    quiet_last_record(shell)
    from IPython.display import display
    display({MIME: payload, "text/plain": f"record: {name} = {_short(value)}"}, raw=True)


class _QuietRecord:
    """IPython AST transformer: a cell whose last statement is `record(...)` does not echo the recorded value as
    Out[] (record already showed one line for it; a 40-line dict repeated helps nobody). The value is still
    returned, so `x = record("x", f())` keeps working."""

    def visit(self, node):
        import ast
        body = getattr(node, "body", None)
        if body and isinstance(body[-1], ast.Expr) and isinstance(body[-1].value, ast.Call):
            func = body[-1].value.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "record":
                body.append(ast.fix_missing_locations(ast.copy_location(ast.Pass(), body[-1])))
        return node


def quiet_last_record(shell) -> None:
    """Install `_QuietRecord` in IPython `shell` once (from the first record() in a kernel on)."""
    if not any(isinstance(t, _QuietRecord) for t in shell.ast_transformers):
        shell.ast_transformers.append(_QuietRecord())


def _quiet_in_kernel() -> None:
    # Imported in a kernel's cell: the cells after it are quiet from the start (not only after a first record()).
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    shell = get_ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        quiet_last_record(shell)


_quiet_in_kernel()


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_value(name: str, value: Any, _path: str = "") -> Any:
    """Convert `value` to JSON data (numpy/torch to lists, non-finite floats tagged); RecordError if impossible."""
    where = f" at {_path}" if _path else ""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_FLOAT_KEY: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (list, tuple)):
        return [encode_value(name, v, f"{_path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if set(value) == {_FLOAT_KEY}:
            raise RecordError(name, f"a dict whose only key is {_FLOAT_KEY!r}{where} is reserved for NaN/inf")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RecordError(name, f"dict keys must be str (JSON), got {type(k).__name__} key {k!r}{where}")
            out[k] = encode_value(name, v, f"{_path}[{k!r}]")
        return out
    plain = _from_array_library(value)
    if plain is not _NOT_ARRAY:
        return encode_value(name, plain, _path)
    raise RecordError(name, f"cannot store a value of type {type(value).__module__}.{type(value).__qualname__}"
                            f"{where}; use numbers, str, bool, None, lists/dicts of these, numpy or torch values")


_NOT_ARRAY = object()


def _from_array_library(value: Any) -> Any:
    # Look numpy/torch up only if already imported: a value of their types cannot exist otherwise.
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            return value.tolist()
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return value.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.is_complex():
            return _NOT_ARRAY
        return value.detach().cpu().tolist()
    return _NOT_ARRAY


def decode_value(value: Any) -> Any:
    """Undo `encode_value`'s tagging of non-finite floats (the inverse for JSON data)."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_FLOAT_KEY} and value[_FLOAT_KEY] in _NONFINITE:
            return _NONFINITE[value[_FLOAT_KEY]]
        return {k: decode_value(v) for k, v in value.items()}
    return value


def iter_records(nb_or_path: Any) -> Iterator[tuple[str, Any, RecordCell]]:
    """Yield (name, value, cell) for every record output in notebook order."""
    nb = _load(nb_or_path)
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        where = RecordCell(index, cell.get("id"), tuple(cell.get("metadata", {}).get("tags", [])))
        for output in cell.get("outputs", []):
            if output.get("output_type") not in ("display_data", "execute_result"):
                continue
            payload = output.get("data", {}).get(MIME)
            if payload is None:
                continue
            if isinstance(payload, str):  # some writers store +json data as a string
                payload = json.loads(payload)
            if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or "value" not in payload:
                raise RecordError(payload, f"malformed {MIME} output in cell {index} (id {where.cell_id!r})")
            yield payload["name"], decode_value(payload["value"]), where


def read_records(nb_or_path: Any) -> dict[str, Any]:
    """Records of an executed notebook (path or nbformat node) as {name: value}; a later record wins."""
    return {name: value for name, value, _ in iter_records(nb_or_path)}


def read_record_cells(nb_or_path: Any) -> dict[str, RecordCell]:
    """Which cell produced each record (the last one, matching `read_records`)."""
    return {name: where for name, _, where in iter_records(nb_or_path)}


def read_record_file(path: str | os.PathLike) -> dict[str, Any]:
    """Records appended to a SCALELAB_RECORD_FILE (JSON lines) as {name: value}; a later line wins."""
    out: dict[str, Any] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                payload = json.loads(line)
                out[payload["name"]] = decode_value(payload["value"])
    return out


def _load(nb_or_path: Any) -> Any:
    # Plain json, not nbformat: reading records must not need Jupyter packages, and never executes anything.
    if isinstance(nb_or_path, (str, os.PathLike)):
        with open(Path(nb_or_path), encoding="utf-8") as f:
            return json.load(f)
    return nb_or_path
