"""Reading what a submission's run left behind, as data that may be hostile.

Everything under a job's folder was written by code the student controls. The grader reads it only after every
process of the run is dead, and then: never through a symbolic link (each path part opened with O_NOFOLLOW
from a folder the grader created), only regular files, never more than a size cap, as JSON (nothing unpickled
or executed), tolerating malformed parts, and with long texts cut before they are stored or shown.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import UntrustedFileError
from ..paths import read_beneath
from ..record import MIME, decode_value

MAX_NOTEBOOK_BYTES = 64 * 2**20
MAX_OUTPUT_CHARS = 20_000
"""Per output (stream text, text/plain, a traceback) in the stored notebook and in feedback."""
MAX_RECORD_PAYLOAD_CHARS = 200_000
MAX_IMAGE_CHARS = 1_000_000
"""Per image or other binary output (base64 characters): a lab's plots are kept in the stored notebook, so an
instructor sees the figures a student saw (and the site can show a graded reference); a larger blob is dropped."""
TRUNCATED = "\n[... {n} characters cut by the grader ...]\n"


def load_json_beneath(base, relpath, max_bytes: int = MAX_NOTEBOOK_BYTES) -> Any:
    """JSON data of a run's file (see `read_beneath`); UntrustedFileError or ValueError when unreadable."""
    return json.loads(read_beneath(base, relpath, max_bytes).decode("utf-8"))


def cap_text(text: Any, limit: int = MAX_OUTPUT_CHARS) -> str:
    """`text` as str, cut in the middle when longer than `limit` (start and end are what people read)."""
    text = "".join(text) if isinstance(text, list) else str(text)
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return text[:head] + TRUNCATED.format(n=len(text) - limit) + text[-tail:]


def tolerant_records(nb: Any) -> tuple[dict[str, Any], list[str]]:
    """Records of an executed notebook like `read_records`, skipping malformed ones; returns (records, problems)."""
    records, problems = {}, []
    cells = nb.get("cells", []) if isinstance(nb, dict) else []
    for index, cell in enumerate(cells if isinstance(cells, list) else []):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code" or not isinstance(cell.get("outputs"), list):
            continue
        for output in cell["outputs"]:
            data = output.get("data") if isinstance(output, dict) else None
            if not isinstance(data, dict) or MIME not in data:
                continue
            payload = data[MIME]
            try:
                if isinstance(payload, str):
                    if len(payload) > MAX_RECORD_PAYLOAD_CHARS:
                        raise ValueError("too large")
                    payload = json.loads(payload)
                name = payload["name"]
                if not isinstance(name, str):
                    raise ValueError("name is not a string")
                records[name] = decode_value(payload["value"])
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                problems.append(f"cell {index}: a malformed record output was ignored ({type(e).__name__})")
    return records, problems


def cap_notebook(nb: dict, limit: int = MAX_OUTPUT_CHARS, image_limit: int = MAX_IMAGE_CHARS) -> tuple[dict, int]:
    """Cut every long text output of an executed notebook in place (for storing and showing) and drop images over
    `image_limit`; returns (nb, cuts)."""
    cuts = 0
    cells = nb.get("cells") if isinstance(nb, dict) else None
    for cell in cells if isinstance(cells, list) else []:
        if not isinstance(cell, dict):
            continue
        for output in cell.get("outputs", []) if isinstance(cell.get("outputs"), list) else []:
            if not isinstance(output, dict):
                continue
            if "text" in output:
                cuts += _cap_field(output, "text", limit)
            if "traceback" in output and isinstance(output["traceback"], list):
                joined = "\n".join(map(str, output["traceback"]))
                if len(joined) > limit:
                    output["traceback"], cuts = [cap_text(joined, limit)], cuts + 1
            data = output.get("data")
            if isinstance(data, dict):
                for key in list(data):
                    if key == MIME:
                        if len(json.dumps(data[key])) > MAX_RECORD_PAYLOAD_CHARS:
                            data[key], cuts = {"name": "cut", "value": None}, cuts + 1
                    elif key.startswith("text/") or key.endswith("+json") or key.endswith("json"):
                        cuts += _cap_field(data, key, limit)
                    elif len(str(data[key])) > image_limit:  # images and other blobs
                        data.pop(key)
                        data.setdefault("text/plain", f"[{key} output dropped by the grader: too large]")
                        cuts += 1
    return nb, cuts


def _cap_field(d: dict, key: str, limit: int) -> int:
    value = d[key]
    text = value if isinstance(value, str) else ("".join(value) if isinstance(value, list) and
                                                  all(isinstance(v, str) for v in value) else json.dumps(value))
    if len(text) <= limit:
        return 0
    d[key] = cap_text(text, limit)
    return 1


__all__ = ["UntrustedFileError", "read_beneath", "load_json_beneath", "cap_text", "tolerant_records",
           "cap_notebook", "MAX_NOTEBOOK_BYTES", "MAX_OUTPUT_CHARS", "MAX_IMAGE_CHARS"]
