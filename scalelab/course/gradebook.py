"""The course's grades in a learning management system's own import format: Canvas and Moodle gradebook CSVs.

    scalelab course gradebook --format canvas --roster lms_roster.csv    # build/grades/course_gradebook_canvas.csv
    scalelab course gradebook --format moodle --roster lms_roster.csv    # build/grades/course_gradebook_moodle.csv

The formats, as their own documentation states them:

* Canvas, "How do I import grades in the Gradebook?"
  (https://community.canvaslms.com/t5/Instructor-Guide/How-do-I-import-grades-in-the-Gradebook/ta-p/807, and the
  Ohio State guide to it, https://teaching.resources.osu.edu/toolsets/carmencanvas/guides/calculating-final-grades/
  import-csv-file-carmen-grades): the columns `Student`, `ID`, `SIS User ID`, `SIS Login ID`, `Section`, then one
  column per assignment, named `Name (assignment id)` to update that assignment or `Name` for Canvas to create
  one; a student is matched by ID, SIS User ID or SIS Login ID; a second row whose first cell reads
  `Points Possible` gives each assignment's points; a blank cell changes nothing.
* Moodle, "Grade import" (https://docs.moodle.org/311/en/Grade_import, and the importer itself,
  moodle/grade/import/csv/classes/load_data.php): a header row, one column that identifies the user (mapped on
  import from the column to `useremail`, `username` or `useridnumber`), one column per grade item, numbers only;
  an empty cell or `-` is "no grade"; a grade over 100 is refused unless the site allows it, so the cells are the
  lab's percent (0-100: give the grade items a maximum of 100).

Students are mapped to their LMS identities through a roster the instructor supplies: a CSV with a header, a
`login` column (the hub login name the grades are filed under; `--login-column` names another, e.g. `SIS Login
ID` of a Canvas export when those are the hub's names), and the LMS's columns: `Student`, `ID`, `SIS User ID`,
`SIS Login ID`, `Section` for Canvas (a Canvas gradebook export with a `login` column added serves as is);
`email`, `username` or `idnumber` (or Moodle's own headers `Email address`, `Username`, `ID number`) for Moodle.

CSV injection: a cell a spreadsheet would run as a formula (starting with = + - @, a tab or a carriage return) is
never written as one. A display name gets a leading `'` (shown as text); an identifier that starts like a formula
is refused when the roster is read, since no LMS issues one and a changed identifier would match nobody.
"""
from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .lab import GradingError

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
#: Canvas's identity columns, in the order its import (and export) has them.
CANVAS_IDENTITY = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
#: The columns Canvas matches a student by: a row must give at least one.
CANVAS_MATCH = ("ID", "SIS User ID", "SIS Login ID")
#: Moodle's user fields a grade import can map from: the roster headers accepted for each, and the header written.
MOODLE_IDS = {"email": (("email", "email address", "useremail"), "Email address"),
              "username": (("username",), "Username"),
              "idnumber": (("idnumber", "id number", "useridnumber"), "ID number")}
FORMATS = ("csv", "canvas", "moodle")


def csv_cell(value: Any) -> Any:
    """A cell that a spreadsheet shows as text: a string starting like a formula gets a leading '."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


@dataclass
class LabGrade:
    """One student's result in one lab, as the grader wrote it."""

    score: float
    max_score: float
    percent: float
    status: str


@dataclass
class CourseGrades:
    """Every graded lab of the course: `labs` in order, `grades[student][lab]` where the student has a result."""

    labs: list[str]
    grades: dict[str, dict[str, LabGrade]] = field(default_factory=dict)

    def points_possible(self, lab: str) -> float:
        """The lab's maximum score (the largest any result of it states; 0 when none states one)."""
        return max((g[lab].max_score for g in self.grades.values() if lab in g), default=0.0)


@dataclass
class Export:
    """What `lms_rows` made: the rows to write, and the students left out with why."""

    rows: list[list[Any]]
    not_in_roster: list[str] = field(default_factory=list)
    not_exported: list[str] = field(default_factory=list)
    """`student lab: why` for a result written as a blank cell (the grader failed on it: regrade it)."""


def read_lms_roster(path: str | os.PathLike, login_column: str = "login") -> dict[str, dict[str, str]]:
    """{hub login: {column: value}} from the instructor's LMS roster CSV (header row; see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # an LMS export saved by Excel starts with a BOM
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "it is not UTF-8 text"
        raise GradingError(f"--roster {path}: cannot read it ({why}); give a CSV with a header row, a "
                           f"{login_column!r} column of hub login names and the LMS's identity columns") from None
    reader = csv.reader(io.StringIO(text, newline=""))  # a quoted cell may hold a line break
    header = [h.strip() for h in next(reader, [])]
    if login_column not in header:
        raise GradingError(f"--roster {path}: no {login_column!r} column in the header {header[:12]}; add a column "
                           f"{login_column!r} with each student's hub login name, or name the column that holds "
                           "them with --login-column")
    roster: dict[str, dict[str, str]] = {}
    for number, row in enumerate(reader, start=2):
        if not any(cell.strip() for cell in row) or row[0].strip() == "Points Possible":
            continue  # a blank line, or the Points Possible row of a Canvas export used as the roster
        entry = {h: (row[i].strip() if i < len(row) else "") for i, h in enumerate(header) if h}
        login = entry[login_column]
        if not login:
            raise GradingError(f"--roster {path}, line {number}: the {login_column!r} cell is empty; give the "
                               "student's hub login name or delete the line")
        if login in roster:
            raise GradingError(f"--roster {path}, line {number}: {login!r} is listed twice; keep one line")
        for column, value in entry.items():
            if _identifier(column, login_column) and value.startswith(FORMULA_START):
                raise GradingError(f"--roster {path}, line {number}: {column} {value[:40]!r} starts like a "
                                   "spreadsheet formula (= + - @); no LMS issues such an identifier: fix the roster")
        roster[login] = entry
    return roster


def _identifier(column: str, login_column: str) -> bool:
    """Whether the roster's `column` identifies a student (the other columns of an LMS export are not read)."""
    return (column in (login_column, *CANVAS_MATCH)
            or column.lower() in {a for aliases, _ in MOODLE_IDS.values() for a in aliases})


def lms_rows(fmt: str, course: CourseGrades, roster: dict[str, dict[str, str]], *, moodle_id: str = "email",
             canvas_ids: dict[str, str] | None = None, allow_missing: bool = False) -> Export:
    """The rows of the `fmt` ("canvas" or "moodle") import file for `course`, students mapped through `roster`.

    A graded student missing from the roster is an error naming them, unless `allow_missing` (then they are left
    out and listed in `not_in_roster`). A lab a student has no result in is a blank cell (the LMS changes
    nothing), and so is a result the grader failed on (listed in `not_exported`)."""
    if fmt not in ("canvas", "moodle"):
        raise GradingError(f"--format {fmt!r}: an LMS export is canvas or moodle")
    missing = sorted(s for s in course.grades if s not in roster)
    if missing and not allow_missing:
        raise GradingError(f"{len(missing)} graded student(s) not in the roster: {', '.join(missing[:20])}; add a "
                           "line for each (their hub login name and LMS identity), or pass --allow-missing to "
                           "leave them out of the file")
    export = Export([], not_in_roster=missing)
    students = sorted(s for s in course.grades if s in roster)
    if fmt == "canvas":
        _canvas(export, course, roster, students, canvas_ids or {})
    else:
        _moodle(export, course, roster, students, moodle_id)
    return export


def _canvas(export: Export, course: CourseGrades, roster, students, canvas_ids: dict[str, str]) -> None:
    unknown = sorted(set(canvas_ids) - set(course.labs))
    if unknown:
        raise GradingError(f"--canvas-assignment {unknown[0]}=...: no graded lab of that name (graded: "
                           f"{', '.join(course.labs)})")
    for lab, number in canvas_ids.items():
        if not number.isdigit():
            raise GradingError(f"--canvas-assignment {lab}={number}: a Canvas assignment id is a number (the "
                               "one in the assignment's address, .../assignments/<id>)")
    head = [*CANVAS_IDENTITY, *(f"{lab} ({canvas_ids[lab]})" if lab in canvas_ids else lab for lab in course.labs)]
    possible = [course.points_possible(lab) for lab in course.labs]
    export.rows += [head, ["Points Possible", "", "", "", "", *(_number(p) for p in possible)]]
    for student in students:
        who = roster[student]
        if not any(who.get(c) for c in CANVAS_MATCH):
            raise GradingError(f"roster: {student!r} has none of {', '.join(CANVAS_MATCH)}; Canvas matches a "
                               "student by one of them: copy them from a Canvas gradebook export")
        row = [who.get("Student") or student, *(who.get(c, "") for c in CANVAS_IDENTITY[1:])]
        for lab, points in zip(course.labs, possible):
            g = _exportable(export, course, student, lab)
            row.append("" if g is None else _number(g.score * points / g.max_score if g.max_score else 0.0))
        export.rows.append(row)


def _moodle(export: Export, course: CourseGrades, roster, students, moodle_id: str) -> None:
    if moodle_id not in MOODLE_IDS:
        raise GradingError(f"--moodle-id {moodle_id!r}: one of {', '.join(MOODLE_IDS)}")
    aliases, header = MOODLE_IDS[moodle_id]
    export.rows.append([header, *course.labs])
    for student in students:
        who = {k.lower(): v for k, v in roster[student].items()}
        ident = next((who[a] for a in aliases if who.get(a)), "")
        if not ident:
            raise GradingError(f"roster: {student!r} has no {moodle_id} (a column {' / '.join(aliases)}); Moodle "
                               f"identifies the student by it: fill it in, or pick another with --moodle-id")
        row: list[Any] = [ident]
        for lab in course.labs:
            g = _exportable(export, course, student, lab)
            row.append("" if g is None else _number(g.percent))
        export.rows.append(row)


def _exportable(export: Export, course: CourseGrades, student: str, lab: str) -> LabGrade | None:
    g = course.grades[student].get(lab)
    if g is not None and g.status == "grader_error":
        export.not_exported.append(f"{student} {lab}: the grader failed on it (not the student's fault): regrade it")
        return None
    return g


def _number(x: float) -> str:
    """A grade as the LMS reads it: a plain decimal, at most 2 places, no exponent, no thousands separator."""
    x = round(float(x), 2)
    return str(int(x)) if x == int(x) else f"{x:.2f}".rstrip("0")


def write_rows(path: Path, rows: list[list[Any]]) -> Path:
    """Write `rows` as CSV to `path`, owner-only (every student's grades), every cell neutralised."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    private = lambda p, flags: os.open(p, flags, 0o600)  # noqa: E731
    with open(tmp, "w", newline="", encoding="utf-8", errors="replace", opener=private) as f:
        os.chmod(f.fileno(), 0o600)  # a stale .tmp kept its old mode through O_CREAT
        w = csv.writer(f)
        for row in rows:
            w.writerow([csv_cell(x) for x in row])
    tmp.replace(path)
    return path


__all__ = ["FORMATS", "FORMULA_START", "CANVAS_IDENTITY", "MOODLE_IDS", "csv_cell", "LabGrade", "CourseGrades",
           "Export", "read_lms_roster", "lms_rows", "write_rows"]
