"""Grading reports: a JSON result and an HTML feedback page per student, and the CSV gradebook.

    OUT/results/<student>.json     the result (safe to hand to the student); <student> is `file_key(name)`
    OUT/feedback/<student>.html    the same for people: score, what happened to the run, each check
    OUT/notebooks/<student>.ipynb  the executed notebook, long outputs cut
    OUT/gradebook.csv              one row per student graded into OUT (all results/*.json, not only this batch)
    OUT/instructor/                runner logs, tracebacks of hidden checks that crashed: not for students
    OUT/instructor/records/<student>.json  the values the checks ran on (the notebook's records and the grader's
                                   evidence from the run's event files): why a check said what it said

What a student reads (the feedback page, the checks in results/*.json) shows each check's name, outcome, points and
message, never its code. Threat: a hidden check's text reaching the student tells them its rule or its data; a
path tells them the grader's layout. So (`public_message`):
- a hidden check that crashed shows only the type of the error; its message and traceback go to
  instructor/hidden_check_errors.jsonl (an exception's text can quote anything: a source line, a file's path, a
  value the check compares with);
- a hidden check's message that carries code (a traceback, `File "..."`, def/class/import lines, a decorator: a
  check that raised with `inspect.getsource`) is replaced by the public text of a hidden check; logged the same;
- absolute paths in any message, in the run's traceback and in the notes are cut to their last part (`…/name`).
Not protected: what a hidden check's author writes into a message on purpose (a threshold in plain words), and
values the student's notebook recorded (the student's own). Everything shown is HTML-escaped.
"""
from __future__ import annotations

import csv
import hashlib
import html
import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from ..course.gradebook import CourseGrades, LabGrade, csv_cell, lms_rows, read_lms_roster, write_rows
from .checks import CheckResult

_LOCK = threading.Lock()
OUTCOME_LABEL = {"pass": "passed", "partial": "partly", "fail": "failed", "missing": "missing", "error": "error"}
#: Colour of each outcome, inline (a widget's HTML or a feedback page: no stylesheet needed).
OUTCOME_COLOUR = {"pass": "#176b2c", "partial": "#8a5a00", "fail": "#a11", "missing": "#6b4fa1", "error": "#a11"}
OUTCOME_MARK = {"pass": "✔", "partial": "◐", "fail": "✘", "missing": "?", "error": "!"}
_CSS = """body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.35rem .5rem;text-align:left;
vertical-align:top}.pass{color:#176b2c}.partial{color:#8a5a00}.fail,.missing,.error{color:#a11}
.status{padding:.6rem .8rem;border-radius:6px;background:#f4f4f4}pre{background:#f7f7f7;padding:.6rem;
overflow:auto;max-height:24rem;font-size:13px}.hidden{font-size:12px;color:#666}"""


_KEY_MAX = 60


def file_key(student: str) -> str:
    """The name of a student's report files: `student` itself when it is short plain ASCII, else an ASCII form of
    it with a hash of the whole name (so any length and any script gives a distinct, valid file name)."""
    slug = re.sub(r"[^A-Za-z0-9_.@-]", "_", student).lstrip(".-") or "student"
    if slug == student and len(slug) <= _KEY_MAX:
        return slug
    return f"{slug[:_KEY_MAX]}-{hashlib.sha256(student.encode()).hexdigest()[:10]}"


def prepare_out_dir(out: Path, private: bool = False) -> None:
    """Create the report folders; `private` (grading as root): only the owner may enter OUT."""
    for sub in ("results", "feedback", "notebooks", "instructor/logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    if private:
        out.chmod(0o700)


#: What a student reads of a hidden check whose message is withheld (the grader's own text for a bare assert).
HIDDEN_PUBLIC_TEXT = "not met (a hidden check: its rule is not shown)"
_MESSAGE_MAX = 1000
_CODE = re.compile(r'Traceback \(most recent call last\)|\bFile "[^"\n]*", line \d+'
                   r'|^\s*(?:async\s+)?def\s+\w+\s*\(|^\s*class\s+\w+\s*[:(]|^\s*@\w[\w.]*\s*(?:\(|$)'
                   r'|^\s*import\s+[\w.]+\s*(?:,|\bas\b|$)|^\s*from\s+[.\w]+\s+import\s+\w', re.M)
# An absolute path: a / not inside a word, a URL or a relative path, then at least two parts.
_ABS_PATH = re.compile(r'(?<![\w.~/-])/(?:[^\s/\'"`<>:,;()\[\]{}|]+/)+([^\s/\'"`<>:,;()\[\]{}|]*)')


def redact_paths(text: str) -> str:
    """`text` with each absolute path cut to its last part (`/srv/labs/x/hidden_checks.py`: `…/hidden_checks.py`)."""
    return _ABS_PATH.sub(lambda m: "…/" + m.group(1), text)


def public_message(c: dict) -> str:
    """What the student may read of check result `c` (a `CheckResult.to_dict()`): see the module docstring."""
    msg = str(c.get("message") or "")
    if c.get("hidden"):
        if c.get("outcome") == "error":
            kind = re.match(r"check raised (\w+)", msg)
            return (f"check raised {kind.group(1) if kind else 'an error'} (a hidden check: what it said went to "
                    "the instructors)")
        if _CODE.search(msg):
            return HIDDEN_PUBLIC_TEXT
    msg = redact_paths(msg)
    return msg if len(msg) <= _MESSAGE_MAX else msg[:_MESSAGE_MAX] + " …"


def check_to_dict(c: CheckResult) -> dict:
    """A check result as shown to the student: `public_message`; no crash traceback for hidden checks, the paths cut
    out of a public one's."""
    d = c.to_dict()
    d["message"] = public_message(d)
    d["detail"] = "" if c.hidden else redact_paths(d.get("detail") or "")
    d["duration_s"] = round(d.get("duration_s", 0.0), 4)
    return d


def result_to_dict(result) -> dict:
    """A SubmissionResult as JSON data (what results/<student>.json holds)."""
    return {"student": result.student, "lab": result.lab, "submission": result.submission,
            "status": result.status, "message": result.message, "score": result.score,
            "max_score": result.max_score, "percent": result.percent,
            "checks": [check_to_dict(c) for c in result.checks], "execution": result.execution,
            "notes": result.notes, "sandbox": result.sandbox, "duration_s": result.duration_s,
            "notebook": result.notebook, "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **({"standing": result.standing} if getattr(result, "standing", None) is not None else {})}


def write_submission(out: Path, result) -> dict:
    """Write results/<student>.json and feedback/<student>.html; log hidden checks' crashes for instructors."""
    data = result_to_dict(result)
    key = file_key(result.student)
    _atomic_write(out / "results" / f"{key}.json", json.dumps(data, indent=1, ensure_ascii=False, default=str))
    _atomic_write(out / "feedback" / f"{key}.html", feedback_html(data))
    withheld = [c for c, shown in zip(result.checks, data["checks"])
                if c.hidden and (c.detail or shown["message"] != (c.message or ""))]
    if withheld:  # what a hidden check said that the student does not see: for instructors
        with _LOCK, open(out / "instructor" / "hidden_check_errors.jsonl", "a", encoding="utf-8") as f:
            for c in withheld:
                f.write(json.dumps({"student": result.student, "check": c.name, "outcome": c.outcome,
                                    "message": c.message, "traceback": c.detail}, ensure_ascii=False) + "\n")
    return data


def write_records(out: Path, student: str, records: dict) -> Path:
    """instructor/records/<student>.json: the values `student`'s checks ran on (records and evidence), for an
    instructor asked why a check failed, and for checks re-run later without running the notebook again."""
    path = Path(out) / "instructor" / "records" / f"{file_key(student)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(records, ensure_ascii=False, default=str))
    return path


def read_records_file(out: Path, student: str) -> dict:
    """What `write_records` wrote for `student` in the batch folder `out`."""
    return json.loads((Path(out) / "instructor" / "records" / f"{file_key(student)}.json").read_text(encoding="utf-8"))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8", errors="replace")  # a lone surrogate from a run's JSON becomes "?"
    tmp.replace(path)


def load_results(out: Path) -> list[dict]:
    """Every results/*.json in `out`, sorted by student."""
    found = []
    for path in sorted((Path(out) / "results").glob("*.json")):
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except ValueError:
            continue
    return sorted(found, key=lambda d: d.get("student", ""))


def write_gradebook(out: Path) -> Path:
    """gradebook.csv from every result in `out`: student, percent, score, status, then points per check."""
    results = load_results(out)
    names: list[str] = []
    for r in results:
        for c in r.get("checks", []):
            label = c["name"] + (" (hidden)" if c.get("hidden") else "")
            if label not in names:
                names.append(label)
    path = Path(out) / "gradebook.csv"
    with _LOCK, open(path.with_suffix(".csv.tmp"), "w", newline="", encoding="utf-8", errors="replace") as f:
        w = csv.writer(f)
        w.writerow([csv_cell(x) for x in ["student", "percent", "score", "max_score", "status", "message", *names]])
        for r in results:
            points = {c["name"] + (" (hidden)" if c.get("hidden") else ""): c["points"] for c in r.get("checks", [])}
            w.writerow([csv_cell(x) for x in [r["student"], r["percent"], r["score"], r["max_score"], r["status"],
                                              r["message"][:300], *[points.get(n, "") for n in names]]])
    path.with_suffix(".csv.tmp").replace(path)
    return path


def course_grades(grades_root: Path) -> CourseGrades:
    """Every `<grades_root>/<lab>/results/*.json`: the labs in name order and each student's result in each."""
    grades_root = Path(grades_root)
    labs = sorted(d for d in grades_root.iterdir() if (d / "results").is_dir()) if grades_root.is_dir() else []
    if not labs:
        raise FileNotFoundError(f"no graded labs under {grades_root} (expected <lab>/results/*.json from "
                                "`scalelab grade --out`)")
    course = CourseGrades([lab.name for lab in labs])
    for lab in labs:
        for r in load_results(lab):
            course.grades.setdefault(str(r.get("student", "")), {})[lab.name] = LabGrade(
                float(r.get("score", 0.0)), float(r.get("max_score", 0.0)), float(r.get("percent", 0.0)),
                str(r.get("status", "")))
    return course


def course_gradebook(grades_root: Path, out_csv: Path | None = None, late: dict[str, set[str]] | None = None) -> Path:
    """One CSV for the whole course from every `<grades_root>/<lab>/results/*.json`: a row per student, for each lab
    its percent and status (and `late` when the lab's collection said so), then the average over the labs.

    Columns: `Student`, `<lab> (%)`, `<lab> status`, `<lab> late` per lab, `Average (%)`; cells neutralised like the
    lab gradebooks. A student without a result for a lab gets an empty cell (and counts 0 in the average). For an
    LMS's own import format, see `lms_gradebook`."""
    course = course_grades(grades_root)
    late = late or {}
    head = ["Student"]
    for lab in course.labs:
        head += [f"{lab} (%)", f"{lab} status", f"{lab} late"]
    rows: list[list[Any]] = [[*head, "Average (%)"]]
    for student in sorted(course.grades):
        row, total = [student], 0.0
        for lab in course.labs:
            g = course.grades[student].get(lab)
            total += g.percent if g else 0.0
            row += ["" if g is None else g.percent, g.status if g else "not graded",
                    "yes" if student in late.get(lab, set()) else ""]
        rows.append([*row, round(total / len(course.labs), 2)])
    with _LOCK:
        return write_rows(Path(out_csv or Path(grades_root) / "course_gradebook.csv"), rows)


def lms_gradebook(grades_root: Path, fmt: str, roster: Path, out_csv: Path | None = None, *,
                  login_column: str = "login", moodle_id: str = "email", canvas_ids: dict[str, str] | None = None,
                  allow_missing: bool = False):
    """The course gradebook in Canvas's or Moodle's grade import format (`course.gradebook` says which columns),
    students mapped to their LMS identities through the instructor's `roster` CSV. Returns the file written and
    the `Export` (students left out, results not exported)."""
    course = course_grades(grades_root)
    export = lms_rows(fmt, course, read_lms_roster(roster, login_column), moodle_id=moodle_id,
                      canvas_ids=canvas_ids, allow_missing=allow_missing)
    with _LOCK:
        path = write_rows(Path(out_csv or Path(grades_root) / f"course_gradebook_{fmt}.csv"), export.rows)
    return path, export


def checks_table_html(checks: Iterable[Any]) -> str:
    """An HTML table of check results (CheckResult or their dicts): name, outcome, points, message."""
    rows = []
    for c in checks:
        c = c if isinstance(c, dict) else check_to_dict(c)
        e = html.escape
        tag = ' <span class="hidden">(hidden check)</span>' if c.get("hidden") else ""
        colour = OUTCOME_COLOUR.get(c["outcome"], "#222")
        rows.append(f'<tr><td>{e(c["name"])}{tag}</td><td class="{e(c["outcome"])}" '
                    f'style="color:{colour};font-weight:600">{OUTCOME_MARK.get(c["outcome"], "")} '
                    f'{e(OUTCOME_LABEL.get(c["outcome"], c["outcome"]))}</td>'
                    f'<td>{c["points"]:g} / {c["max_points"]:g}</td><td>{e(public_message(c))}</td></tr>')
    return ("<table><thead><tr><th>check</th><th>result</th><th>points</th><th>message</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def feedback_html(data: dict) -> str:
    """The feedback page of one result (as `result_to_dict` makes it)."""
    e = html.escape
    ex = data.get("execution", {})
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(data['lab'])}: {e(data['student'])}"
             f"</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(data['lab'])}</h1><p>Feedback for <b>{e(data['student'])}</b> "
             f"({e(data['submission'])})</p>",
             f"<h2>Score: {data['score']:g} / {data['max_score']:g} ({data['percent']:g} %)</h2>",
             f"<p class='status'><b>Run:</b> {e(data['status'].replace('_', ' '))} — "
             f"{e(redact_paths(data['message']))}</p>",
             "<h2>Checks</h2>", checks_table_html(data["checks"])]
    if ex.get("traceback"):
        parts += ["<h2>Where the run stopped</h2>", f"<pre>{e(redact_paths(ex['traceback']))}</pre>"]
    if data.get("notes"):
        parts += ["<h2>Notes</h2><ul>", *[f"<li>{e(redact_paths(str(n)))}</li>" for n in data["notes"]], "</ul>"]
    parts.append("<p class='hidden'>Output on stderr never costs points. Hidden checks show their name, result and "
                 "message only.</p></body></html>")
    return "\n".join(parts)


__all__ = ["file_key", "csv_cell", "course_grades", "course_gradebook", "lms_gradebook", "prepare_out_dir",
           "write_submission", "write_gradebook",
           "write_records", "read_records_file", "load_results", "result_to_dict",
           "check_to_dict", "public_message", "redact_paths", "HIDDEN_PUBLIC_TEXT", "checks_table_html",
           "feedback_html"]
