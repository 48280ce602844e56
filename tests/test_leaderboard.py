"""The capstone's class leaderboard, without a hub: the board's order from the grader's results files (written as the
grader writes them), pseudonyms, what a student may see of it, the pseudonyms' secret, escaping of hostile names, the
site's page and the `scalelab site build --leaderboard` option. The dashboard's pages on a real hub:
tests/test_hub_dashboard.py; in a browser: tests/test_hub_browser.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scalelab.course import site as sb
from scalelab.grade.grader import SubmissionResult
from scalelab.grade.leaderboard import pseudonym, standings
from scalelab.grade.report import prepare_out_dir, write_submission
from scalelab.hub.capstone import leaderboard, public_rows, pseudonym_key, render_board
from scalelab.hub.settings import SettingsError, load_settings

HOSTILE = "<script>alert('x')</script>`"
KEY = b"k" * 32


def standing(ranked=True, t=None, acc=0.9, rank_s=400.0, why="", lost=None, **choices) -> dict:
    """A standing as the capstone's hidden checks give it (grade/leaderboard.py's fields)."""
    return {"ranked": ranked, "why": why, "time_to_target_s": t, "accuracy": acc, "target": 0.85,
            "rank_seconds": rank_s, "budget_rank_s": 1200.0, "lost_s": lost,
            "choices": choices or {"batch": 64, "optimizer": "sgd"}}


def graded(out: Path, students: dict[str, dict | None]) -> Path:
    """A graded lab folder: one results file per student, written by the grader's own report.write_submission."""
    prepare_out_dir(out)
    for name, s in students.items():
        write_submission(out, SubmissionResult(student=name, lab="12_capstone", submission=f"/homes/{name}",
                                               status="graded", message="", score=5, max_score=10, standing=s))
    return out


@pytest.fixture
def lab_out(tmp_path):
    return graded(tmp_path / "grades" / "12_capstone", {
        "ann": standing(t=120.0, lost=14.5),
        "ben": standing(t=80.0, rank_s=900.0),
        "cat": standing(t=80.0, rank_s=500.0),           # ties ben on time, fewer rank-seconds: ahead
        "dan": standing(t=None, acc=0.81),               # ranked, never reached the target
        "eve": standing(t=None, acc=0.84),
        "fay": standing(ranked=False, t=30.0, why="fay's checkpoints were not re-evaluated: events forged"),
        HOSTILE: standing(t=200.0, optimizer="<img src=x onerror=alert(1)>"),
        "gus": None,                                     # graded, no standing (a lab without a board): not listed
    })


def test_standings_order_reached_by_time_then_not_reached_by_accuracy_then_unranked(lab_out):
    rows = standings(lab_out)
    assert [r["student"] for r in rows] == ["cat", "ben", "ann", HOSTILE, "eve", "dan", "fay"]
    assert [r["place"] for r in rows] == [1, 2, 3, 4, None, None, None]
    assert rows[2]["lost_s"] == 14.5 and rows[-1]["why"].endswith("events forged")


def test_a_pseudonym_is_stable_for_a_key_and_changes_with_it():
    assert pseudonym("ann", KEY) == pseudonym("ann", KEY)
    assert pseudonym("ann", KEY) != pseudonym("ann", b"another key" * 3)
    names = {pseudonym(f"student{i}", KEY) for i in range(200)}
    assert len(names) == 200, "two students of a class of 200 share a pseudonym"
    assert "ann" not in pseudonym("ann", KEY)


def test_a_students_view_names_nobody_marks_their_row_and_hides_the_others_reasons(lab_out):
    rows = public_rows(standings(lab_out), KEY, viewer="fay")
    dumped = json.dumps(rows)
    for name in ("ann", "ben", "cat", "dan", "eve"):
        assert json.dumps(name) not in dumped, name
    assert "alert('x')" not in dumped  # the hostile name (its choice, alert(1), is a choice, shown escaped)
    mine = [r for r in rows if r["you"]]
    assert len(mine) == 1 and mine[0]["student"] == pseudonym("fay", KEY) and "forged" in mine[0]["why"]
    others = public_rows(standings(lab_out), KEY, viewer="ann")
    assert next(r for r in others if r["student"] == pseudonym("fay", KEY))["why"] == "not ranked"
    assert "graded_at" not in rows[0]


def test_the_board_for_each_role(lab_out, tmp_path):
    cfg = load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state")},
                                   "dashboard": {"grades": str(lab_out.parent)}})
    everyone = leaderboard(cfg, "instructor")
    assert len(everyone["rows"]) == 7 and everyone["rows"][0]["student"] == "cat"
    ta = leaderboard(cfg, "ta", "tom", students={"ann", "dan"})  # the course's students only
    assert [r["student"] for r in ta["rows"]] == ["ann", "dan"]
    student = leaderboard(cfg, "student", "dan", students={"ann", "dan"}, key=KEY)
    assert [r["student"] for r in student["rows"]] == [pseudonym("ann", KEY), pseudonym("dan", KEY)]
    assert [r["you"] for r in student["rows"]] == [False, True]
    cfg["dashboard"]["grades"] = ""
    assert leaderboard(cfg, "instructor")["rows"] == [] and "dashboard.grades" in leaderboard(cfg, "instructor")["note"]


def test_a_hostile_student_name_and_choice_are_escaped_on_the_page(lab_out, tmp_path):
    cfg = load_settings(overrides={"hub": {"state_dir": str(tmp_path / "state")},
                                   "dashboard": {"grades": str(lab_out.parent)}})
    page = render_board(leaderboard(cfg, "instructor"), inject_form="<input type='hidden' name='_xsrf' value='t'>")
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&#96;" in page
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "id='inject'" in page and "value='kill'" in page and "value='preempt'" in page
    assert "id='inject'" not in render_board(leaderboard(cfg, "ta", students={"ann"}))


def test_the_pseudonyms_secret_is_made_private_and_a_readable_or_linked_one_is_refused(tmp_path):
    path = tmp_path / "key"
    key = pseudonym_key(path)
    assert len(key) >= 32 and pseudonym_key(path) == key and (path.stat().st_mode & 0o777) == 0o600
    path.chmod(0o644)  # others could read it: they could name every pseudonym
    with pytest.raises(SettingsError, match="chmod 600"):
        pseudonym_key(path)
    path.chmod(0o600)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(SettingsError, match="link"):
        pseudonym_key(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(SettingsError, match="not a regular file"):
        pseudonym_key(tmp_path / "fifo")


def test_the_site_page_shows_the_board_under_pseudonyms_and_only_when_asked(lab_out, tmp_path):
    rows = public_rows(standings(lab_out), KEY)
    src = sb.stage(sb.SITE_SRC, tmp_path / "stage", [], leaderboard={"lab": "12_capstone", "rows": rows})
    page = (src / "leaderboard.md").read_text()
    assert page.startswith("---\norphan: true\n---") and "```{raw} html\n<table id='leaderboard'>" in page
    assert page.count("```") == 2, "a student's backtick must not end the raw block"
    assert pseudonym("cat", KEY) in page and "cat" not in page.replace(pseudonym("cat", KEY), "")
    assert "<script>" not in page and "forged" not in page  # an unranked row's reason is its student's
    assert "(../leaderboard.md)" in (src / "labs" / "index.md").read_text()
    sb.stage(sb.SITE_SRC, tmp_path / "stage", [])  # without the option: no page, no link
    assert not (src / "leaderboard.md").exists() and "leaderboard" not in (src / "labs" / "index.md").read_text()


def test_cli_site_build_leaderboard_passes_pseudonymised_rows(monkeypatch, lab_out, tmp_path, capsys):
    from scalelab.cli import main
    seen = {}

    def fake_build(**kwargs):
        seen.update(kwargs)
        return sb.SiteReport(tmp_path / "html", [], 1.0)

    monkeypatch.setattr(sb, "build_site", fake_build)
    key_file = tmp_path / "key"
    key = pseudonym_key(key_file)
    assert main(["site", "build", "--leaderboard", str(lab_out), "--pseudonym-key-file", str(key_file)]) == 0
    assert seen["leaderboard"]["lab"] == "12_capstone"
    assert [r["student"] for r in seen["leaderboard"]["rows"]][:2] == [pseudonym("cat", key), pseudonym("ben", key)]
    seen.clear()
    assert main(["site", "build"]) == 0 and "leaderboard" not in seen  # without the option nothing changes
    assert main(["site", "build", "--leaderboard", str(tmp_path), "--pseudonym-key-file", str(key_file)]) == 1
    assert "no results/ folder" in capsys.readouterr().err


@pytest.mark.slow
def test_the_site_page_builds_with_sphinx(lab_out, tmp_path):
    src = sb.stage(sb.SITE_SRC, tmp_path / "stage", [],
                   leaderboard={"lab": "12_capstone", "rows": public_rows(standings(lab_out), KEY)})
    sb.run_sphinx(src, tmp_path / "html", tmp_path / "doctrees")  # warnings are errors: an orphan page is fine
    page = (tmp_path / "html" / "leaderboard.html").read_text()
    assert "<table id='leaderboard'>" in page.replace('"', "'") and pseudonym("cat", KEY) in page
    assert "<script>alert" not in page
