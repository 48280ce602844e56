"""`scalelab grade --slurm` on the real local Slurm: each submission's sandboxed job is a Slurm job on the grading
partition, and the grade is the one local grading gives.

One local batch and one Slurm batch of the fixture lab (tests/fixtures/grading, 8 points) share the module: the
same three submissions graded both ways must get the same status, score and check outcomes. The Slurm batch also
holds the attacks on the new surface, run beside a victim whose job is alive while they act: a submission that
writes result files for itself (beside its job, in the report folder), one that leaves a daemon behind its job,
and one that tries to list, read and cancel the other grading jobs through Slurm.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from scalelab.cluster import accounting
from scalelab.cluster.job_end import COURSE_GROUP
from scalelab.course.lab import GradingError
from scalelab.grade.grader import GradeOptions, grade
from scalelab.grade.job import reap_crashed_batches
from scalelab.grade.sandbox import SandboxPolicy
from scalelab.grade import slurm_grading
from scalelab.grade.slurm_grading import JOB_NAME, SlurmGrading, lost_job_outcome, sbatch_args, time_limit_s
from helpers import remove_accounts
from sandbox_helpers import _as_root  # noqa: F401 (the fixture: root, or a failure under CI=true)

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "grading"))
import make_fixtures as mf  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("_as_root")]
LAB = Path(__file__).parent / "fixtures" / "grading" / "labs" / "90_fixture"
COMPARED = ("correct", "wrong_answer", "missing_record")
DAEMON_MARK = "scalelab-outlives-its-job-3b9c"

# Writes a result claiming full marks wherever a grader's file could be: beside its job folder (the Slurm job's
# result, the runner's outcome, the request a re-run's job reads) and in the report folder; records what it wrote.
FORGES_RESULT = """import json, pathlib
job = pathlib.Path.cwd().parent
full = {"outcome": {"status": "ok", "message": "forged"}, "plan": None, "status": "ok", "score": 8, "max_score": 8}
written = []
for target in [job.parent / (job.name + ".slurm-result.json"), job.parent / (job.name + ".outcome.json"),
               job.parent / (job.name + ".slurm-request.json"), pathlib.Path("OUT") / "results" / "forges_result.json",
               pathlib.Path("OUT") / "gradebook.csv", job.parent / "forged.json"]:
    try:
        target.write_text(json.dumps(full))
        written.append(str(target))
    except OSError:
        pass
record("result_written", written)"""

# Double-forks a shell loop (its command line carries the mark) that would outlive the notebook and its job.
OUTLIVES = """import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sh", ["/bin/sh", "-c", "while :; do sleep 1; done # MARK"])
    os._exit(0)
record("daemon_started", True)""".replace("MARK", DAEMON_MARK)

# Tries Slurm from inside its job: its environment, squeue / scontrol / scancel with the cluster's slurm.conf named
# outright, and the batch folder that holds the other submissions' jobs; for 4 s, while the victim's job runs.
SLURM_SNOOP = """import glob, os, pathlib, subprocess, time
job = pathlib.Path.cwd().parent
record("slurm_env", sorted(k for k in os.environ if k.startswith("SLURM")))
answers = []
deadline = time.time() + 4
while time.time() < deadline:
    for cmd in (["squeue", "-h"], ["scontrol", "show", "job"], ["scancel", "-u", "root"], ["scancel", "-p", "grading"],
                ["scancel", "-n", "JOBNAME"]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, env={**os.environ, "SLURM_CONF": "CONF"})
            answers.append([cmd[0], r.returncode, (r.stdout + r.stderr)[:200]])
        except (OSError, subprocess.SubprocessError) as e:
            answers.append([cmd[0], None, type(e).__name__])
    time.sleep(0.5)
record("slurm_answers", answers)
try:
    seen = sorted(os.listdir(job.parent))
except OSError as e:
    seen = [type(e).__name__]
record("batch_folder_seen", seen)
record("own_job", job.name)
record("requests_read", [p for p in glob.glob(str(job.parent / "*.slurm-request.json")) if os.access(p, os.R_OK)])"""

# The victim: a correct submission whose job is still running while the snoop tries to cancel every grading job.
VICTIM_WAIT = "import time\ntime.sleep(7)"


def _notebooks(out: Path, conf: Path) -> dict[str, dict]:
    subs = mf.submissions()
    ex1, ex2 = mf.solved(mf.EX1), mf.solved(mf.EX2)
    wrong = ex1.replace("/ len(data)", "/ (len(data) + 1)")
    return {**{name: subs[name] for name in COMPARED},
            "victim": mf.lab_cells(ex1, ex2, [VICTIM_WAIT]),
            "slurm_snoop": mf.lab_cells(ex1, ex2, [SLURM_SNOOP.replace("CONF", str(conf)).replace("JOBNAME", JOB_NAME)]),
            "forges_result": mf.lab_cells(wrong, ex2, [FORGES_RESULT.replace("OUT", str(out))]),
            "outlives": mf.lab_cells(ex1, ex2, [OUTLIVES])}


def _marked(mark: str) -> list[int]:
    """Pids whose command line carries `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _by_student(batch) -> dict:
    return {r.student: r for r in batch.results}


@pytest.fixture(scope="module")
def graded(tmp_path_factory, slurm_cluster):
    """The compared submissions graded on this host, and every submission graded as Slurm jobs (-j 4: the victim
    and the snoop start together)."""
    tmp = tmp_path_factory.mktemp("slurm-grading")
    subs = tmp / "subs"
    subs.mkdir()
    out_slurm, out_local = tmp / "grades-slurm", tmp / "grades-local"
    for name, nb in _notebooks(out_slurm, slurm_cluster.conf_path).items():
        (subs / f"{name}.ipynb").write_text(json.dumps(nb))
    order = ["victim", "slurm_snoop", "forges_result", "outlives", *COMPARED]
    local = grade(LAB, [subs / f"{n}.ipynb" for n in COMPARED], out_local, GradeOptions(jobs=2, workdir="/tmp"))
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    slurm = grade(LAB, [subs / f"{n}.ipynb" for n in order], out_slurm,
                  GradeOptions(jobs=4, workdir="/tmp", slurm=SlurmGrading()))
    first = min(int(r.sandbox["slurm"]["job"]) for r in slurm.results)
    jobs = [j for j in slurm_cluster.run("sacct", "-n", "-X", "-P", "-S", since, "--name", JOB_NAME, "-o",
                                         "JobID,Partition,State,Start,End", check=False).stdout.splitlines()
            if int(j.split("|")[0]) >= first]
    queued = slurm_cluster.run("squeue", "-h", "-n", JOB_NAME, "-o", "%i %T").stdout.split()
    return {"local": _by_student(local), "slurm": _by_student(slurm), "out": out_slurm, "jobs": jobs,
            "queued": queued, "daemons": _marked(DAEMON_MARK)}


def _records(graded, student: str) -> dict:
    return json.loads((graded["out"] / "instructor" / "records" / f"{student}.json").read_text())


def test_graded_by_slurm_equals_graded_locally(graded):
    for name in COMPARED:
        here, there = graded["local"][name], graded["slurm"][name]
        assert (there.status, there.score, there.max_score) == (here.status, here.score, here.max_score), name
        assert [(c.name, c.outcome, c.points, c.message) for c in there.checks] == \
            [(c.name, c.outcome, c.points, c.message) for c in here.checks], name
        assert "slurm" not in here.sandbox
    assert [graded["slurm"][n].score for n in COMPARED] == [8, 6, 7]  # three different grades: the equality says something


def test_every_submission_ran_in_its_own_job_on_the_grading_partition_confined_as_locally(graded, slurm_cluster):
    for r in graded["slurm"].values():
        assert r.sandbox["slurm"]["partition"] == "grading", r.student
        assert r.sandbox["slurm"]["node"] == slurm_cluster.run("hostname", "-s").stdout.strip(), r.student
        assert r.sandbox["user"] == "own uid" and r.sandbox["processes"] == "own PID namespace", r.student
        assert r.sandbox["network"] == "isolated (network namespace)", r.student
        assert r.sandbox["file_system"] == "fresh root: only the allow-list", r.student
    # one job per submission (the fixture lab's runs are in-process: no re-run job), each COMPLETED, none left
    rows = [j.split("|") for j in graded["jobs"]]
    assert len(rows) == len(graded["slurm"]) and {(p, s) for _, p, s, *_ in rows} == {("grading", "COMPLETED")}, rows
    assert sorted(r[0] for r in rows) == sorted(r.sandbox["slurm"]["job"] for r in graded["slurm"].values())
    assert graded["queued"] == []


def test_a_result_written_from_inside_the_job_decides_nothing(graded):
    r = graded["slurm"]["forges_result"]
    assert _records(graded, "forges_result")["result_written"] == []  # the batch and report folders are out of reach
    assert (r.status, r.score) == ("ok", 6)  # its own wrong answer's grade, not the 8 it wrote
    result = json.loads((graded["out"] / "results" / "forges_result.json").read_text())
    assert result["score"] == 6 and "forged" not in json.dumps(result)
    assert "forged" not in (graded["out"] / "gradebook.csv").read_text()


def test_a_daemon_does_not_outlive_its_job(graded):
    r = graded["slurm"]["outlives"]
    assert _records(graded, "outlives")["daemon_started"] is True and (r.status, r.score) == ("ok", 8)
    assert graded["daemons"] == []
    # the look would see one: the same loop started here, unconfined, is found by it
    proc = subprocess.Popen(["/bin/sh", "-c", f"while :; do sleep 1; done # {DAEMON_MARK}"])
    try:
        deadline = time.monotonic() + 5  # the child's command line is its own once it has exec'd
        while proc.pid not in _marked(DAEMON_MARK) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in _marked(DAEMON_MARK)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_submission_can_neither_see_nor_cancel_another_submissions_job(graded, slurm_cluster):
    victim = graded["slurm"]["victim"]
    assert (victim.status, victim.score) == ("ok", 8)  # its job ran to the end while the snoop tried to cancel it
    times = {row.split("|")[0]: row.split("|")[3:5] for row in graded["jobs"]}
    (v_start, v_end), (s_start, s_end) = (times[graded["slurm"][n].sandbox["slurm"]["job"]] for n in ("victim",
                                                                                                        "slurm_snoop"))
    assert v_start <= s_end and s_start <= v_end  # ISO times: the two jobs ran at the same time
    rec = _records(graded, "slurm_snoop")
    assert rec["slurm_env"] == []  # nothing of its job's Slurm environment
    answers = rec["slurm_answers"]
    assert len(answers) >= 5 and all(rc != 0 for _, rc, _ in answers), answers
    assert rec["batch_folder_seen"] == [rec["own_job"]] and rec["requests_read"] == []
    assert graded["slurm"]["slurm_snoop"].score == 8
    # the same commands work where Slurm is reachable: the test itself lists the queue
    assert slurm_cluster.run("squeue", "-h", check=False).returncode == 0


def test_an_unknown_partition_is_refused_before_any_submission(slurm_cluster, tmp_path):
    with pytest.raises(GradingError, match=r"no partition 'nosuch'.*--partition"):
        grade(LAB, [LAB / "lab.ipynb"], tmp_path / "out", GradeOptions(slurm=SlurmGrading(partition="nosuch")))
    assert not (tmp_path / "out").exists()


def test_a_course_accounts_own_job_on_the_grading_partition_is_refused(slurm_cluster, tmp_path):
    """A student could otherwise crowd the grading nodes, or wait there for a classmate's job to sit beside."""
    student = f"sl-grd-{secrets.token_hex(3)}"
    subprocess.run(["groupadd", "-f", "-r", COURSE_GROUP], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "--groups", COURSE_GROUP, student], check=True)
    tmp_path.chmod(0o755)
    try:
        accounting.register_user(student, slurm_cluster.conf_path)

        def submit(partition: str) -> subprocess.CompletedProcess:
            return subprocess.run(["sudo", "-E", "-u", student, "sbatch", "--parsable", f"--partition={partition}",
                                   f"--chdir={tmp_path}", "--output=/dev/null", "--mem=50", "--time=1",
                                   "--wrap", "true"], env={**os.environ, **slurm_cluster.env()}, capture_output=True,
                                  text=True, timeout=60)
        refused, taken = submit("grading"), submit("cpu")
        assert refused.returncode != 0 and "partition" in refused.stderr.lower(), refused.stderr
        assert taken.returncode == 0, taken.stderr  # the account may submit: the refusal is the partition's
    finally:
        remove_accounts(slurm_cluster, (student,))


def test_sbatch_asks_for_the_gradings_limits_plus_margins():
    slurm = SlurmGrading(partition="grade-nodes", cpus=3)
    args = sbatch_args(Path("/tmp/b/job-x"), SandboxPolicy(memory_mb=3072), 90, slurm)
    assert time_limit_s(90, slurm) == 90 + 60 + 120
    assert {"--partition=grade-nodes", "--cpus-per-task=3", "--mem=4096M", "--time=5", "--export=NONE",
            "--no-requeue", "--chdir=/tmp/b", "--ntasks=1"} <= set(args)
    assert args[-1] == "/tmp/b/job-x.slurm.sh"
    assert not any(a.startswith("--mem") for a in sbatch_args(Path("/tmp/b/j"), None, 90, slurm))


def test_slurm_flags_without_slurm_are_refused_naming_them(capsys):
    from scalelab.cli import main
    assert main(["grade", str(LAB), str(LAB / "lab.ipynb"), "--partition", "gpu"]) == 1
    err = capsys.readouterr().err
    assert "--partition and --slurm-cpus" in err and "add --slurm" in err and "Traceback" not in err


@pytest.mark.parametrize("kw, words", [({"partition": "a b"}, "--partition 'a b'"),
                                       ({"partition": ""}, "--partition ''"), ({"cpus": 0}, "--slurm-cpus")])
def test_bad_slurm_settings_name_the_flag(kw, words):
    with pytest.raises(GradingError, match=words.replace("'", ".")):
        SlurmGrading(**kw)


def test_a_job_that_ended_without_a_result_is_that_submissions_status_by_what_slurm_says():
    log = Path("/x/alice.log")
    assert lost_job_outcome({"JobState": "OUT_OF_MEMORY"}, "7", log)["status"] == "killed"
    assert lost_job_outcome({"JobState": "TIMEOUT"}, "7", log)["status"] == "timeout"
    cancelled = lost_job_outcome({"JobState": "CANCELLED", "ExitCode": "0:15", "NodeList": "n3"}, "7", log)
    assert cancelled["status"] == "grader_error"  # an admin's scancel, a node that failed: not the student's doing
    assert all(w in cancelled["message"] for w in ("job 7", "CANCELLED", "n3", "alice.log"))
    assert "gone" in lost_job_outcome({}, "7", log)["message"]


# A marked daemon, then a cell that outlasts the grader's (shortened) limit for its job.
SLEEPER = OUTLIVES + "\nimport time\ntime.sleep(300)"


def test_a_job_past_the_graders_limit_is_cancelled_and_leaves_nothing(slurm_cluster, tmp_path, monkeypatch):
    seen, done = [], threading.Event()
    # The grader's own limit for a running job: as long as ever until the sleeper's daemon was seen running (however
    # loaded the machine), then 3 s: the grader scancels the job while its notebook still sleeps.
    monkeypatch.setattr(slurm_grading, "time_limit_s", lambda total, slurm: 3.0 if seen else 3600.0)
    (tmp_path / "sleeper.ipynb").write_text(json.dumps(mf.lab_cells(mf.solved(mf.EX1), mf.solved(mf.EX2),
                                                                     [SLEEPER])))

    def watch():
        while not done.is_set():
            seen.extend(_marked(DAEMON_MARK))
            time.sleep(0.2)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = grade(LAB, [tmp_path / "sleeper.ipynb"], tmp_path / "out",
                  GradeOptions(workdir="/tmp", cell_timeout_s=400, total_timeout_s=400, slurm=SlurmGrading())
                  ).results[0]
    finally:
        done.set()
        watcher.join()
    assert r.status == "timeout" and r.duration_s < 300  # the grader's limit, not the notebook's 400 s
    assert seen and _marked(DAEMON_MARK) == []  # it ran, and nothing of it is left
    state = slurm_cluster.run("sacct", "-n", "-X", "-P", "-j", r.sandbox["slurm"]["job"], "-o", "State").stdout
    assert state.startswith("CANCELLED"), state


def test_a_job_left_pending_is_cancelled_after_the_queue_limit(slurm_cluster, tmp_path):
    (tmp_path / "correct.ipynb").write_text(json.dumps(mf.submissions()["correct"]))
    slurm_cluster.run("scontrol", "update", "PartitionName=grading", "State=DOWN")  # takes jobs, starts none
    try:
        batch = grade(LAB, [tmp_path / "correct.ipynb"], tmp_path / "out",
                      GradeOptions(workdir="/tmp", slurm=SlurmGrading(queue_timeout_s=4)))
    finally:
        slurm_cluster.run("scontrol", "update", "PartitionName=grading", "State=UP")
    r = batch.results[0]
    assert r.status == "grader_error" and "waited in the queue of partition 'grading'" in r.message
    assert slurm_cluster.run("squeue", "-h", "-n", JOB_NAME, "-o", "%i").stdout.split() == []


def test_the_reruns_are_slurm_jobs_too(slurm_cluster, tmp_path):
    """A lab whose run the grader re-runs (a real 2-rank engine run, 4 steps): the notebook's job, then the re-run's
    job, each on the grading partition, and the re-run verified the run."""
    lab = tmp_path / "95_rerun"
    lab.mkdir()
    (lab / "lab.ipynb").write_text(json.dumps(mf.notebook([mf.cell("code", 'steps = 4\nout_dir = "out"', ["parameters"]),
                                                           mf.cell("code", ENGINE_RUN)])))
    (lab / "checks.py").write_text(RUN_CHECK)
    (lab / "lab.yaml").write_text("grading:\n  parameters: {steps: 4}\n  cell_timeout_s: 120\n  total_timeout_s: 200\n"
                                  "  memory_mb: 3072\n")
    shutil.copyfile(lab / "lab.ipynb", tmp_path / "alice.ipynb")
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    r = grade(lab, [tmp_path / "alice.ipynb"], tmp_path / "out", GradeOptions(workdir="/tmp", slurm=SlurmGrading())
              ).results[0]
    assert (r.status, r.score) == ("ok", 1)
    assert any("re-ran 'out/ddp'" in n and "verified" in n for n in r.notes), r.notes
    first = int(r.sandbox["slurm"]["job"])  # the notebook's job; the re-run's comes after it
    jobs = [j for j in slurm_cluster.run("sacct", "-n", "-X", "-P", "-S", since, "--name", JOB_NAME, "-o",
                                         "JobID,Partition,State", check=False).stdout.splitlines()
            if int(j.split("|")[0]) >= first]
    assert len(jobs) == 2 and all(j.endswith("|grading|COMPLETED") for j in jobs), jobs


ENGINE_RUN = '''from scalelab import launch, preset
from scalelab.record import record
spec = preset("tiny").replace(output_dir=f"{out_dir}/ddp").with_overrides({"world.workers_per_node": 2, "steps": steps})
launch(spec).wait(timeout=120)
record("run_dir", f"{out_dir}/ddp")'''
RUN_CHECK = '''from scalelab.grade.checks import check, evidence


@check(points=1)
def the_run_is_real(r):
    """The run's events are the engine's (the grader re-runs the run this check reads)."""
    evidence(r, r["run_dir"])
'''


def test_a_graders_death_mid_batch_cancels_its_jobs_when_the_next_grader_starts(slurm_cluster, tmp_path):
    """The grader is SIGKILLed while its job runs a marked daemon: the next grader's start (`reap_crashed_batches`)
    scancels the job (CANCELLED, not left to run to its limit), and nothing of the run is left."""
    workdir = Path(tempfile.mkdtemp(prefix="sl-gk-", dir="/tmp"))  # short: job folders hold Unix sockets
    workdir.chmod(0o755)
    (tmp_path / "sleeper.ipynb").write_text(json.dumps(mf.lab_cells(mf.solved(mf.EX1), mf.solved(mf.EX2),
                                                                     [SLEEPER])))
    grader = subprocess.Popen([sys.executable, "-m", "scalelab.cli", "grade", str(LAB), str(tmp_path / "sleeper.ipynb"),
                               "--slurm", "--workdir", str(workdir), "--out", str(tmp_path / "out"),
                               "--cell-timeout", "400", "--total-timeout", "400"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _marked(DAEMON_MARK) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _marked(DAEMON_MARK), "the sleeper's daemon never started"
        job = next(iter(workdir.glob("scalelab-grade-*/*.slurm-job.json")))
        job_id = json.loads(job.read_text())["job"]
    finally:
        grader.kill()
        grader.wait()
    assert slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() == "RUNNING"  # it outlives him
    try:
        assert len(reap_crashed_batches(str(workdir))) == 1
        deadline = time.monotonic() + 60
        while slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip() and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        state = slurm_cluster.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").stdout
        assert state.startswith("CANCELLED"), state
        assert _marked(DAEMON_MARK) == [] and list(workdir.iterdir()) == []
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
        shutil.rmtree(workdir, ignore_errors=True)
