"""`scalelab grade` on real kernels: one batch (-j 2) of fixture submissions, one behaviour each.

The whole batch runs once (through the CLI, --json) and every test reads its part: each submission must get its
own right score and message *although* it shares the batch with an infinite loop, a dead kernel, a huge
output and a hostile notebook — that is the isolation the grader promises. Fixture lab: 8 points (public
mean_is_right 2 + loss_is_small 2; hidden loss_matches_the_run 3 + w_is_the_mean 1).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from scalelab.cli import main
from scalelab.course.release import release_lab
from scalelab.grade.sandbox import UID_RANGE
from scalelab.record import read_records
from sandbox_helpers import _as_root  # noqa: F401 (the fixture: root, or a failure under CI=true)
from sandbox_helpers import assert_nothing_leaks_into_reports

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "grading"))
import make_fixtures  # noqa: E402

pytestmark = pytest.mark.slow
FIX = Path(__file__).parent / "fixtures" / "grading"
LAB = FIX / "labs" / "90_fixture"
HIDDEN_SOURCE_BITS = (make_fixtures.SECRET, "math.isclose", "_expected_mean", "abs_tol")


def _sandbox_uids(looks: int = 20) -> set[int]:
    """Throwaway uids with a live process, over `looks` looks 50 ms apart (a pid-hopping daemon is missed by
    some looks, never by all of them)."""
    found = set()
    for _ in range(looks):
        for p in psutil.process_iter(["uids", "status"]):
            if p.info["status"] != psutil.STATUS_ZOMBIE:  # dead: an orphan waits for the machine's init to reap it
                found.update(u for u in (p.info["uids"] or []) if UID_RANGE[0] <= u < UID_RANGE[1])
        time.sleep(0.05)
    return found


LONG_NAME = "long_" + "x" * 240  # near the 255-byte limit of a file name
UNICODE_NAME = "Zoë_李雷"
FORMULA_NAME = "+SUM(1,2)"


@pytest.fixture(scope="module")
def batch(tmp_path_factory, slurm_cluster):
    """Grade every fixture submission plus the released student copy, a network probe and correct notebooks
    under hostile names, -j 2 (with the local Slurm up, so that its munge socket exists to be attacked)."""
    assert (slurm_cluster.state_dir / "munge" / "munge.socket").exists()
    tmp = tmp_path_factory.mktemp("batch")
    extra = tmp / "extra"
    extra.mkdir()
    release_lab(LAB, tmp / "student" / "90_fixture")
    shutil.copyfile(tmp / "student" / "90_fixture" / "lab.ipynb", extra / "student_copy.ipynb")
    for name in (LONG_NAME, UNICODE_NAME, FORMULA_NAME):
        shutil.copyfile(FIX / "submissions" / "correct.ipynb", extra / f"{name}.ipynb")
    subs = sorted(str(p) for p in (FIX / "submissions").glob("*.ipynb"))
    subs += [str(extra / f"{name}.ipynb") for name in (LONG_NAME, UNICODE_NAME, FORMULA_NAME)]
    with socket.socket() as server:  # a port on the host that a submission must not reach
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        (extra / "network.ipynb").write_text(json.dumps(make_fixtures.network_probe(server.getsockname()[1])))
        out, stdout = tmp / "grades", io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = main(["grade", str(LAB), *subs, str(extra / "student_copy.ipynb"), str(extra / "network.ipynb"),
                         "-j", "2", "--out", str(out), "--json"])
    data = json.loads(stdout.getvalue())
    by = {r["student"]: r for r in data["results"]}
    ours = {r["sandbox"].get("uid") for r in data["results"]} - {None}  # other graders may run beside this test
    return {"code": code, "out": out, "data": data, "uids_after": _sandbox_uids() & ours, "by": by,
            "by_prefix": {"long_": next(n for n in by if n.startswith("long_"))}}


ATTACKS = ("error_then_more", "pid_hopper", "litters", "proc_snoop", "kills_runner", "writes_outcome", "munge", "flood_output",
           "injected_parameters", "foreign_kernel", "reassigns_parameters")


def _checks(result) -> dict:
    return {c["name"]: c for c in result["checks"]}


def test_every_submission_is_graded_and_the_cli_succeeds(batch):
    assert batch["code"] == 0
    assert sorted(batch["by"]) == sorted(["correct", "wrong_answer", "missing_record", "infinite_loop", "os_exit",
                                          "reads_hidden", "forged_record", "huge_output", "stderr_output",
                                          "malformed", "untagged_parameters", "student_copy", "network",
                                          *ATTACKS, batch["by_prefix"]["long_"], UNICODE_NAME, FORMULA_NAME])
    assert all(r["max_score"] == 8 for r in batch["data"]["results"])


def test_correct_submission_gets_full_marks_beside_every_kind_of_failure(batch):
    r = batch["by"]["correct"]
    assert (r["status"], r["score"], r["percent"]) == ("ok", 8, 100)
    assert r["message"] == "the notebook ran to the end"
    assert r["sandbox"]["user"] == ("own uid" if os.geteuid() == 0 else "grader's user")


def test_wrong_answer_gets_partial_credit_with_the_checks_messages(batch):
    r = batch["by"]["wrong_answer"]
    checks = _checks(r)
    assert r["status"] == "ok" and r["score"] == 6
    assert (checks["mean_is_right"]["outcome"], checks["mean_is_right"]["points"]) == ("partial", 1)
    assert "check the divisor" in checks["mean_is_right"]["message"]
    assert checks["w_is_the_mean"]["outcome"] == "fail" and checks["w_is_the_mean"]["hidden"] is True
    assert checks["w_is_the_mean"]["message"] == "w did not converge to the mean of the data"


def test_missing_record_is_its_own_outcome_naming_the_record(batch):
    r = batch["by"]["missing_record"]
    w = _checks(r)["w_is_the_mean"]
    assert r["score"] == 7 and w["outcome"] == "missing" and "'w'" in w["message"]


def test_an_error_in_one_exercise_does_not_cost_the_exercises_after_it(batch):
    r = batch["by"]["error_then_more"]
    assert r["status"] == "cell_error" and r["execution"]["cell_index"] == 3, r
    assert r["message"] == "cell 3 (tagged exercise-1) raised ValueError: a slip after the answer"
    assert r["score"] == 8  # exercise 2 ran after the error, and its checks count


def test_infinite_loop_is_a_cell_timeout_naming_the_cell(batch):
    r = batch["by"]["infinite_loop"]
    assert r["status"] == "cell_timeout"
    assert r["execution"]["cell_tags"] == ["exercise-2"] and r["execution"]["cell_index"] == 4
    assert "per-cell limit of 10 s" in r["message"] and "exercise-2" in r["message"]
    assert r["score"] == 2  # exercise 1 ran before the loop: its check still counts
    assert "the run stopped early: cell timeout" in _checks(r)["loss_is_small"]["message"]


def test_os_exit_is_a_dead_kernel_naming_the_cell(batch):
    r = batch["by"]["os_exit"]
    assert r["status"] == "dead_kernel" and r["execution"]["cell_tags"] == ["exercise-2"]
    assert "kernel died in cell 4" in r["message"] and r["score"] == 2


@pytest.mark.usefixtures("_as_root")
def test_reading_the_hidden_checks_finds_nothing_and_costs_nothing(batch):
    r = batch["by"]["reads_hidden"]
    assert (r["status"], r["score"]) == ("ok", 8)
    records = read_records(batch["out"] / r["notebook"])
    assert records["tried"] >= 5  # it did try the reference lab, ../, /proc/1/root, ...
    assert records["leaked"] == [] and records["git_visible"] is False, r["sandbox"]


def test_hidden_checks_source_appears_nowhere_in_the_reports(batch):
    assert_nothing_leaks_into_reports(batch["out"], HIDDEN_SOURCE_BITS, " from hidden_checks.py")


def test_forged_record_is_caught_by_the_hidden_evidence_check(batch):
    r = batch["by"]["forged_record"]
    checks = _checks(r)
    assert checks["loss_is_small"]["outcome"] == "pass"  # the public check alone is fooled by the forged value
    assert checks["loss_matches_the_run"]["outcome"] == "fail"
    assert "is not what the run's event files show" in checks["loss_matches_the_run"]["message"]
    assert checks["w_is_the_mean"]["outcome"] == "pass"  # the documented limit: a bare forged value passes
    assert r["score"] == 5


def test_malformed_json_is_reported_and_scores_zero(batch):
    r = batch["by"]["malformed"]
    assert r["status"] == "malformed" and r["score"] == 0
    assert "not valid JSON" in r["message"] and "/" not in r["message"].split("run: ")[-1]
    assert all(c["outcome"] == "missing" for c in r["checks"])


def test_huge_output_is_capped_in_what_is_stored_and_shown(batch):
    r = batch["by"]["huge_output"]
    assert (r["status"], r["score"]) == ("ok", 8)
    stored = batch["out"] / r["notebook"]
    assert stored.stat().st_size < 200_000  # the run printed 3 MB
    assert "characters cut by the grader" in stored.read_text()
    assert (batch["out"] / "feedback" / "huge_output.html").stat().st_size < 50_000


def test_stderr_output_never_costs_points(batch):
    r = batch["by"]["stderr_output"]
    assert (r["status"], r["score"]) == ("ok", 8)
    assert "a warning on stderr" in (batch["out"] / r["notebook"]).read_text()


def test_without_a_parameters_cell_the_students_own_values_run_with_a_note(batch):
    r = batch["by"]["untagged_parameters"]
    assert (r["status"], r["score"]) == ("ok", 8)
    assert any("no cell tagged 'parameters'" in n for n in r["notes"])
    assert read_records(batch["out"] / r["notebook"])["n"] == 1000  # the notebook's default, not lab.yaml's 500


def test_released_student_copy_is_a_cell_error_below_full_marks(batch):
    r = batch["by"]["student_copy"]
    assert r["status"] == "cell_error" and r["execution"]["ename"] == "NotImplementedError"
    assert r["execution"]["cell_tags"] == ["exercise-1"]
    assert "cell 3 (tagged exercise-1) raised NotImplementedError: exercise" == r["message"]
    assert r["score"] < 8 and "NotImplementedError" in r["execution"]["traceback"]


def test_submissions_cannot_reach_a_port_on_the_host(batch):
    r = batch["by"]["network"]
    assert read_records(batch["out"] / r["notebook"])["connected"] is False


def test_reports_gradebook_and_feedback(batch):
    out = batch["out"]
    rows = (out / "gradebook.csv").read_text().splitlines()
    assert rows[0].startswith("student,percent,score,max_score,status,message,mean_is_right,loss_is_small,"
                              "loss_matches_the_run (hidden),w_is_the_mean (hidden)")
    assert len(rows) == 1 + 27 and any(row.startswith("correct,100.0,8.0,8.0,ok,") for row in rows)
    page = (out / "feedback" / "wrong_answer.html").read_text()
    assert "6 / 8 (75 %)" in page and "w did not converge" in page and "(hidden check)" in page
    assert json.loads((out / "results" / "forged_record.json").read_text())["score"] == 5
    if os.geteuid() == 0:
        assert oct(out.stat().st_mode & 0o777) == "0o700"


def test_no_process_of_any_submission_survives_the_batch(batch):
    assert batch["uids_after"] == set()
    assert [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE] == []


# -- attacks and accidents (issue 16) -----------------------------------------------------------------------------

@pytest.mark.usefixtures("_as_root")
def test_a_pid_hopping_daemon_does_not_outlive_its_run(batch):
    r = batch["by"]["pid_hopper"]
    assert (r["status"], r["score"]) == ("ok", 8)
    assert read_records(batch["out"] / r["notebook"])["hopper_started"] is True and r["sandbox"]["uid"]
    assert batch["uids_after"] == set()  # 20 looks over a second after the batch: no process of any run


@pytest.mark.usefixtures("_as_root")
def test_nothing_a_run_wrote_outside_its_folder_or_its_shared_memory_is_left_on_the_host(batch):
    r = batch["by"]["litters"]
    records = read_records(batch["out"] / r["notebook"])
    assert records["shm_created"] is True and "/tmp" in records["litter_written"]  # it did write, inside the run
    folders = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/run", "/home", "/root", "/etc", "/usr/local", "/opt",
               "/var/lib", "/srv"]
    left = [f for f in folders if (Path(f) / make_fixtures.LITTER_MARK).exists()]
    assert left == [], f"files of a graded run left on the host in {left}"
    segments = Path("/proc/sysvipc/shm").read_text()
    assert f"{0x5ca1ab1e:d}" not in segments.split() and "5ca1ab1e" not in segments


@pytest.mark.usefixtures("_as_root")
def test_proc_shows_a_run_only_its_own_processes(batch):
    r = batch["by"]["proc_snoop"]
    records = read_records(batch["out"] / r["notebook"])
    assert records["other_jobs_seen"] == []  # -j 2: another submission's runner ran beside it on the host
    assert 2 <= records["proc_count"] <= 12, records  # init, runner, papermill, kernel (and helpers)
    assert r["sandbox"]["processes"] == "own PID namespace"


@pytest.mark.usefixtures("_as_root")
def test_killing_the_runner_from_inside_is_the_students_own_status_not_a_grader_error(batch):
    r = batch["by"]["kills_runner"]
    assert r["status"] == "killed", r
    assert "killed before the notebook finished" in r["message"]
    assert r["score"] == 8  # everything recorded before the kill still counts


@pytest.mark.usefixtures("_as_root")
def test_an_outcome_written_by_the_students_code_decides_nothing(batch):
    r = batch["by"]["writes_outcome"]
    assert r["status"] == "cell_error" and r["execution"]["ename"] == "RuntimeError", r
    assert not any("=1+1" in n for n in r["notes"]) and "HYPERLINK" not in r["message"]
    written = read_records(batch["out"] / r["notebook"])["outcome_written"]
    assert written and not any(w.endswith(".outcome.json") for w in written)  # the runner's own: out of reach


@pytest.mark.usefixtures("_as_root")
def test_the_schedulers_munge_socket_is_out_of_reach(batch):
    r = batch["by"]["munge"]
    assert read_records(batch["out"] / r["notebook"])["munge_reachable"] == []


def test_a_hundred_megabytes_of_output_keeps_the_records_and_the_marks(batch):
    r = batch["by"]["flood_output"]
    assert (r["status"], r["score"]) == ("ok", 8), r
    stored = (batch["out"] / r["notebook"]).read_text()
    assert "more output cut by the grader while the notebook ran" in stored and len(stored) < 300_000


def test_an_injected_parameters_cell_is_removed_and_the_graders_values_win(batch):
    r = batch["by"]["injected_parameters"]
    assert (r["status"], r["score"]) == ("ok", 8)
    assert read_records(batch["out"] / r["notebook"])["n"] == 500  # lab.yaml's, not the student's 1000
    assert any("tagged 'injected-parameters' and were removed" in n for n in r["notes"]), r["notes"]


def test_a_foreign_kernelspec_is_reported_and_the_parameters_still_apply(batch):
    r = batch["by"]["foreign_kernel"]
    assert (r["status"], r["score"]) == ("ok", 8), r
    assert read_records(batch["out"] / r["notebook"])["n"] == 500
    assert any("asked for the kernel 'ir'" in n for n in r["notes"]), r["notes"]


def test_a_later_cell_that_reassigns_a_parameter_is_reported(batch):
    r = batch["by"]["reassigns_parameters"]
    assert any("assigns ['n'], which the grader sets" in n for n in r["notes"]), r["notes"]


def test_long_unicode_and_formula_names_are_graded_and_neutralised_in_the_gradebook(batch):
    long_name = batch["by_prefix"]["long_"]
    for name in (long_name, UNICODE_NAME, FORMULA_NAME):
        assert (batch["by"][name]["status"], batch["by"][name]["score"]) == ("ok", 8), name
    assert len(long_name) == 100
    for sub in ("results", "feedback", "notebooks"):
        assert all(len(p.name.encode()) < 100 for p in (batch["out"] / sub).iterdir()), sub
    with open(batch["out"] / "gradebook.csv", newline="", encoding="utf-8") as f:
        rows = {row[0]: row for row in csv.reader(f)}
    assert f"'{FORMULA_NAME}" in rows and FORMULA_NAME not in rows  # shown as text, never run as a formula
    assert UNICODE_NAME in rows and long_name in rows
    assert not any(cell.startswith(("=", "+", "-", "@")) for row in rows.values() for cell in row)
