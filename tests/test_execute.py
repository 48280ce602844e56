"""execute_notebook on real kernels (papermill), one fixture notebook per behaviour, plus scalelab.testing.

Each kernel start costs ~2-3 s here, so every test that starts one asserts all it can about that run.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import psutil
import pytest

from scalelab.grade import (NotebookCellError, NotebookCellTimeout, NotebookDeadKernel, NotebookMalformed,
                            NotebookParameterError, NotebookTimeout, execute_notebook)
from scalelab.course.execute import MARKER_TAG, NotebookError
from scalelab.record import MIME
from scalelab.testing.labs import execute_lab, format_failure, run_lab

NB = Path(__file__).parent / "notebooks"


def _run(name, parameters=None, tmp_path=None, **kw):
    return execute_notebook(NB / name, parameters, output_path=tmp_path / name, **kw)


def _cells(output_path):
    return json.loads(Path(output_path).read_text())["cells"]


def test_records_round_trip_through_a_real_kernel(tmp_path):
    result = _run("records.ipynb", tmp_path=tmp_path)
    assert result.status == "ok" and result.error is None
    r = result.records
    assert (r["int"], r["float"], r["text"], r["flag"], r["nothing"]) == (3, 0.25, "héllo", True, None)
    assert r["nested"] == {"a": [1, 2.5, {"b": None}], "c": [4, 5]}
    assert (r["np_scalar"], r["np_array"], r["np_int"]) == (1.5, [[0, 1, 2], [3, 4, 5]], 7)
    assert math.isnan(r["nan"]) and r["infs"][:2] == [math.inf, -math.inf] and math.isnan(r["infs"][2])
    assert r["twice"] == 2  # the later record wins
    outputs = [o for c in _cells(result.output_path) if c["cell_type"] == "code" for o in c["outputs"]]
    texts = ["".join(o["data"]["text/plain"]) for o in outputs if MIME in o.get("data", {})]
    assert "record: int = 3" in texts  # the fallback a person sees in the notebook


def test_default_kernel_is_this_interpreter(tmp_path):
    result = _run("kernel_python.ipynb", tmp_path=tmp_path)
    assert result.records == {"executable": sys.executable}


def test_parameters_are_injected_and_used(tmp_path):
    result = _run("params.ipynb", {"n": 5, "label": "five"}, tmp_path).raise_for_status()
    assert result.records == {"n_squared": 25, "label": "five"}


def test_unknown_parameter_is_refused_before_executing(tmp_path):
    with pytest.raises(NotebookParameterError) as info:
        _run("params.ipynb", {"n": 1, "nope": 2}, tmp_path)
    assert "nope" in str(info.value) and "['label', 'n']" in str(info.value)
    assert info.value.unknown == ("nope",) and info.value.known == ("label", "n")
    assert not (tmp_path / "params.ipynb").exists()  # nothing ran


def test_non_json_parameter_is_refused(tmp_path):
    with pytest.raises(NotebookParameterError, match="'n' must be JSON data"):
        _run("params.ipynb", {"n": object()}, tmp_path)


def test_output_path_may_not_overwrite_the_input():
    with pytest.raises(NotebookError, match="is the input notebook"):
        execute_notebook(NB / "params.ipynb", output_path=NB / "params.ipynb")


def test_unknown_kernel_name_is_a_harness_error(tmp_path):
    with pytest.raises(NotebookError, match="could not execute .*NoSuchKernel: No such kernel named no-such-kernel"):
        _run("kernel_python.ipynb", tmp_path=tmp_path, kernel_name="no-such-kernel")


def test_cell_error_names_the_tagged_cell_and_keeps_earlier_records(tmp_path):
    # With a parameter, papermill adds an injected cell and error markers: the index must still be the source's.
    result = _run("cell_error.ipynb", {"scale": 3}, tmp_path)
    err = result.error
    assert result.status == "cell_error" and isinstance(err, NotebookCellError)
    assert err.cell_tags == ("boom",) and err.cell_id == "cell-error-3" and err.cell_index == 3
    assert (err.ename, err.evalue) == ("ValueError", "bad value 21")
    assert "bad value 21" in err.traceback and "\x1b[" not in err.traceback
    assert 'raise ValueError(f"bad value {7 * scale}")' in err.source
    assert result.records == {"before": 3}  # "after" never ran
    assert any(o["output_type"] == "error" for c in _cells(result.output_path) for o in c.get("outputs", []))
    with pytest.raises(NotebookCellError):
        result.raise_for_status()


def test_cell_timeout_names_the_slow_cell(tmp_path):
    result = _run("cell_timeout.ipynb", tmp_path=tmp_path, cell_timeout=1)
    err = result.error
    assert result.status == "cell_timeout" and isinstance(err, NotebookCellTimeout)
    assert err.cell_tags == ("slow",) and err.limit_s == 1
    assert result.records == {"before": 1}
    assert result.duration_s < 30  # the cell sleeps 60 s
    assert MARKER_TAG in _cells(result.output_path)[0]["metadata"]["tags"]


def test_total_timeout_stops_the_run_and_leaves_no_kernel(tmp_path):
    # Each cell sleeps 2 s, under the 5 s cell limit; together with start-up they pass the 8 s total.
    pid_file = tmp_path / "kernel.pid"
    before = set(psutil.Process().children(recursive=True))  # what session fixtures of this test process run
    result = _run("total_timeout.ipynb", {"pid_file": str(pid_file)}, tmp_path, cell_timeout=5, total_timeout=8)
    err = result.error
    assert result.status == "timeout" and isinstance(err, NotebookTimeout) and err.limit_s == 8
    assert err.cell_tags[0].startswith("step")
    assert result.records == {"started": True}
    assert result.duration_s < 8 + 10
    kernel_pid = int(pid_file.read_text())
    assert not psutil.pid_exists(kernel_pid) or psutil.Process(kernel_pid).status() == psutil.STATUS_ZOMBIE
    assert set(psutil.Process().children(recursive=True)) - before == set()  # nothing this run started is left
    assert Path(result.output_path).exists()


def test_os_exit_in_a_cell_is_a_dead_kernel(tmp_path):
    result = _run("dead_kernel.ipynb", tmp_path=tmp_path)
    assert result.status == "dead_kernel" and isinstance(result.error, NotebookDeadKernel)
    assert result.error.cell_tags == ("exit",)
    assert result.records == {"before": 1}
    with pytest.raises(NotebookDeadKernel):
        result.raise_for_status()


def test_malformed_json_is_reported_with_the_file_name(tmp_path):
    result = _run("malformed.ipynb", tmp_path=tmp_path)
    assert result.status == "malformed" and isinstance(result.error, NotebookMalformed)
    assert "malformed.ipynb" in str(result.error) and "not valid JSON" in str(result.error)
    with pytest.raises(NotebookMalformed):
        result.raise_for_status()


@pytest.mark.parametrize("content, parameters, problem", [
    (None, None, "no such file"),
    ("[1, 2]", None, "not a Jupyter notebook"),
    (json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "id": "x"}]}),
     None,
     "not a valid notebook"),
    ((NB / "records.ipynb").read_text(), {"x": 1}, "no cell is tagged 'parameters'"),
])
def test_other_malformed_notebooks_say_what_is_wrong(tmp_path, content, parameters, problem):
    path = tmp_path / "student.ipynb"
    if content is not None:
        path.write_text(content)
    result = execute_notebook(path, parameters, output_path=tmp_path / "out.ipynb")
    assert result.status == "malformed" and problem in str(result.error) and "student.ipynb" in str(result.error)


def test_stderr_output_does_not_fail_the_run(tmp_path):
    result = _run("stderr.ipynb", tmp_path=tmp_path)
    assert result.status == "ok" and result.records == {"done": True}


def test_run_lab_returns_the_records_of_a_lab_folder():
    assert run_lab(NB / "lab_ok", n=3) == {"n_cubed": 27}


def test_a_failing_lab_fails_the_test_with_source_and_traceback(tmp_path):
    with pytest.raises(pytest.fail.Exception) as info:
        execute_lab(NB / "lab_ok", {"fail": True}, output_dir=tmp_path)
    text = str(info.value)
    for expected in ("exercise-1", 'raise RuntimeError("asked to fail")', "RuntimeError: asked to fail",
                     "['n_cubed']", str(tmp_path / "lab.ipynb")):
        assert expected in text


def test_format_failure_needs_a_failed_result(tmp_path):
    result = _run("malformed.ipynb", tmp_path=tmp_path)
    assert "status 'malformed'" in format_failure(result)
