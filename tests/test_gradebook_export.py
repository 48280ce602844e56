"""`scalelab course gradebook --format canvas|moodle`: the course's grades in those systems' import CSVs.

The grades are real report folders (`report.write_submission`, as `scalelab grade` writes them); the files are made
by the real command and read back with the csv module, as Canvas and Moodle read them: columns, the Points
Possible row, the numbers, quoting, and the attacks (a formula in a name or an identifier: CSV injection).
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from scalelab.cli import main
from scalelab.course.gradebook import FORMULA_START
from scalelab.grade.checks import CheckResult
from scalelab.grade.grader import SubmissionResult
from scalelab.grade.report import prepare_out_dir, write_submission

LAB1, LAB2 = "01_single_device", "02_data_parallel"
ALICE_NAME = 'Smith, Alice "Al"'                       # a comma and quotes: must survive the CSV round trip
BOB_NAME = '=HYPERLINK("http://evil.example","x")'     # a formula: must never be written as one
CANVAS_HEAD = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]


def _grade(out: Path, student: str, lab: str, score: float, max_score: float, status: str = "ok") -> None:
    prepare_out_dir(out)
    checks = [CheckResult("runs", "pass" if score else "fail", score, max_score)]
    write_submission(out, SubmissionResult(student, lab, f"{student}/", status, "ran", score, max_score, checks))


@pytest.fixture
def course(tmp_path):
    """Two graded labs: alice has both, bob only lab 1, carol's lab 1 was graded when it had 5 points."""
    grades = tmp_path / "grades"
    _grade(grades / LAB1, "alice", LAB1, 7.5, 10)
    _grade(grades / LAB2, "alice", LAB2, 8, 8)
    _grade(grades / LAB1, "bob", LAB1, 10, 10)
    _grade(grades / LAB1, "carol", LAB1, 5, 5)
    _grade(grades / LAB2, "carol", LAB2, 3, 8)
    roster = tmp_path / "roster.csv"
    _write_roster(roster, [
        ["login", "Student", "ID", "SIS User ID", "SIS Login ID", "Section", "email", "username"],
        ["alice", ALICE_NAME, "101", "S001", "asmith", "Sec, A", "alice@uni.example", "asmith"],
        ["bob", BOB_NAME, "102", "S002", "bjones", "Sec B", "bob@uni.example", "bjones"],
        ["carol", "@SUM(1+1)", "103", "", "", "", "carol@uni.example", "cwu"],
        ["dave", "Dave (never graded)", "104", "", "", "", "dave@uni.example", "dave"],
    ])
    return {"grades": grades, "roster": roster, "tmp": tmp_path}


def _write_roster(path: Path, rows, bom: bool = False) -> None:
    with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
        csv.writer(f).writerows(rows)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["course", "gradebook", *argv])
    got = capsys.readouterr()
    return code, got.out.strip(), got.err


def _read(path: str | Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_canvas_file_has_canvas_columns_a_points_possible_row_and_points(course, capsys):
    code, path, err = _run(capsys, "--grades", str(course["grades"]), "--format", "canvas", "--roster",
                           str(course["roster"]), "--canvas-assignment", f"{LAB1}=555")
    assert code == 0, err
    assert Path(path) == course["grades"] / "course_gradebook_canvas.csv"
    assert os.stat(path).st_mode & 0o777 == 0o600  # every student's grades: the instructor's only
    rows = _read(path)
    assert rows[0] == [*CANVAS_HEAD, f"{LAB1} (555)", LAB2]  # an id updates that assignment; none creates one
    assert rows[1] == ["Points Possible", "", "", "", "", "10", "8"]
    by_id = {r[1]: r for r in rows[2:]}
    assert set(by_id) == {"101", "102", "103"}  # dave has no result: no row
    assert by_id["101"] == [ALICE_NAME, "101", "S001", "asmith", "Sec, A", "7.5", "8"]
    assert by_id["102"][5:] == ["10", ""]        # bob has no lab 2 result: blank (Canvas changes nothing)
    assert by_id["103"][5:] == ["10", "3"]       # 5/5 on the lab's old 5-point version: 10 of today's 10 points
    raw = Path(path).read_text(encoding="utf-8")
    assert '"Smith, Alice ""Al"""' in raw and '"Sec, A"' in raw  # RFC 4180 quoting of commas and quotes


def test_no_cell_of_either_file_is_a_formula_and_names_are_kept_as_text(course, capsys):
    for fmt in ("canvas", "moodle"):
        code, path, err = _run(capsys, "--grades", str(course["grades"]), "--format", fmt, "--roster",
                               str(course["roster"]))
        assert code == 0, err
        cells = [c for row in _read(path) for c in row]
        assert not [c for c in cells if c.startswith(FORMULA_START)], fmt
    canvas = {r[1]: r[0] for r in _read(course["grades"] / "course_gradebook_canvas.csv")[2:]}
    assert canvas["102"] == "'" + BOB_NAME and canvas["103"] == "'@SUM(1+1)"  # shown as text, never evaluated


@pytest.mark.parametrize("column,value", [("ID", "=1+1"), ("SIS Login ID", "+cmd|' /C calc'!A0"),
                                          ("email", "@evil"), ("SIS User ID", "-2+3")])
def test_a_roster_identifier_that_starts_like_a_formula_is_refused(course, capsys, column, value):
    rows = _read(course["roster"])
    rows[1][rows[0].index(column)] = value
    _write_roster(course["roster"], rows)
    out = course["tmp"] / "lms.csv"
    code, _, err = _run(capsys, "--grades", str(course["grades"]), "--format", "canvas", "--roster",
                        str(course["roster"]), "--out", str(out))
    assert code == 1 and not out.exists()
    assert f"line 2: {column}" in err and "formula" in err and "fix the roster" in err


def test_moodle_file_has_an_identifier_column_and_percent_numbers_only(course, capsys):
    code, path, err = _run(capsys, "--grades", str(course["grades"]), "--format", "moodle", "--roster",
                           str(course["roster"]), "--out", str(course["tmp"] / "moodle.csv"))
    assert code == 0, err
    rows = _read(path)
    assert rows[0] == ["Email address", LAB1, LAB2]
    assert rows[1:] == [["alice@uni.example", "75", "100"], ["bob@uni.example", "100", ""],
                        ["carol@uni.example", "100", "37.5"]]
    for row in rows[1:]:
        for cell in row[1:]:
            assert cell == "" or 0 <= float(cell) <= 100  # numbers only; empty is Moodle's "no grade"
    code, path, err = _run(capsys, "--grades", str(course["grades"]), "--format", "moodle", "--roster",
                           str(course["roster"]), "--moodle-id", "username")
    assert code == 0, err
    assert [r[0] for r in _read(path)] == ["Username", "asmith", "bjones", "cwu"]


def test_a_graded_student_missing_from_the_roster_is_named_unless_allowed(course, capsys):
    _grade(course["grades"] / LAB1, "eve", LAB1, 4, 10)
    args = ["--grades", str(course["grades"]), "--format", "canvas", "--roster", str(course["roster"])]
    code, _, err = _run(capsys, *args)
    assert code == 1 and "not in the roster: eve" in err and "--allow-missing" in err
    assert not (course["grades"] / "course_gradebook_canvas.csv").exists()
    code, path, err = _run(capsys, *args, "--allow-missing")
    assert code == 0 and "left out, not in the roster: eve" in err
    assert [r[0] for r in _read(path)][2:] == [ALICE_NAME, "'" + BOB_NAME, "'@SUM(1+1)"]


def test_a_result_the_grader_failed_on_is_a_blank_cell_and_reported(course, capsys):
    _grade(course["grades"] / LAB2, "bob", LAB2, 0, 8, status="grader_error")
    code, path, err = _run(capsys, "--grades", str(course["grades"]), "--format", "moodle", "--roster",
                           str(course["roster"]))
    assert code == 0
    assert ["bob@uni.example", "100", ""] in _read(path)  # not a 0: it was not the student's fault
    assert "blank cell: bob 02_data_parallel: the grader failed on it" in err


def test_a_canvas_export_with_a_bom_serves_as_the_roster_through_login_column(course, capsys):
    roster = course["tmp"] / "canvas_export.csv"
    _write_roster(roster, [[*CANVAS_HEAD, "Lab X (77)", "Notes"], ["    Points Possible", "", "", "", "", "10", ""],
                           ["Smith, Alice", "101", "S001", "alice", "A", "3", "=not read"],
                           ["Jones, Bob", "102", "S002", "bob", "A", "-", "line one\nline two"],
                           ["Wu, Carol", "103", "S003", "carol", "B", "", ""]], bom=True)
    code, path, err = _run(capsys, "--grades", str(course["grades"]), "--format", "canvas", "--roster",
                           str(roster), "--login-column", "SIS Login ID")
    assert code == 0, err
    assert [r[:4] for r in _read(path)[2:]] == [["Smith, Alice", "101", "S001", "alice"],
                                                ["Jones, Bob", "102", "S002", "bob"],
                                                ["Wu, Carol", "103", "S003", "carol"]]


@pytest.mark.parametrize("argv,says", [
    ([], "needs --roster FILE"),
    (["--roster", "ROSTER", "--login-column", "hub_name"], "no 'hub_name' column"),
    (["--roster", "NOWHERE"], "cannot read it"),
    (["--roster", "ROSTER", "--canvas-assignment", "01_single_device"], "give LAB=ID"),
    (["--roster", "ROSTER", "--canvas-assignment", "01_single_device=abc"], "a Canvas assignment id is a number"),
    (["--roster", "ROSTER", "--canvas-assignment", "99_nope=5"], "no graded lab of that name"),
])
def test_bad_export_options_are_clear_errors(course, capsys, argv, says):
    argv = [str(course["roster"]) if a == "ROSTER" else str(course["tmp"] / "none.csv") if a == "NOWHERE" else a
            for a in argv]
    code, _, err = _run(capsys, "--grades", str(course["grades"]), "--format", "canvas", *argv)
    assert code == 1 and says in err, err


def test_roster_lines_a_student_cannot_be_matched_by_are_refused(course, capsys):
    rows = _read(course["roster"])
    rows[2][2] = rows[2][3] = rows[2][4] = ""  # bob: no ID, SIS User ID or SIS Login ID
    rows.append(["alice", "Alice again", "109", "", "", "", "", ""])
    _write_roster(course["roster"], rows)
    code, _, err = _run(capsys, "--grades", str(course["grades"]), "--format", "canvas", "--roster",
                        str(course["roster"]))
    assert code == 1 and "line 6: 'alice' is listed twice" in err
    _write_roster(course["roster"], rows[:-1])
    code, _, err = _run(capsys, "--grades", str(course["grades"]), "--format", "canvas", "--roster",
                        str(course["roster"]))
    assert code == 1 and "'bob' has none of ID, SIS User ID, SIS Login ID" in err


def test_the_default_format_is_still_scalelabs_own_csv(course, capsys):
    code, path, err = _run(capsys, "--grades", str(course["grades"]), "--collected", str(course["tmp"] / "none"))
    assert code == 0, err
    rows = _read(path)
    assert rows[0] == ["Student", f"{LAB1} (%)", f"{LAB1} status", f"{LAB1} late", f"{LAB2} (%)", f"{LAB2} status",
                       f"{LAB2} late", "Average (%)"]
    assert rows[1] == ["alice", "75.0", "ok", "", "100.0", "ok", "", "87.5"]
    assert rows[2] == ["bob", "100.0", "ok", "", "", "not graded", "", "50.0"]
    assert os.stat(path).st_mode & 0o777 == 0o600
