"""The check contract labs and the grader share: outcomes, partial credit, missing records, isolation."""
from __future__ import annotations

from scalelab.grade.checks import lab_checks, load_checks, run_checks

CHECKS = '''
from scalelab.grade.checks import check, partial

@check(points=2)
def passes(r):
    """Always fine."""
    assert r["x"] == 1

@check()
def fails(r):
    """x must be 2."""
    assert r["x"] == 2, f"x is {r['x']}, expected 2"

@check(points=4)
def half(r):
    return partial(0.5, "half way")

@check()
def missing(r):
    return r["never_recorded"]

@check()
def crashes(r):
    return 1 / 0
'''


def test_each_outcome_and_its_points(tmp_path):
    path = tmp_path / "checks.py"
    path.write_text(CHECKS)
    results = {c.name: c for c in run_checks(load_checks(path), {"x": 1})}
    assert [(results[n].outcome, results[n].points) for n in ("passes", "fails", "half", "missing", "crashes")] == \
        [("pass", 2.0), ("fail", 0.0), ("partial", 2.0), ("missing", 0.0), ("error", 0.0)]
    assert results["fails"].message == "x is 1, expected 2"
    assert "never_recorded" in results["missing"].message
    assert "ZeroDivisionError" in results["crashes"].message


def test_hidden_checks_are_marked_and_loaded_fresh(tmp_path):
    (tmp_path / "checks.py").write_text(CHECKS)
    (tmp_path / "hidden_checks.py").write_text(CHECKS.replace("def passes", "def secret"))
    checks = lab_checks(tmp_path)
    assert len(checks) == 10 and sum(c.hidden for c in checks) == 5
    assert [c.name for c in lab_checks(tmp_path, include_hidden=False)] == ["passes", "fails", "half", "missing",
                                                                            "crashes"]
