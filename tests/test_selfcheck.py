"""SelfCheck: the lab's public checks on the kernel's own records; never the hidden ones."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from scalelab.run.events import EventWriter
from scalelab.course.execute import execute_notebook
from scalelab.course.lab import GradingError
from scalelab.grade.selfcheck import self_check
from scalelab.record import clear_recorded, record, recorded
from scalelab.widgets import SelfCheck

LAB = Path(__file__).parent / "fixtures" / "grading" / "labs" / "90_fixture"
GOOD = {"n": 500, "seed": 0, "final_loss": 1e-12}


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.delenv("SCALELAB_RECORD_FILE", raising=False)
    clear_recorded()
    yield
    clear_recorded()


def _mean(n=500, seed=0):
    import random
    rng = random.Random(seed)
    data = [rng.gauss(3.0, 1.0) for _ in range(n)]
    return sum(data) / len(data)


def test_recorded_holds_what_the_grader_would_read_back():
    value = {"k": (1, 2)}
    record("a", value)
    record("x", float("inf"))
    record("x", 2)
    value["k"] = "changed later"
    assert recorded() == {"a": {"k": [1, 2]}, "x": 2}
    clear_recorded()
    assert recorded() == {}


def test_self_check_runs_only_the_public_checks_on_this_kernels_records():
    for name, value in {**GOOD, "mean": _mean()}.items():
        record(name, value)
    report = self_check(LAB)
    assert [(c.name, c.outcome) for c in report.results] == [("mean_is_right", "pass"), ("loss_is_small", "pass")]
    assert (report.score, report.max_score, report.passed) == (4, 4, True)
    assert "self-check 90_fixture: 4 / 4 points" in report.text()


def test_self_check_shows_partial_and_missing_results():
    report = self_check(LAB, {"n": 500, "seed": 0, "mean": _mean() * 1.01})
    by = {c.name: c for c in report.results}
    assert by["mean_is_right"].outcome == "partial" and by["loss_is_small"].outcome == "missing"
    assert "final_loss" in by["loss_is_small"].message and report.score == 1 and not report.passed
    assert "<table>" in report._repr_html_() and "partly" in report.html()


def test_self_check_never_loads_hidden_checks(tmp_path):
    lab = tmp_path / "lab"
    shutil.copytree(LAB, lab)
    # Loading this file at all would leave a trace.
    (lab / "hidden_checks.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('yes')\n"
                                          "raise SystemExit('hidden checks were imported')\n")
    report = self_check(lab, GOOD)
    assert len(report.results) == 2 and not (tmp_path / "imported").exists()


def test_self_check_sees_the_same_run_evidence_as_the_grader(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "checks.py").write_text(
        "from scalelab.grade.checks import check, evidence\n"
        "@check(points=1)\n"
        "def real_run(r):\n"
        "    assert evidence(r, r['run_dir'])['final_loss'] == r['final_loss'], 'not the run loss'\n")
    ev = EventWriter(lab / "out" / "fit", rank=0)
    ev.emit("start", world_size=1, start_step=0, total_steps=1)
    time.sleep(0.01)  # the step below took 0.01 s: the clock must have moved that far (the plausibility check)
    ev.emit("step", step=1, loss=0.5, samples=1, step_s=0.01, data_s=0.0, compute_s=0.01, comm_s=0.0)
    ev.emit("end", final_loss=0.5)
    ev.close()
    assert self_check(lab, {"run_dir": str(lab / "out" / "fit"), "final_loss": 0.5}).passed
    forged = self_check(lab, {"run_dir": "out/fit", "final_loss": 0.1, "grader.runs": {"out/fit": {"final_loss": 0.1}}})
    assert forged.results[0].outcome == "fail"  # a notebook cannot hand itself the evidence


def test_self_check_outside_a_lab_folder_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GradingError, match="no checks.py in .*pass lab_dir="):
        self_check()


def test_widget_button_runs_the_checks_and_shows_them():
    record("n", 500)
    record("seed", 0)
    record("mean", _mean())
    widget = SelfCheck(LAB)
    assert "Run the lab's cells" in widget.result.value and widget.report is None
    widget.button.click()  # what a click in JupyterLab does
    assert widget.report.score == 2 and "mean_is_right" in widget.result.value
    assert "missing" in widget.result.value  # final_loss was never recorded


def test_widget_shows_an_error_instead_of_raising(tmp_path):
    widget = SelfCheck(tmp_path)
    assert widget.check() is None and "Self-check could not run" in widget.result.value


def test_self_check_in_a_real_kernel_uses_the_kernels_records(tmp_path):
    src = (f"from scalelab.record import record\nfrom scalelab.grade.selfcheck import self_check\n"
           f"record('n', 500); record('seed', 0); record('mean', {_mean()!r}); record('final_loss', 0.5)\n"
           f"report = self_check({str(LAB)!r})\nrecord('self_score', report.score)\n"
           f"record('outcomes', [c.outcome for c in report.results])")
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": "c", "metadata": {}, "source": src, "outputs": [], "execution_count": None}]}
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    result = execute_notebook(tmp_path / "nb.ipynb", output_path=tmp_path / "out.ipynb").raise_for_status()
    assert result.records["self_score"] == 2 and result.records["outcomes"] == ["pass", "fail"]


def test_the_report_colours_each_outcome_and_totals_them():
    from pathlib import Path as _P
    from scalelab.grade.checks import CheckResult
    from scalelab.grade.selfcheck import SelfCheckReport
    report = SelfCheckReport(_P("/x/02_lab"), [CheckResult("a", "pass", 1, 1), CheckResult("b", "fail", 0, 2),
                                               CheckResult("c", "missing", 0, 1), CheckResult("d", "pass", 1, 1)])
    page = report.html()
    assert "2 passed" in page and "1 failed" in page and "1 missing" in page and "partly" not in page.split("<table")[0]
    assert page.count("color:#176b2c") >= 3 and "color:#a11" in page and "color:#6b4fa1" in page
    assert "2 / 5 points" in page
