"""Grader parts without a kernel: lab settings, submissions, untrusted reading, evidence, reports, CLI wiring."""
from __future__ import annotations

import json
import math
import os
import time
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.cli import main
from scalelab.run.events import EventWriter
from scalelab.grade import grader
from scalelab.grade.checks import CheckResult, evidence, lab_checks
from scalelab.grade.evidence import RUNS, WORKDIR, run_evidence, strip_grader_records
from scalelab.grade.grader import GradeOptions, SubmissionResult, collect_submissions, grade
from scalelab.course.lab import GradingError, load_lab, parameter_defaults, student_files
from scalelab.grade.report import feedback_html, result_to_dict, write_gradebook, write_submission
from scalelab.grade.untrusted import (UntrustedFileError, cap_notebook, cap_text, load_json_beneath, read_beneath,
                                      tolerant_records)
from scalelab.record import MIME

LAB = Path(__file__).parent / "fixtures" / "grading" / "labs" / "90_fixture"


# -- lab settings ------------------------------------------------------------------------------------------------

def test_lab_yaml_grading_settings_are_read():
    lab = load_lab(LAB)
    assert lab.name == "90_fixture" and lab.title == "Fixture lab for grading tests" and lab.has_hidden_checks
    g = lab.grading
    assert (g.parameters, g.cell_timeout_s, g.total_timeout_s, g.memory_mb) == ({"n": 500, "steps": 25}, 10, 90, 3072)


@pytest.mark.parametrize("yaml_text, problem", [
    ("grading: {cell_timeout: 3}", r"unknown grading field\(s\) \['cell_timeout'\]"),
    ("grading: {total_timeout_s: -1}", "total_timeout_s must be a number of seconds > 0, got -1"),
    ("grading: {memory_mb: 10}", "memory_mb must be an integer >= 64"),
    ("grading: [1]", "'grading' must be a mapping"),
    ("title: [unclosed", "not valid YAML"),
])
def test_bad_lab_yaml_names_the_field(tmp_path, yaml_text, problem):
    (tmp_path / "lab.ipynb").write_text("{}")
    (tmp_path / "lab.yaml").write_text(yaml_text)
    with pytest.raises(GradingError, match=problem):
        load_lab(tmp_path)


def test_parameter_defaults_and_the_files_a_student_gets(tmp_path):
    assert parameter_defaults(LAB / "lab.ipynb") == {"n": 1000, "steps": 20, "lr": 0.3, "seed": 0, "out_dir": "out"}
    assert [p.as_posix() for p in student_files(LAB)] == ["README.md", "checks.py", "lab.ipynb", "lab.yaml"]


# -- submissions -------------------------------------------------------------------------------------------------

def test_student_names_come_from_file_or_folder_and_must_be_unique(tmp_path):
    (tmp_path / "bob").mkdir()
    subs = collect_submissions([tmp_path / "alice.ipynb", tmp_path / "bob", tmp_path / "c d" / "lab.ipynb"])
    assert [(s.student, s.path.name) for s in subs] == [("alice", "alice.ipynb"), ("bob", "lab.ipynb"),
                                                         ("c_d", "lab.ipynb")]
    with pytest.raises(GradingError, match="two submissions for student 'alice'"):
        collect_submissions([tmp_path / "alice.ipynb", tmp_path / "alice" / "lab.ipynb"])


# -- reading untrusted output ------------------------------------------------------------------------------------

def test_read_beneath_refuses_links_non_files_and_big_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "nb.ipynb").write_text('{"a": 1}')
    (tmp_path / "secret").write_text("root only")
    os.symlink(tmp_path / "secret", tmp_path / "out" / "link.ipynb")
    os.symlink(tmp_path / "out", tmp_path / "linked_dir")
    os.mkfifo(tmp_path / "out" / "fifo")
    assert load_json_beneath(tmp_path, "out/nb.ipynb") == {"a": 1}
    for rel in ("out/link.ipynb", "linked_dir/nb.ipynb", "out/fifo", "../secret", "out/missing"):
        with pytest.raises(UntrustedFileError):
            read_beneath(tmp_path, rel, 1000)
    with pytest.raises(UntrustedFileError, match="over the limit"):
        read_beneath(tmp_path, "out/nb.ipynb", 3)


def test_tolerant_records_skip_malformed_ones_and_keep_the_rest():
    def out(payload):
        return {"output_type": "display_data", "data": {MIME: payload}}
    nb = {"cells": [{"cell_type": "code", "outputs": [out({"name": "a", "value": 1}), out({"value": 2}),
                                                      out("not json"), out({"name": 3, "value": 3}),
                                                      out(json.dumps({"name": "b", "value": {"$float": "nan"}})),
                                                      "junk"]},
                    "junk cell", {"cell_type": "code", "outputs": "junk"}]}
    records, problems = tolerant_records(nb)
    assert records["a"] == 1 and math.isnan(records["b"]) and len(records) == 2
    assert len(problems) == 3 and all("malformed record output" in p for p in problems)


def test_cap_text_and_cap_notebook_cut_long_outputs():
    assert cap_text("short") == "short"
    cut = cap_text("a" * 1000 + "b" * 1000, 100)
    assert cut.startswith("a" * 66) and cut.endswith("b" * 34) and "1900 characters cut" in cut
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["x" * 50_000]},
        {"output_type": "error", "ename": "E", "evalue": "v", "traceback": ["t" * 30_000]},
        {"output_type": "display_data", "data": {"image/png": "i" * 1_200_000, "text/plain": "ok"}},
        {"output_type": "display_data", "data": {MIME: {"name": "n", "value": 1}}},
        {"output_type": "display_data", "data": {"image/png": "p" * 100_000}}]}]}
    capped, cuts = cap_notebook(nb)
    outs = capped["cells"][0]["outputs"]
    assert cuts == 3 and len(outs[0]["text"]) < 21_000 and len(outs[1]["traceback"][0]) < 21_000
    assert "image/png" not in outs[2]["data"] and outs[3]["data"][MIME] == {"name": "n", "value": 1}
    assert outs[4]["data"]["image/png"] == "p" * 100_000, "a plot of a lab's size is kept for the instructor"


# -- evidence ----------------------------------------------------------------------------------------------------

def _fake_run(workdir: Path, rel: str, losses: list[float], step_s: float = 0.01):
    """Events as the training loop writes them (a start event, steps paced by their real time, an end event)."""
    ev = EventWriter(workdir / rel, rank=0)
    ev.emit("start", world_size=1, start_step=0, total_steps=len(losses))
    for i, loss in enumerate(losses, 1):
        time.sleep(step_s)
        ev.emit("step", step=i, loss=loss, samples=4, step_s=step_s, data_s=0.0, compute_s=step_s, comm_s=0.0,
                samples_per_s=4 / step_s)
    ev.emit("end", steps=len(losses), final_loss=losses[-1], elapsed_s=(len(losses) + 1) * step_s)
    ev.close()


def test_evidence_is_derived_from_event_files_and_matched_to_recorded_run_dirs(tmp_path):
    _fake_run(tmp_path, "out/fit", [4.0, 2.0, 1.0])
    (tmp_path / "out" / "fit" / "events" / "rank-0.jsonl").open("a").write('{"cut short\n')
    os.symlink("/etc", tmp_path / "elsewhere")  # never followed
    found = run_evidence(tmp_path)
    assert found[WORKDIR] == str(tmp_path)
    run = found[RUNS]["out/fit"]
    assert (run["final_loss"], run["steps"], run["loss_curve"], run["world_size"]) == (1.0, 3, [4.0, 2.0, 1.0], 1)
    for recorded in ("out/fit", "./out/fit", str(tmp_path / "out" / "fit")):
        assert evidence({**found, "run_dir": recorded}, recorded)["final_loss"] == 1.0
    with pytest.raises(AssertionError, match="no event files were found for the run 'out/other'"):
        evidence(found, "out/other")


def test_a_notebook_cannot_record_the_graders_evidence_itself():
    kept, dropped = strip_grader_records({"grader.runs": {"x": {}}, "grader.workdir": "/", "loss": 1})
    assert kept == {"loss": 1} and dropped == ["grader.runs", "grader.workdir"]


# -- reports -----------------------------------------------------------------------------------------------------

def _result(**kw) -> SubmissionResult:
    checks = [CheckResult("public_one", "fail", 0, 2, message="<b>x</b> is wrong"),
              CheckResult("secret_one", "error", 0, 3, message="check raised KeyError: 'k'", hidden=True,
                          detail='File "hidden_checks.py", line 9, in secret_one\n    assert r["k"] == SECRET_VALUE')]
    base = dict(student="alice", lab="90_fixture", submission="alice.ipynb", status="cell_error",
                message="cell 3 raised ValueError: bad", score=0.0, max_score=5.0, checks=checks,
                execution={"traceback": "Traceback <script>"})
    return SubmissionResult(**{**base, **kw})


def test_feedback_shows_hidden_checks_by_name_and_message_only(tmp_path):
    for sub in ("results", "feedback", "instructor"):
        (tmp_path / sub).mkdir()
    data = write_submission(tmp_path, _result())
    page = (tmp_path / "feedback" / "alice.html").read_text()
    saved = (tmp_path / "results" / "alice.json").read_text()
    assert "secret_one" in page and "(hidden check)" in page and "check raised KeyError" in page
    for text in (page, saved):
        assert "SECRET_VALUE" not in text and "hidden_checks.py" not in text
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<script>" not in page  # student-influenced text is escaped
    assert data["checks"][1]["detail"] == ""
    logged = (tmp_path / "instructor" / "hidden_check_errors.jsonl").read_text()
    assert "SECRET_VALUE" in logged  # instructors still get the traceback


def test_gradebook_has_a_row_per_result_in_the_folder_and_a_column_per_check(tmp_path):
    for sub in ("results", "feedback", "instructor"):
        (tmp_path / sub).mkdir()
    write_submission(tmp_path, _result(student="bob", score=2.0))
    write_submission(tmp_path, _result(student="alice"))
    rows = write_gradebook(tmp_path).read_text().splitlines()
    assert rows[0] == "student,percent,score,max_score,status,message,public_one,secret_one (hidden)"
    assert rows[1].startswith("alice,0.0,0.0,5.0,cell_error,") and rows[2].startswith("bob,40.0,2.0,5.0,")


def test_feedback_page_states_score_and_run_outcome():
    page = feedback_html({**result_to_dict(_result(score=2.5)), "percent": 50.0})
    assert "Score: 2.5 / 5 (50 %)" in page and "cell error" in page and "Output on stderr never costs points" in page


# -- batch isolation and CLI ---------------------------------------------------------------------------------------

def test_a_grader_failure_on_one_submission_stays_with_it(tmp_path, monkeypatch):
    subs = []
    for name in ("ann", "ben"):
        (tmp_path / f"{name}.ipynb").write_text("{not json")
        subs.append(tmp_path / f"{name}.ipynb")
    real = grader._collect

    def flaky(ctx, job, sub, outcome, result, *rest):
        if sub.student == "ann":
            raise RuntimeError("disk on fire")
        return real(ctx, job, sub, outcome, result, *rest)
    monkeypatch.setattr(grader, "_collect", flaky)
    batch = grade(LAB, subs, tmp_path / "out", GradeOptions(jobs=2))
    by = {r.student: r for r in batch.results}
    assert by["ann"].status == "grader_error" and "RuntimeError: disk on fire" in by["ann"].message
    assert by["ben"].status == "malformed" and "not valid JSON" in by["ben"].message
    assert (tmp_path / "out" / "feedback" / "ann.html").exists()


def test_cli_grade_passes_options_to_the_api(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(lab, submissions, out, options, progress):
        seen.update(lab=lab, submissions=submissions, out=out, options=options)
        return grader.BatchResult("90_fixture", tmp_path, [], tmp_path / "gradebook.csv", 0.1)
    monkeypatch.setattr(grader, "grade", fake)
    code = main(["grade", str(LAB), "a.ipynb", "b/", "-j", "3", "--out", "o", "--set", "steps=5",
                 "--set", "name=run", "--cell-timeout", "7", "--memory-mb", "2048", "--hide", "/srv/key"])
    assert code == 0 and seen["lab"] == LAB.resolve() and seen["submissions"] == ["a.ipynb", "b/"]
    o = seen["options"]
    assert (o.jobs, o.parameters, o.cell_timeout_s, o.memory_mb, o.hide, o.sandbox, o.network) == \
        (3, {"steps": 5, "name": "run"}, 7.0, 2048, ("/srv/key",), True, None)
    assert main(["grade", str(LAB), "a.ipynb", "-j", "0"]) == 1
    assert "-j/--jobs must be >= 1" in capsys.readouterr().err


def test_lab_checks_of_the_fixture_are_public_and_hidden():
    checks = lab_checks(LAB)
    assert [(c.name, c.points, c.hidden) for c in checks] == [
        ("mean_is_right", 2, False), ("loss_is_small", 2, False), ("loss_matches_the_run", 3, True),
        ("w_is_the_mean", 1, True)]


def test_on_a_gpu_node_without_cgroup_v2_memory_is_not_limited_by_address_space(monkeypatch):
    from scalelab.grade import sandbox
    monkeypatch.setattr(sandbox, "gpu_devices", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(sandbox, "cgroup2_base", lambda: None)
    plan = sandbox.plan_sandbox(sandbox.SandboxPolicy(memory_mb=2048, own_user=False, network=True))
    assert plan.memory_via == "none" and any("RLIMIT_AS would stop CUDA" in n for n in plan.notes)


@pytest.mark.parametrize("status, execution, expected", [
    ("ok", {}, "the notebook ran to the end"),
    ("cell_error", {"cell_index": 3, "cell_tags": ["exercise-1"], "ename": "KeyError", "evalue": "'x'"},
     "cell 3 (tagged exercise-1) raised KeyError: 'x'"),
    ("cell_timeout", {"cell_index": 4, "limit_s": 10}, "cell 4 ran longer than the per-cell limit of 10 s"),
    ("timeout", {"cell_index": 5}, "the notebook ran longer than its limit of 90 s in total (stopped in cell 5)"),
    ("dead_kernel", {"cell_index": 2}, "the kernel died in cell 2: os._exit, a crash, or more memory than the "
                                       "3072 MiB via rlimit allowed"),
    ("malformed", {}, "the submission is not a notebook the grader can run: not valid JSON (line 1)"),
    ("grader_error", {}, "boom"),
])
def test_each_run_outcome_has_its_own_message_for_the_student(status, execution, expected):
    ctx = grader._Context(load_lab(LAB), [], GradeOptions(), Path("/x"), Path("/y"), [])
    result = SubmissionResult("s", "90_fixture", "s.ipynb", status, "", sandbox={"memory": "3072 MiB via rlimit"})
    raw = {"malformed": "/tmp/job/work/lab.ipynb: not valid JSON (line 1)", "grader_error": "boom"}.get(status, "")
    assert grader.student_message(status, execution, raw, ctx, result).startswith(expected)


def test_working_copy_takes_modules_from_a_submitted_folder_but_checks_from_the_lab(tmp_path):
    from scalelab.grade.job import working_copy
    lab_dir = tmp_path / "lab"
    shutil.copytree(LAB, lab_dir)
    (lab_dir / "stats.py").write_text("def mean(xs):\n    # BEGIN SOLUTION\n    return sum(xs) / len(xs)\n"
                                      "    # END SOLUTION\n")
    (lab_dir / "data.txt").write_text("shipped")
    lab = load_lab(lab_dir)
    own = tmp_path / "alice"
    own.mkdir()
    (own / "stats.py").write_text("def mean(xs):\n    return 0\n")
    (own / "checks.py").write_text("# the student's edited checks: never used")
    os.symlink("/etc/hostname", own / "data.txt")  # a link is never followed
    single, folder = tmp_path / "job1", tmp_path / "job2"
    assert working_copy(lab, single) == []
    assert working_copy(lab, folder, own) == ["stats.py"]
    assert "NotImplementedError" in (single / "work" / "stats.py").read_text()  # a lone notebook: released module
    assert (folder / "work" / "stats.py").read_text() == "def mean(xs):\n    return 0\n"
    for job in (single, folder):
        assert (job / "work" / "checks.py").read_text() == (LAB / "checks.py").read_text()
        assert (job / "work" / "data.txt").read_text() == "shipped"
        assert not (job / "work" / "hidden_checks.py").exists()
        assert {p.name for p in job.iterdir()} == {"work", "home", "tmp", "out"}
    # a hard link to a file elsewhere (a classmate's, the hidden checks) is not taken either
    os.unlink(own / "stats.py")
    (tmp_path / "elsewhere.py").write_text("SECRET = 1\n")
    os.link(tmp_path / "elsewhere.py", own / "stats.py")
    assert working_copy(lab, tmp_path / "job3", own) == []
    assert "SECRET" not in (tmp_path / "job3" / "work" / "stats.py").read_text()


def test_a_submission_reached_through_a_link_is_refused(tmp_path):
    # attack (an instructor grading homes directly): alice links her lab folder to bob's, to hand in his work
    from scalelab.grade.job import copy_submission
    bob = tmp_path / "bob" / "labs" / "90_fixture"
    bob.mkdir(parents=True)
    (bob / "lab.ipynb").write_text('{"bob": 1}')
    (tmp_path / "alice" / "labs").mkdir(parents=True)
    os.symlink(bob, tmp_path / "alice" / "labs" / "90_fixture")
    why = copy_submission(tmp_path / "alice" / "labs" / "90_fixture" / "lab.ipynb", tmp_path / "job" / "work")
    assert why and "symbolic link" in why and not (tmp_path / "job" / "work" / "lab.ipynb").exists()
    assert copy_submission(bob / "lab.ipynb", tmp_path / "job2" / "work") is None  # the real path is graded
    assert (tmp_path / "job2" / "work" / "lab.ipynb").read_text() == '{"bob": 1}'
    os.link(bob / "lab.ipynb", tmp_path / "alice" / "hardlinked.ipynb")
    why = copy_submission(tmp_path / "alice" / "hardlinked.ipynb", tmp_path / "job3" / "work")
    assert why and "hard links" in why


def test_grade_and_labs_release_cli_surface_is_frozen():
    """What docs/grading.md and course handouts promise."""
    from scalelab.cli import build_parser
    commands = build_parser()._subparsers._group_actions[0].choices
    flags = {opt for a in commands["grade"]._actions for opt in a.option_strings}
    assert {"-j", "--jobs", "--out", "--set", "--cell-timeout", "--total-timeout", "--memory-mb", "--allow-network",
            "--no-sandbox", "--hide", "--workdir", "--keep-workdirs", "--job-mb", "--json"} <= flags
    release = commands["labs"]._subparsers._group_actions[0].choices["release"]
    assert {"--out", "--labs-root"} <= {opt for a in release._actions for opt in a.option_strings}


def test_a_hidden_check_failing_without_a_message_does_not_show_its_rule(tmp_path):
    (tmp_path / "hidden_checks.py").write_text(
        'from scalelab.grade.checks import check\n\n@check(points=1)\ndef secret_rule(r):\n'
        '    """w must equal 42.1337 exactly."""\n    assert r["w"] == 42.1337\n')
    (tmp_path / "checks.py").write_text(
        'from scalelab.grade.checks import check\n\n@check(points=1)\ndef public_rule(r):\n'
        '    """w is positive."""\n    assert r["w"] > 0\n')
    from scalelab.grade.checks import run_checks
    results = {c.name: c for c in run_checks(lab_checks(tmp_path), {"w": -1})}
    assert results["secret_rule"].message == "not met (a hidden check: its rule is not shown)"
    assert "42.1337" not in results["secret_rule"].message
    assert results["public_rule"].message == "w is positive.: not met"  # a public check's rule is no secret


def test_student_names_keep_any_script_and_length_and_file_keys_stay_short_and_distinct():
    from scalelab.grade.grader import student_name
    from scalelab.grade.report import csv_cell, file_key
    assert student_name("Zoë 李雷") == "Zoë_李雷" and student_name("../etc\x00x") == "_etc_x"
    a, b = student_name("a" * 300 + "1"), student_name("a" * 300 + "2")
    assert len(a) == len(b) == 100 and a != b
    keys = {file_key(n) for n in ("Zoë_李雷", "Zoe_李雷", a, b, "+SUM(1,2)", "alice")}
    assert len(keys) == 6 and all(len(k) <= 71 and k.isascii() for k in keys) and "alice" in keys
    assert [csv_cell(x) for x in ("=1+1", "+x", "-2", "@a", "\tq", "ok", 3.5)] == \
        ["'=1+1", "'+x", "'-2", "'@a", "'\tq", "ok", 3.5]


def test_checks_files_load_in_many_threads_at_once_each_with_its_own_checks(tmp_path):
    """Two grading batches in one process (or the hub's dashboard beside a batch) load checks files at the same
    time; each load collects exactly its own file's checks (a shared registry once raised TypeError in one of
    them and mixed their checks)."""
    import threading
    from scalelab.grade.checks import load_checks
    files = {}
    for n in (2, 5):
        path = tmp_path / f"lab{n}" / "checks.py"
        path.parent.mkdir()
        body = "".join(f"@check(points=1)\ndef c{i}(r):\n    time.sleep(0.001)\n\n\n" for i in range(n))
        path.write_text(f"import time\n\nfrom scalelab.grade.checks import check\ntime.sleep(0.01)\n\n\n{body}")
        files[n] = path
    found, errors = [], []

    def load(n):
        try:
            for _ in range(15):
                found.append((n, [c.name for c in load_checks(files[n])]))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(repr(e))
    threads = [threading.Thread(target=load, args=(n,)) for n in (2, 5) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(found) == 90 and all(names == [f"c{i}" for i in range(n)] for n, names in found)


def test_the_root_runner_does_not_import_from_the_students_work_folder(tmp_path):
    # attack: the runner starts as root with the job's work folder (student files) as its current folder; with
    # `python -m` that folder came first on the import path, so a module planted there would run as root
    from scalelab.grade.job import RUNNER_MAIN
    planted = tmp_path / "scalelab" / "grade"
    planted.mkdir(parents=True)
    for folder in (tmp_path / "scalelab", planted):
        (folder / "__init__.py").write_text("")
    (planted / "runner.py").write_text("print('PLANTED RUNNER')\ndef main(argv):\n    return 0\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    as_before = subprocess.run([sys.executable, "-m", "scalelab.grade.runner", "job.json"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
    assert "PLANTED RUNNER" in as_before.stdout  # the control: -m imports the planted module
    now = subprocess.run([sys.executable, "-c", RUNNER_MAIN, "job.json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert "PLANTED RUNNER" not in now.stdout and "job.json" in now.stderr  # the real runner, missing its job


def test_job_folders_leave_room_for_the_unix_sockets_runs_make_in_them(tmp_path):
    # A DataLoader with workers binds multiprocessing's socket in TMPDIR (<base>/<job>/tmp/pymp-*/listener-*); past
    # 108 bytes the bind fails in the worker and the cell hangs to its limit (lab 01 did, graded from a long --workdir)
    from scalelab.course.lab import GradingError
    from scalelab.grade.job import JOB_NAME_CHARS, MAX_BASE_CHARS, job_base
    deep = tmp_path / ("x" * 60)
    deep.mkdir()
    with pytest.raises(GradingError, match=r"pass a shorter --workdir"):
        job_base(str(deep), sandbox=False)
    base = job_base(None, sandbox=False)
    try:
        socket_path = (base / ("s" * JOB_NAME_CHARS + "-abcdefgh") / "tmp" / "pymp-abcdefgh" / "listener-abcdefgh")
        assert len(str(base)) <= MAX_BASE_CHARS and len(str(socket_path)) < 108
    finally:
        shutil.rmtree(base)


def test_only_a_dead_graders_marked_batch_is_cleaned_up_at_start():
    # reap_crashed_batches removes a batch folder only when the grader its marker names is gone: a pid now held by a
    # process started later (pid reuse) or a marker from before the machine restarted counts as gone; a live
    # grader's, another host's (a shared workdir), a marker written by hand with other bits, or no marker: left.
    import socket as _socket
    import tempfile
    from scalelab.grade.job import BATCH_MARKER, job_base, reap_crashed_batches
    tmp_path = Path(tempfile.mkdtemp(prefix="sl-reap-"))  # short: job_base refuses a long workdir
    own = job_base(str(tmp_path), sandbox=False)  # this process: alive
    batches = {}
    for name, change in (("reused", {"start": 1.0}), ("rebooted", {"boot_id": "another-boot"}),
                         ("elsewhere", {"host": _socket.gethostname() + "-other", "start": 1.0}),
                         ("loose", {"start": 1.0})):
        base = job_base(str(tmp_path), sandbox=False)
        (base / "alice-abcdefgh").mkdir()
        marker = json.loads((base / BATCH_MARKER).read_text())
        (base / BATCH_MARKER).write_text(json.dumps({**marker, **change}))
        batches[name] = base
    batches["loose"].joinpath(BATCH_MARKER).chmod(0o644)  # not the grader's private marker
    unmarked = tmp_path / "scalelab-grade-unmarked"
    unmarked.mkdir()
    assert sorted(reap_crashed_batches(str(tmp_path))) == sorted([batches["reused"], batches["rebooted"]])
    assert own.is_dir() and batches["elsewhere"].is_dir() and batches["loose"].is_dir() and unmarked.is_dir()
    assert not batches["reused"].exists() and not batches["rebooted"].exists()
    shutil.rmtree(tmp_path)
