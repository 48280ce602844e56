"""The event stream is declared in one place (scalelab/run/event_types.py) and held to it: every `emit` in the code
names a declared type with declared fields; a writer in strict mode (the whole suite runs so: tests/conftest.py)
refuses anything else, so any run a test starts that writes an undeclared event fails; Run.events filters by type
and rank."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from scalelab.run.event_types import COMMON, EVENTS, EventError, STRICT_ENV, undeclared
from scalelab.run.events import EventWriter

ROOT = Path(__file__).resolve().parent.parent


def _emits():
    """(where, type, literal keyword names) of every `<x>.emit(...)` call in scalelab/."""
    for path in sorted((ROOT / "scalelab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit":
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                first = node.args[0] if node.args else None
                kind = first.value if isinstance(first, ast.Constant) else None
                yield where, kind, [k.arg for k in node.keywords if k.arg is not None]


def test_every_emit_in_the_code_is_declared():
    found = list(_emits())
    assert len(found) >= 25, f"the scan found only {len(found)} emit calls: is it still reading scalelab/?"
    problems = []
    for where, kind, fields in found:
        if kind is None:
            problems.append(f"{where}: the event type is not a literal string (declare it and write it out)")
            continue
        problems += [f"{where}: {p}" for p in undeclared({"type": kind, **dict.fromkeys(fields)})]
    assert problems == [], "\n".join(problems)
    assert {kind for _, kind, _ in found} == set(EVENTS), "declared types no code writes: remove them"


def test_every_declared_field_says_what_it_is():
    for kind, fields in {"(common)": COMMON, **EVENTS}.items():
        for name, meaning in fields.items():
            assert isinstance(meaning, str) and len(meaning) > 3, f"{kind}.{name} has no description"


def test_a_strict_writer_refuses_what_is_not_declared(tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    w = EventWriter(tmp_path, rank=0)
    w.emit("step", step=1, loss=0.5, samples=8, step_s=0.01)
    with pytest.raises(EventError, match="'step' event field 'losss' is not declared"):
        w.emit("step", step=2, losss=0.4)
    with pytest.raises(EventError, match="event type 'stepp' is not declared"):
        w.emit("stepp", step=3)
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "events" / "rank-0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == [1], "a refused event must not reach the file"
    monkeypatch.setenv(STRICT_ENV, "0")  # outside the suite a writer does not check: a run never dies of it
    w = EventWriter(tmp_path, rank=1)
    w.emit("step", step=1, losss=0.4)
    w.close()


def test_the_suite_runs_strict():
    import os
    assert os.environ.get(STRICT_ENV) == "1", "tests/conftest.py must set SCALELAB_STRICT_EVENTS=1"


def test_run_events_filter_by_type_and_rank(tmp_path):
    from scalelab import launch, preset
    run = launch(preset("tiny").with_overrides({"steps": 4, "world.workers_per_node": 2, "checkpoint.every_steps": 2,
                                                "output_dir": str(tmp_path / "r")}))
    run.wait(timeout=300)
    everything = run.events()
    for e in everything:  # a run started by a test was strict already; its file is held to the declaration too
        assert undeclared(e) == [], e
    steps = run.events(type="step")
    assert steps and {e["type"] for e in steps} == {"step"} and {e["rank"] for e in steps} == {0, 1}
    assert [e["step"] for e in run.events(type="step", rank=1)] == [1, 2, 3, 4]
    assert len(run.events(type="checkpoint", rank=0)) == 1  # at step 2; none at a run's final step
    assert len(run.events(rank=0)) + len(run.events(rank=1)) == len(everything)
    with pytest.raises(ValueError, match="no such event type"):
        run.events(type="steps")
