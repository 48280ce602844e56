"""The labs' exercise markers and conventions: balanced markers, every exercise followed by a record(), a
tagged parameters cell, lab.yaml complete. The helpers the lab tests share live in tests/labtests.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from labtests import ROOT, BEGIN, END, student_source
from scalelab.course.release import ReleaseError

LABS = sorted(p for p in (ROOT / "labs").glob("0[1-4]_*") if (p / "lab.ipynb").exists())


def _code_cells(lab_dir: Path) -> list[str]:
    nb = json.loads((lab_dir / "lab.ipynb").read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


# -- the helper itself -----------------------------------------------------------------------------------
def test_student_source_replaces_blocks_and_keeps_setup_code():
    src = "x = 1\n# BEGIN SOLUTION\ny = 2\n# END SOLUTION\nrecord('y', y)\n"
    assert student_source(src) == "x = 1\n# YOUR CODE HERE\nraise NotImplementedError(\"exercise\")\nrecord('y', y)\n"
    indented = "def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n"
    assert student_source(indented) == "def f():\n    # YOUR CODE HERE\n    raise NotImplementedError(\"exercise\")\n"
    with pytest.raises(ReleaseError, match="never closed"):
        student_source("# BEGIN SOLUTION\nx = 1\n")


# -- every lab's notebook follows the conventions ---------------------------------------------------------
@pytest.mark.parametrize("lab_dir", LABS, ids=[p.name for p in LABS])
def test_lab_follows_the_conventions(lab_dir):
    nb = json.loads((lab_dir / "lab.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "parameters" in code[0].get("metadata", {}).get("tags", []), "first code cell must be tagged parameters"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit without outputs"
    params = "".join(code[0]["source"]).splitlines()
    assert any(line.startswith("out_dir = ") for line in params), "an out_dir parameter is required"
    for line in params:
        assert re.match(r"^\w+ = .+  # \S", line), f"parameter line needs `name = value  # comment`: {line!r}"
    meta = yaml.safe_load((lab_dir / "lab.yaml").read_text())
    assert {"title", "minutes", "goals", "grading"} <= set(meta)
    assert {"parameters", "cell_timeout_s", "total_timeout_s"} <= set(meta["grading"])
    names = {line.split(" = ")[0] for line in params}
    assert set(meta["grading"]["parameters"]) <= names, "grading parameters must exist in the parameters cell"
    assert (lab_dir / "checks.py").exists() and (lab_dir / "hidden_checks.py").exists()


@pytest.mark.parametrize("lab_dir", LABS, ids=[p.name for p in LABS])
def test_every_exercise_is_recorded_after_its_solution(lab_dir):
    cells = _code_cells(lab_dir)
    exercises = [i for i, src in enumerate(cells) if BEGIN in src]
    assert exercises, "a lab needs at least one exercise"
    for i in exercises:
        after = cells[i].split(END, 1)[1] + "".join(cells[i + 1:])
        assert "record(" in after, f"code cell {i}: nothing is recorded after the solution block"
    # the student copy keeps every cell, only the solution lines change
    assert len([student_source(s) for s in cells]) == len(cells)
