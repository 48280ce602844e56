"""record() and read_records() without a kernel: encoding, validation, the JSON-lines file, reading notebooks."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from scalelab.record import (MIME, RecordError, decode_value, encode_value, read_record_cells, read_record_file,
                             read_records, record)


@pytest.fixture(autouse=True)
def _no_record_file(monkeypatch):
    # A developer's own SCALELAB_RECORD_FILE must not receive (or change) these tests' records.
    monkeypatch.delenv("SCALELAB_RECORD_FILE", raising=False)


def _json_round_trip(value):
    # allow_nan=False: what we store must be strict JSON, or nbformat/jupyter_client would mangle it.
    return decode_value(json.loads(json.dumps(encode_value("v", value), allow_nan=False)))


def test_plain_nested_values_round_trip_unchanged():
    value = {"a": [1, 2.5, "x", None, True], "b": {"c": -3}}
    assert _json_round_trip(value) == value


def test_nan_and_infinities_round_trip_as_floats():
    back = _json_round_trip([math.nan, math.inf, -math.inf, {"k": math.nan}])
    assert math.isnan(back[0]) and back[1] == math.inf and back[2] == -math.inf and math.isnan(back[3]["k"])


def test_numpy_values_become_plain_python():
    back = _json_round_trip({"s": np.float32(1.5), "i": np.int64(7), "b": np.bool_(True),
                             "a": np.array([[1.0, np.nan]])})
    assert back["s"] == 1.5 and type(back["s"]) is float
    assert back["i"] == 7 and type(back["i"]) is int
    assert back["b"] is True
    assert back["a"][0][0] == 1.0 and math.isnan(back["a"][0][1])


def test_torch_tensors_become_plain_python():
    torch = pytest.importorskip("torch")
    assert _json_round_trip(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert _json_round_trip(torch.tensor(0.5, requires_grad=True) * 1) == 0.5


def test_tuples_are_stored_as_lists():
    assert _json_round_trip((1, (2, 3))) == [1, [2, 3]]


@pytest.mark.parametrize("name", ["", "1st", "has space", "a/b", None, 3])
def test_bad_names_are_refused_with_the_name(name):
    with pytest.raises(RecordError) as info:
        record(name, 1)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("name", ["loss", "_x", "speedup.4", "lab-1.eff_2"])
def test_good_names_are_accepted(name):
    assert record(name, 1) == 1


def test_unsupported_type_names_the_record_and_the_type():
    with pytest.raises(RecordError, match=r"'model'.*builtins\.object.*\['layers'\]\[1\]"):
        record("model", {"layers": [1, object()]})


def test_non_string_dict_keys_are_refused():
    with pytest.raises(RecordError, match="dict keys must be str"):
        record("d", {1: "one"})


def test_the_nan_tag_cannot_be_forged_by_a_user_dict():
    with pytest.raises(RecordError, match="reserved"):
        record("d", {"$float": "nan"})


def test_record_returns_the_very_same_object():
    arr = np.arange(3)
    assert record("arr", arr) is arr


def test_outside_a_kernel_records_go_to_the_record_file(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    monkeypatch.setenv("SCALELAB_RECORD_FILE", str(path))
    record("loss", 0.5)
    record("loss", math.nan)
    record("steps", 10)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"name": "loss", "value": 0.5}
    records = read_record_file(path)
    assert math.isnan(records["loss"]) and records["steps"] == 10  # the later "loss" wins


def test_without_the_record_file_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert record("x", 1) == 1
    assert list(tmp_path.iterdir()) == []


def test_plain_python_records_without_importing_ipython(tmp_path):
    path = tmp_path / "r.jsonl"
    code = ("import sys; from scalelab.record import record; record('x', 2); "
            "assert 'IPython' not in sys.modules, 'record imported IPython'")
    subprocess.run([sys.executable, "-c", code], check=True, env={"SCALELAB_RECORD_FILE": str(path)})
    assert read_record_file(path) == {"x": 2}


def _output(payload):
    return {"output_type": "display_data", "metadata": {}, "data": {MIME: payload, "text/plain": "r"}}


def _nb(*cells):
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": f"c{i}", "metadata": {"tags": [f"t{i}"]}, "source": "", "outputs": outs,
         "execution_count": None} for i, outs in enumerate(cells)]}


def test_read_records_later_record_wins_and_cells_are_reported(tmp_path):
    nb = _nb([_output({"name": "a", "value": 1}), {"output_type": "stream", "name": "stdout", "text": "hi"}],
             [{"output_type": "display_data", "metadata": {}, "data": {"text/plain": "not a record"}}],
             [_output({"name": "a", "value": {"$float": "inf"}}), _output({"name": "b", "value": [1]})])
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    assert read_records(path) == {"a": math.inf, "b": [1]}
    cells = read_record_cells(nb)
    assert cells["a"].index == 2 and cells["a"].cell_id == "c2" and cells["a"].tags == ("t2",)


def test_read_records_accepts_payloads_stored_as_json_strings():
    assert read_records(_nb([_output(json.dumps({"name": "a", "value": 3}))])) == {"a": 3}


def test_read_records_refuses_a_malformed_record_output():
    with pytest.raises(RecordError, match="malformed"):
        read_records(_nb([_output({"value": 3})]))


def test_a_cell_ending_in_record_does_not_echo_the_whole_value():
    from IPython.core.interactiveshell import InteractiveShell
    from scalelab.record import quiet_last_record
    shell = InteractiveShell.instance()
    try:
        echoed = shell.run_cell("from scalelab.record import record\nrecord('big', {'a': list(range(50))})")
        assert echoed.result == {"a": list(range(50))}  # without the transformer: Out[] repeats the value
        quiet_last_record(shell)
        quiet_last_record(shell)  # once is enough: a second install changes nothing
        assert sum(type(t).__name__ == "_QuietRecord" for t in shell.ast_transformers) == 1
        assert shell.run_cell("record('big', {'a': list(range(50))})").result is None
        assert shell.run_cell("y = record('y', 5)\ny").result == 5  # the value is still returned and shown
    finally:
        InteractiveShell.clear_instance()
