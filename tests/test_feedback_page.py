"""feedback.html shows each check's message and points, never its code (issue 36, item 5).

Attack tests: hidden checks that try to put their own source, a traceback or the grader's paths in front of the
student (raising with `inspect.getsource`, asserting with `__file__`, crashing on a file of the lab's); the feedback
page and results/<student>.json show none of it, the hidden check's student message stays the public-safe text,
and the instructors' log keeps what was withheld. Checks are run by the real checks machinery from a real
hidden_checks.py, and once end to end by the real grader on the fixture lab.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scalelab.grade.checks import load_checks, run_checks
from scalelab.grade.grader import GradeOptions, SubmissionResult, grade
from scalelab.grade.report import HIDDEN_PUBLIC_TEXT, prepare_out_dir, write_submission

FIXTURE = Path(__file__).parent / "fixtures" / "grading"
SECRET = "SECRET-RULE-7c41"

ATTACKS = f'''
"""Hidden checks that try to show their code. {SECRET}"""
import inspect

from scalelab.grade.checks import check, partial

THRESHOLD = 0.8731  # {SECRET}


@check(points=1)
def raises_its_source(r):
    raise ValueError(inspect.getsource(raises_its_source))


@check(points=1)
def asserts_its_source(r):
    assert r["w"] > THRESHOLD, inspect.getsource(asserts_its_source)


@check(points=1)
def asserts_its_path(r):
    assert r["w"] > THRESHOLD, f"rule in {{__file__}}"


@check(points=1)
def crashes_on_a_graders_file(r):
    open(__file__ + ".data/{SECRET}.npz").read()


@check(points=1)
def partial_with_a_traceback(r):
    import traceback
    try:
        1 / 0
    except ZeroDivisionError:
        return partial(0.5, traceback.format_exc())


@check(points=1)
def bare_assert(r):
    assert r["w"] > THRESHOLD


@check(points=2)
def honest_message(r):
    assert r["w"] > THRESHOLD, f"w is {{r['w']:.3f}}: too small"
'''

PUBLIC = '''
from scalelab.grade.checks import check


@check(points=1)
def public_with_a_path(r):
    assert r["w"] > 5, f"w too small (checked by {__file__})"
'''


@pytest.fixture
def lab(tmp_path):
    lab = tmp_path / "srv-grader-labs" / "93_attack"
    lab.mkdir(parents=True)
    (lab / "hidden_checks.py").write_text(ATTACKS)
    (lab / "checks.py").write_text(PUBLIC)
    return lab


def _graded(tmp_path, lab, execution=None, notes=()):
    checks = load_checks(lab / "checks.py") + load_checks(lab / "hidden_checks.py", hidden=True)
    results = run_checks(checks, {"w": 0.5})
    out = tmp_path / "out"
    prepare_out_dir(out)
    (out / "instructor").mkdir(exist_ok=True)
    result = SubmissionResult("ann", lab.name, "ann.ipynb", "cell_error",
                              f"cell 4 raised OSError: cannot open {lab}/data/train.bin", 0.0, 9.0, results,
                              execution=execution or {}, notes=list(notes))
    data = write_submission(out, result)
    page = (out / "feedback" / "ann.html").read_text(encoding="utf-8")
    saved = (out / "results" / "ann.json").read_text(encoding="utf-8")
    return results, data, page, saved, out


def test_no_hidden_checks_code_path_or_traceback_reaches_the_student(tmp_path, lab):
    results, data, page, saved, _ = _graded(tmp_path, lab)
    raw = {c.name: c.message for c in results}
    # the attacks are real: without the report's filter these messages would carry code and paths
    assert "def raises_its_source" in raw["raises_its_source"] and "THRESHOLD" in raw["asserts_its_source"]
    assert str(lab) in raw["asserts_its_path"] and str(lab) in raw["crashes_on_a_graders_file"]
    assert "Traceback (most recent call last)" in raw["partial_with_a_traceback"]
    checks_saved = json.dumps(json.loads(saved)["checks"], ensure_ascii=False)
    for text in (page, checks_saved):
        for leak in ("def raises_its_source", "inspect.getsource", "THRESHOLD", SECRET, "Traceback (most recent",
                     "ZeroDivisionError", str(lab), str(tmp_path), "srv-grader-labs", 'File "'):
            assert leak not in text, leak


def test_each_check_still_shows_its_name_points_and_a_message(tmp_path, lab):
    _, data, page, _, _ = _graded(tmp_path, lab)
    shown = {c["name"]: c for c in data["checks"]}
    assert shown["raises_its_source"]["message"].startswith("check raised ValueError (a hidden check")
    assert shown["crashes_on_a_graders_file"]["message"].startswith("check raised FileNotFoundError (a hidden check")
    for name in ("asserts_its_source", "partial_with_a_traceback", "bare_assert"):
        assert shown[name]["message"] == HIDDEN_PUBLIC_TEXT, name  # the public-safe text, whatever it carried
    assert shown["partial_with_a_traceback"]["points"] == 0.5  # its points stand; only its text is withheld
    assert shown["asserts_its_path"]["message"] == "rule in …/hidden_checks.py"  # the message, its path cut
    assert shown["honest_message"]["message"] == "w is 0.500: too small"  # a check's own words are shown
    assert shown["public_with_a_path"]["message"] == "w too small (checked by …/checks.py)"
    assert all(c["detail"] == "" for c in data["checks"] if c["hidden"])
    for name in shown:
        assert name in page
    assert "<td>0.5 / 1</td>" in page and "<td>0 / 2</td>" in page and "w is 0.500: too small" in page


def test_what_was_withheld_goes_to_the_instructors(tmp_path, lab):
    _, _, _, _, out = _graded(tmp_path, lab)
    logged = [json.loads(line) for line in (out / "instructor" / "hidden_check_errors.jsonl").read_text().splitlines()]
    by_check = {entry["check"]: entry for entry in logged}
    assert set(by_check) == {"raises_its_source", "asserts_its_source", "asserts_its_path",
                             "crashes_on_a_graders_file", "partial_with_a_traceback"}  # not the honest ones
    assert "def raises_its_source" in by_check["raises_its_source"]["message"]
    assert "raise ValueError" in by_check["raises_its_source"]["traceback"]
    assert str(lab) in by_check["crashes_on_a_graders_file"]["message"]


def test_the_runs_traceback_message_and_notes_lose_the_graders_paths(tmp_path, lab):
    tb = ("Traceback (most recent call last):\n  Cell In[4], line 2\n    x = load()\n"
          "  File /opt/grader/venv/lib/python3.11/site-packages/torch/serialization.py:998, in load(f)\n"
          "OSError: cannot open /var/tmp/scalelab-job-ann-12ab/data/train.bin")
    _, _, page, _, _ = _graded(tmp_path, lab, execution={"traceback": tb},
                               notes=["the job folder /var/tmp/scalelab-job-ann-12ab/ was removed"])
    assert "Cell In[4], line 2" in page and "…/serialization.py:998" in page and "…/train.bin" in page
    for leak in ("/opt/grader", "site-packages", "/var/tmp", "scalelab-job-ann", str(lab)):
        assert leak not in page, leak


def test_the_real_grader_keeps_a_hidden_checks_source_out_of_the_feedback(tmp_path):
    lab = tmp_path / "90_fixture"
    shutil.copytree(FIXTURE / "labs" / "90_fixture", lab)
    with open(lab / "hidden_checks.py", "a") as f:
        f.write("\n\nimport inspect\n\n\n@check(points=1)\ndef leaks_source(r):\n"
                "    raise RuntimeError(inspect.getsource(leaks_source) + __file__)\n")
    batch = grade(lab, [FIXTURE / "submissions" / "correct.ipynb"], tmp_path / "out", GradeOptions(jobs=1))
    (result,) = batch.results
    assert result.status == "ok", result.message
    leaked = {c.name: c for c in result.checks}["leaks_source"]
    assert leaked.outcome == "error" and "def leaks_source" in leaked.message  # the attack reached the grader
    page = (tmp_path / "out" / "feedback" / "correct.html").read_text(encoding="utf-8")
    saved = json.loads((tmp_path / "out" / "results" / "correct.json").read_text(encoding="utf-8"))
    for text in (page, json.dumps(saved["checks"], ensure_ascii=False)):
        assert "def leaks_source" not in text and "SECRET-HIDDEN-CHECK-MARKER" not in text and str(lab) not in text
    assert "check raised RuntimeError (a hidden check" in page and "loss_matches_the_run" in page
    assert [c.name for c in result.checks if c.outcome == "error"] == ["leaks_source"]  # the others ran as always


@pytest.mark.parametrize("message,shown", [
    ("raise the learning rate: the loss did not fall", True),   # plain words that start like a keyword
    ("import the data before timing it", True),
    ("@rank 0 the loss diverged", True),
    ("@check(points=1)\ndef rule(r):\n    assert r['w'] > 0.8731", False),
    ('"""Hidden checks."""\nimport math\n\nLIMIT = 0.8731', False),  # a whole file read into the message
    ("class Rule:\n    limit = 0.8731", False),
    ('  File "/srv/labs/01/hidden_checks.py", line 9, in rule', False),
])
def test_a_hidden_message_is_withheld_only_when_it_carries_code(message, shown):
    from scalelab.grade.report import public_message
    got = public_message({"hidden": True, "outcome": "fail", "message": message})
    assert (got == message) is shown and (got == HIDDEN_PUBLIC_TEXT) is not shown, got
