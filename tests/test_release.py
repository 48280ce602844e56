"""`scalelab labs release`: solutions replaced, outputs stripped, hidden checks and run outputs left out."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scalelab.cli import main
from scalelab.course.release import (PLACEHOLDER, ReleaseError, release_lab, release_labs, resolve_lab,
                                     strip_solutions, student_notebook)

FIXTURE_LAB = Path(__file__).parent / "fixtures" / "grading" / "labs" / "90_fixture"


def test_a_solution_block_becomes_the_placeholder_at_its_indentation():
    source = "x = 1\nfor i in range(3):\n    # BEGIN SOLUTION\n    x += i\n    y = 2\n    # END SOLUTION\nprint(x)"
    new, blocks = strip_solutions(source)
    assert blocks == 1
    assert new == ("x = 1\nfor i in range(3):\n    # YOUR CODE HERE\n    raise NotImplementedError(\"exercise\")\n"
                   "print(x)")


def test_several_blocks_and_a_block_at_the_end_of_the_cell():
    new, blocks = strip_solutions("# BEGIN SOLUTION\na = 1\n# END SOLUTION\nb = 2\n# BEGIN SOLUTION\nc = 3\n"
                                  "# END SOLUTION")
    assert blocks == 2 and "a = 1" not in new and "c = 3" not in new and "b = 2" in new
    assert new.count(PLACEHOLDER[1]) == 2 and not new.endswith("\n")


@pytest.mark.parametrize("source, problem", [
    ("# BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n# END SOLUTION\n", "line 2: END SOLUTION without a BEGIN"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "line 2: BEGIN SOLUTION inside another"),
])
def test_unbalanced_markers_are_refused_with_the_cell_and_line(source, problem):
    with pytest.raises(ReleaseError, match=problem) as info:
        strip_solutions(source, "lab.ipynb: cell 3 (id 'ex')")
    assert "cell 3 (id 'ex')" in str(info.value)


def test_student_notebook_strips_outputs_counts_and_run_metadata():
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"papermill": {"x": 1}, "kernelspec": {"name": "k"}},
          "cells": [{"cell_type": "code", "id": "a", "execution_count": 7, "source": ["# BEGIN SOLUTION\n",
                                                                                      "secret = 42\n",
                                                                                      "# END SOLUTION\n"],
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": "42"}],
                     "metadata": {"papermill": {"duration": 1}, "execution": {}, "tags": ["exercise-1"]}},
                    {"cell_type": "markdown", "id": "b", "source": "# BEGIN SOLUTION in prose stays",
                     "metadata": {}},
                    {"cell_type": "code", "id": "c", "execution_count": None, "source": "use(secret)",
                     "outputs": [], "metadata": {}}]}
    nb["cells"].insert(0, {"cell_type": "code", "id": "setup", "execution_count": None, "source": "import x",
                           "outputs": [], "metadata": {}})
    student, blocks = student_notebook(nb)
    setup, code, after = student["cells"][0], student["cells"][1], student["cells"][3]
    assert blocks == 1 and "secret" not in code["source"] and code["outputs"] == []
    # the exercise cell (and every code cell after it) goes on when it raises: Run All reaches the rest of the lab
    assert code["execution_count"] is None and code["metadata"] == {"tags": ["exercise-1", "raises-exception"]}
    assert "papermill" not in student["metadata"]
    assert student["metadata"]["kernelspec"]["name"] == "scalelab"  # students open it on the course kernel
    assert after["metadata"]["tags"] == ["raises-exception"] and setup["metadata"] == {}  # before: stops as usual
    assert student["cells"][2]["source"] == "# BEGIN SOLUTION in prose stays"
    assert nb["cells"][1]["outputs"]  # the reference is not changed


def _lab_with_runs(tmp_path) -> Path:
    lab = tmp_path / "src" / "07_demo"
    shutil.copytree(FIXTURE_LAB, lab)
    (lab / "out" / "fit" / "events").mkdir(parents=True)  # the instructor's own run (out_dir default is "out")
    (lab / "out" / "fit" / "events" / "rank-0.jsonl").write_text("{}\n")
    (lab / "solutions").mkdir()
    (lab / "solutions" / "answers.md").write_text("answers")
    (lab / "__pycache__").mkdir()
    (lab / "__pycache__" / "checks.cpython-311.pyc").write_bytes(b"x")
    (lab / "data").mkdir()
    (lab / "data" / "table.csv").write_text("a,b\n")
    (lab / "my_average.py").write_text("def average(xs):\n    # BEGIN SOLUTION\n    return sum(xs) / len(xs)\n"
                                      "    # END SOLUTION\n")
    return lab


def test_release_lab_writes_only_what_students_may_have(tmp_path):
    lab = _lab_with_runs(tmp_path)
    report = release_lab(lab, tmp_path / "student" / "07_demo")
    out = report.out
    assert sorted(report.files) == ["README.md", "checks.py", "data/table.csv", "lab.ipynb", "lab.yaml",
                                    "my_average.py"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == sorted(report.files)
    assert "hidden_checks.py" in report.left_out and "out/fit/events/rank-0.jsonl" in report.left_out
    assert "solutions/answers.md" in report.left_out
    nb = json.loads((out / "lab.ipynb").read_text())
    text = json.dumps(nb)
    assert report.exercises == 3 and "SOLUTION" not in text and "w -= lr" not in text
    assert text.count("NotImplementedError") == 2
    module = (out / "my_average.py").read_text()  # exercises in modules are stripped too
    assert module == 'def average(xs):\n    # YOUR CODE HERE\n    raise NotImplementedError("exercise")\n'
    assert (out / "checks.py").read_text() == (lab / "checks.py").read_text()
    assert oct(out.stat().st_mode & 0o777) == "0o755"


def test_a_second_release_removes_files_that_are_no_longer_released(tmp_path):
    lab = _lab_with_runs(tmp_path)
    out = tmp_path / "student" / "07_demo"
    release_lab(lab, out)
    (lab / "data" / "table.csv").unlink()
    release_lab(lab, out)
    assert not (out / "data").exists()


def test_release_refuses_to_write_over_the_reference(tmp_path):
    lab = _lab_with_runs(tmp_path)
    for bad in (lab, lab / "student", lab.parent):
        with pytest.raises(ReleaseError, match="would overwrite or contain the reference lab"):
            release_lab(lab, bad)
    assert (lab / "hidden_checks.py").exists()


def test_release_labs_finds_every_lab_and_names_unknown_ones(tmp_path):
    root = tmp_path / "labs"
    for name in ("01_a", "02_b"):
        shutil.copytree(FIXTURE_LAB, root / name)
    (root / "not_a_lab").mkdir()
    reports = release_labs(None, root, tmp_path / "out")
    assert [r.lab for r in reports] == ["01_a", "02_b"]
    assert (tmp_path / "out" / "02_b" / "lab.ipynb").exists()
    with pytest.raises(ReleaseError, match=r"no lab 'nope'.*labs there: 01_a, 02_b"):
        resolve_lab("nope", root)
    with pytest.raises(ReleaseError, match="no labs found"):
        release_labs(None, tmp_path / "empty", tmp_path / "out")


def test_cli_release_defaults_to_build_student_labs(monkeypatch, capsys):
    seen = {}

    def fake(names, labs_root, out_root):
        seen.update(names=names, labs_root=labs_root, out_root=out_root)
        return []
    monkeypatch.setattr("scalelab.course.release.release_labs", fake)
    assert main(["labs", "release", "01_x"]) == 0
    assert seen["names"] == ["01_x"]
    assert Path(seen["out_root"]).parts[-3:] == ("build", "student", "labs")
    assert Path(seen["labs_root"]).name == "labs"


def test_cli_release_of_the_fixture_lab(tmp_path, capsys):
    assert main(["labs", "release", str(FIXTURE_LAB), "--out", str(tmp_path)]) == 0
    assert "90_fixture: 2 exercise(s), 4 file(s)" in capsys.readouterr().out
    assert not (tmp_path / "90_fixture" / "hidden_checks.py").exists()
