"""The instructor's week on a real local hub with course accounts: collect → grade → return → course gradebook,
for 3 students across 2 labs, with a student who plants symbolic links where the instructor reads and writes.

The hub hands the two labs out when each student's server starts (provisioning into homes the students own);
the test then plays the students (answers written as each student), and the instructor's commands run as root
through the CLI.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from datetime import datetime
from pathlib import Path

import pytest

from scalelab.cli import main
from scalelab.course.release import release_lab
from scalelab.testing.hub import HubRunner

pytestmark = pytest.mark.slow
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
FIX = Path(__file__).parent / "fixtures" / "grading"
LABS = ("90_fixture", "91_fixture")
DEADLINE = "2026-01-01T12:00:00+00:00"
_DUE = datetime.fromisoformat(DEADLINE).timestamp()
ON_TIME, LATE = _DUE - 3600, _DUE + 3600  # an hour before and after the deadline


@pytest.fixture(scope="module")
def course():
    if os.geteuid() != 0:
        if CI:
            pytest.fail("CI=true: the course workflow test needs root (course accounts)", pytrace=False)
        pytest.skip("course accounts need root")
    work = Path(tempfile.mkdtemp(prefix="course-week-"))
    os.chmod(work, 0o755)
    src = work / "src"
    for name in LABS:  # two labs: the fixture lab and a copy of it under another name
        shutil.copytree(FIX / "labs" / "90_fixture", src / name)
        release_lab(src / name, work / "hub" / "labs" / name)
    hub = HubRunner(work / "hub", mode="local", accounts=["ann", "ben", "cat"])
    os.chmod(hub.workdir, 0o755)
    hub.start()
    try:
        for short in ("ann", "ben", "cat"):
            user = hub.login(short)
            assert user.spawn().status_code in (201, 202), hub.log_tail()
            user.wait_ready(timeout=120)
            user.stop()
        yield {"work": work, "src": src, "hub": hub, "homes": {s: Path(pwd.getpwnam(hub.user(s)).pw_dir)
                                                               for s in ("ann", "ben", "cat")}}
    finally:
        hub.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def _as(student: str, hub: HubRunner, *argv: str, stdin: bytes = b"") -> None:
    subprocess.run(argv, input=stdin, check=True, user=hub.user(student), group=hub.user(student),
                   extra_groups=[], capture_output=True, timeout=60)


def _answer(course, student: str, lab: str, kind: str, mtime: float) -> None:
    """Play the student: put a notebook in their copy of the lab, as them."""
    nb = Path(course["homes"][student]) / "labs" / lab / "lab.ipynb"
    text = (FIX / "submissions" / f"{kind}.ipynb").read_bytes()
    _as(student, course["hub"], "sh", "-c", f"cat > '{nb}'", stdin=text)
    os.utime(nb, (mtime, mtime), follow_symlinks=False)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def week(course):
    hub, work, homes = course["hub"], course["work"], course["homes"]
    secret = work / "root-only.txt"  # what cat's planted links point at
    secret.write_text("ROOT SECRET\n")
    secret.chmod(0o600)
    _answer(course, "ann", "90_fixture", "correct", ON_TIME)
    _answer(course, "ben", "90_fixture", "wrong_answer", ON_TIME)
    # cat never solved lab 90 (the copy the hub handed out stays), and in lab 91 plants links instead.
    _answer(course, "ann", "91_fixture", "correct", ON_TIME)
    _answer(course, "ben", "91_fixture", "correct", LATE)
    cat90, cat91 = (homes["cat"] / "labs" / lab for lab in LABS)
    _as("cat", hub, "sh", "-c", f"rm '{cat91}/lab.ipynb' && ln -s '{secret}' '{cat91}/lab.ipynb' && "
                                f"ln -s '{secret}' '{cat90}/feedback.html'")
    res = {}
    for lab in LABS:
        code, text = _cli("course", "collect", str(course["src"] / lab), "--config", str(hub.config_path),
                          "--deadline", DEADLINE, "--out", str(work / "collected" / lab))
        assert code == 0
        res[f"collect {lab}"] = json.loads((work / "collected" / lab / "collected.json").read_text())
        subs = sorted(str(p) for p in (work / "collected" / lab).iterdir() if p.is_dir())
        code, _ = _cli("grade", str(course["src"] / lab), *subs, "-j", "2", "--out", str(work / "grades" / lab))
        assert code == 0
        code, text = _cli("course", "return", str(course["src"] / lab), "--config", str(hub.config_path),
                          "--grades", str(work / "grades" / lab))
        assert code == 0
        res[f"return {lab}"] = text
    code, path = _cli("course", "gradebook", "--grades", str(work / "grades"), "--collected",
                      str(work / "collected"))
    assert code == 0
    with open(path.strip(), newline="", encoding="utf-8") as f:
        res["gradebook"] = list(csv.DictReader(f))
    res["gradebook_mode"] = os.stat(path.strip()).st_mode & 0o777
    res["secret"] = secret
    return res


def _students(manifest) -> dict:
    return {s["student"].rsplit("-", 1)[-1]: s for s in manifest["students"]}


def test_collect_takes_each_students_notebook_from_their_home_and_flags_late_work(course, week):
    lab90, lab91 = _students(week["collect 90_fixture"]), _students(week["collect 91_fixture"])
    assert {k: v["status"] for k, v in lab90.items()} == {"ann": "collected", "ben": "collected", "cat": "collected"}
    assert (lab91["ann"]["late"], lab91["ben"]["late"]) == (False, True)
    assert lab91["ben"]["modified"] == "2026-01-01T13:00:00+00:00"


def test_a_planted_link_is_refused_not_followed(course, week):
    cat = _students(week["collect 91_fixture"])["cat"]
    assert cat["status"] == "refused" and "not collected" in cat["note"], cat
    assert not (course["work"] / "collected" / "91_fixture" / course["hub"].user("cat")).exists()
    for path in (course["work"] / "collected").rglob("*"):
        if path.is_file():
            assert "ROOT SECRET" not in path.read_text(errors="replace"), path


def test_feedback_goes_back_into_each_home_as_the_student(course, week):
    for short in ("ann", "ben"):
        page = course["homes"][short] / "labs" / "90_fixture" / "feedback.html"
        assert page.is_file() and "Score:" in page.read_text()
        assert page.stat().st_uid == pwd.getpwnam(course["hub"].user(short)).pw_uid  # written as them, not root
    assert "8 / 8" in (course["homes"]["ann"] / "labs" / "90_fixture" / "feedback.html").read_text()
    # cat's feedback.html was a link to a root-only file: the page replaced the link, the file is untouched.
    cat = course["homes"]["cat"] / "labs" / "90_fixture" / "feedback.html"
    assert not cat.is_symlink() and "Score:" in cat.read_text()
    assert week["secret"].read_text() == "ROOT SECRET\n" and week["secret"].stat().st_uid == 0
    assert "not returned: no feedback" in week["return 91_fixture"].split(course["hub"].user("cat"))[1]


def test_the_course_gradebook_has_a_row_per_student_and_a_column_per_lab(course, week):
    assert week["gradebook_mode"] == 0o600, oct(week["gradebook_mode"])  # every student's grades: the instructor's
    rows = {r["Student"].rsplit("-", 1)[-1]: r for r in week["gradebook"]}
    assert sorted(rows) == ["ann", "ben", "cat"]
    assert (rows["ann"]["90_fixture (%)"], rows["ann"]["91_fixture (%)"], rows["ann"]["Average (%)"]) == \
        ("100.0", "100.0", "100.0")
    assert rows["ben"]["91_fixture late"] == "yes" and rows["ben"]["90_fixture late"] == ""
    assert float(rows["ben"]["90_fixture (%)"]) < 100  # the wrong answer
    assert rows["cat"]["91_fixture (%)"] == "" and rows["cat"]["91_fixture status"] == "not graded"
    assert float(rows["cat"]["90_fixture (%)"]) < 100  # the unsolved copy the hub handed out


def test_a_second_collect_after_the_deadline_keeps_the_on_time_snapshot(tmp_path):
    from scalelab.course.collect import collect, parse_deadline
    home = tmp_path / "homes" / "dee"
    (home / "labs" / "90_fixture").mkdir(parents=True)
    nb = home / "labs" / "90_fixture" / "lab.ipynb"
    nb.write_text('{"first": 1}')
    os.utime(nb, (ON_TIME, ON_TIME))
    out, deadline = tmp_path / "collected", parse_deadline(DEADLINE)
    first = collect(FIX / "labs" / "90_fixture", {"dee": home}, out, deadline=deadline)
    assert (first[0].status, first[0].late) == ("collected", False)
    assert out.stat().st_mode & 0o777 == 0o700  # students' work: nobody else may enter the collection
    nb.write_text('{"changed": 2}')  # after the deadline (today), with its time set back to look on time
    os.utime(nb, (ON_TIME, ON_TIME))
    second = collect(FIX / "labs" / "90_fixture", {"dee": home}, out, deadline=deadline)
    assert (second[0].status, second[0].late) == ("kept", True)
    assert (out / "dee" / "lab.ipynb").read_text() == '{"first": 1}'  # what is graded: the on-time snapshot
    assert (out / "dee" / "late" / "lab.ipynb").read_text() == '{"changed": 2}'
    with pytest.raises(Exception, match="not an ISO 8601 date"):
        parse_deadline("next friday")


def test_labs_update_brings_a_fixed_lab_without_touching_a_students_work(course, week):
    hub, homes = course["hub"], course["homes"]
    source = hub.workdir / "labs" / "90_fixture"
    fixed = (source / "lab.ipynb").read_text().replace("A mean and a tiny fit", "A mean and a tiny fit (fixed)")
    (source / "lab.ipynb").write_text(fixed)
    (source / "README.md").write_text("Notes, corrected.\n")
    # ben plants a scalelab package in his home, where the update runs as him: `python -m` would import it first,
    # and it would run beside the instructor's (root) terminal
    plant = homes["ben"] / "scalelab"
    _as("ben", hub, "mkdir", "-p", str(plant / "hub"))
    for rel in ("__init__.py", "hub/__init__.py", "hub/provision.py"):
        _as("ben", hub, "sh", "-c", f"cat > '{plant / rel}'",
            stdin=f"open({str(homes['ben'] / 'planted-ran')!r}, 'w').write('ran')\n".encode())
    try:
        code, text = _cli("labs", "update", "--config", str(hub.config_path))
        assert not (homes["ben"] / "planted-ran").exists(), "the update imported a module from the student's home"
        assert "copied" in text.split(hub.user("ben"), 1)[1].splitlines()[0], text  # his labs were still updated
    finally:
        shutil.rmtree(plant, ignore_errors=True)
    assert code == 0 and hub.user("ann") in text
    ann = homes["ann"] / "labs" / "90_fixture"
    assert "Exercise 1" in (ann / "lab.ipynb").read_text() and "(fixed)" not in (ann / "lab.ipynb").read_text()
    beside = [p for p in ann.iterdir() if p.name.startswith("lab (course update")]
    assert len(beside) == 1 and "(fixed)" in beside[0].read_text()  # the new version, beside her own
    assert (ann / "README.md").read_text() == "Notes, corrected.\n"  # unedited: simply updated
    assert beside[0].stat().st_uid == pwd.getpwnam(hub.user("ann")).pw_uid  # written as her


def test_labs_run_executes_a_parameter_profile_and_names_a_missing_one(tmp_path):
    code, text = _cli("labs", "run", str(FIX / "labs" / "90_fixture"), "--profile", "demo", "--out",
                      str(tmp_path / "demo"))
    assert code == 0 and ": ok in" in text
    from scalelab.record import read_records
    records = read_records(tmp_path / "demo" / "lab.ipynb")
    assert records["n"] == 200  # the demo profile's, not the grader's 500 or the notebook's 1000
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["labs", "run", str(FIX / "labs" / "90_fixture"), "--profile", "gpu-node"]) == 1
    assert "no parameter profile 'gpu-node'" in err.getvalue() and "'demo'" in err.getvalue()


@pytest.fixture
def home():
    """A home other users may enter, owned by nobody when we are root (run_as_owner refuses a home of root's)."""
    path = Path(tempfile.mkdtemp(prefix="scalelab-home-"))
    path.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_command_run_in_a_students_home_has_no_terminal_and_imports_nothing_from_it(home):
    # What `labs update` and `course return` start in a home: a session of its own (so no controlling terminal to
    # read or type into), and an import path without the home on it.
    import sys
    from scalelab.course.collect import owner_python, printable, run_as_owner
    tmp_path = home
    (tmp_path / "scalelab").mkdir(mode=0o755)
    (tmp_path / "scalelab" / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('planted')\n")
    r = run_as_owner(tmp_path, owner_python("scalelab.hub.provision", str(tmp_path / "no-labs"), "."))
    assert not (tmp_path / "ran").exists(), r.stderr  # the real provision ran (nothing to copy)
    assert r.stderr.startswith(b"scalelab provision: copied 0"), r.stderr
    r = run_as_owner(tmp_path, [sys.executable, "-m", "scalelab.hub.provision", str(tmp_path / "no-labs"), "."])
    assert (tmp_path / "ran").exists()  # the control: `python -m` imports the planted package
    r = run_as_owner(tmp_path, [sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"])
    assert r.stdout.decode().strip() == "True", r.stderr  # a session leader: no terminal of the instructor's
    assert printable("done\x1b]0;pwned\x07\x1b[2J") == "done?]0;pwned??[2J"
