"""Attacks on the grader itself (issue 38 items 2 and 4), each through a real batch (`scalelab grade`, -j 2).

- *Search*: a submission walks the whole file system from / and reads every hidden check, course copy and
  classmate's notebook it finds, then raises an error carrying what it read. The run sees only its job folder,
  the course's Python environment and the system's read-only files (a fresh root): it finds nothing, and nothing
  of a hidden check reaches the feedback. A copy of the course that other users may read (the planted one in
  /srv) and the batch's other submissions sit outside any folder the old deny-list knew of.
- *Nothing a submission does is a grader_error*: a malformed record output is the student's note; a kernel that
  kills its parent (the process running papermill) or jams it is the student's own status, with no internal
  path or log in the message; a lone surrogate escape in the notebook's JSON is text like any other; the batch
  exits 0.

The walk skips /proc and /sys (kernel views, not files; /proc shows only the run's own processes, proven in
test_grade_batch.py) and follows no link.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from scalelab.cli import main
from scalelab.grade.sandbox import needed_paths
from sandbox_helpers import _as_root, fake_checkout  # noqa: F401 (the fixture: root, or a failure under CI=true)
from sandbox_helpers import assert_nothing_leaks_into_reports

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "grading"))
import make_fixtures  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("_as_root")]
LAB = Path(__file__).parent / "fixtures" / "grading" / "labs" / "90_fixture"
PLANTED = "PLANTED-COPY-SECRET-93d1"
CLASSMATE = "classmate_4b7e"

# Everything a curious student would look for, anywhere: hidden checks, course copies (a lab.yaml, a .git), other
# notebooks; then every hidden check found is read and its text raised as an error message.
SNOOP = r"""import os, sys
own = os.path.dirname(os.getcwd())  # the job folder: work/ (the lab as students have it), home/, tmp/, out/
found = {"hidden_checks": [], "lab_yaml": [], "git": [], "notebooks": [], "classmate": [], "unreadable": 0}
def _err(e):
    found["unreadable"] += 1
for top, dirs, files in os.walk("/", onerror=_err):
    if top in ("/proc", "/sys"):
        dirs[:] = []
        continue
    if ".git" in dirs or ".git" in files:
        found["git"].append(os.path.join(top, ".git"))
    for f in files + dirs:
        p = os.path.join(top, f)
        mine = p.startswith(own + "/")
        if "CLASSMATE" in f:
            found["classmate"].append(p)
        if f == "hidden_checks.py":
            found["hidden_checks"].append(p)
        elif f == "lab.yaml" and not mine:
            found["lab_yaml"].append(p)
        elif f.endswith(".ipynb") and not mine and "site-packages" not in p:
            found["notebooks"].append(p)
record("found", found)
record("root_listing", sorted(os.listdir("/")))
stolen = []
for p in found["hidden_checks"] + found["classmate"]:
    try:
        stolen.append(open(p, errors="replace").read()[:2000])
    except OSError:
        pass
record("stolen_count", len(stolen))
if stolen:
    raise ValueError("\n".join(stolen))
""".replace("CLASSMATE", CLASSMATE)

# A record output the grader cannot decode (no name): display() lets a notebook print any MIME bundle.
MALFORMED_RECORD = """from IPython.display import display
display({"application/vnd.scalelab.record+json": {"value": 1}}, raw=True)
display({"application/vnd.scalelab.record+json": "[not json"}, raw=True)
record("after_the_malformed_one", 1)"""

# The kernel's parent is the process running papermill: killed, after all the work is recorded.
KILLS_PARENT = """import os, signal, time
os.kill(os.getppid(), signal.SIGKILL)
time.sleep(30)"""

# Rewrites the executed notebook to look as if no cell had started (what a kernel that never started leaves), then
# kills its parent: the runner must not take the grader's word from a file the student's code can write.
FORGES_UNSTARTED = """import json, os, signal, time
nb = json.load(open("../out/lab.ipynb"))
for c in nb["cells"]:
    c.get("metadata", {}).pop("papermill", None)
    c["outputs"] = [] if c["cell_type"] == "code" else c.get("outputs")
json.dump(nb, open("../out/lab.ipynb", "w"))
os.kill(os.getppid(), signal.SIGKILL)
time.sleep(30)"""

# Makes the papermill process's own temporary folder read-only, so it cannot write what happened.
JAMS_EXECUTOR = """import glob, os, tempfile
jammed = []
for d in glob.glob(os.path.join(tempfile.gettempdir(), "scalelab-exec-*")):
    os.chmod(d, 0o500)
    jammed.append(d)
record("jammed", len(jammed))"""


def _write(path: Path, nb: dict) -> None:
    path.write_text(json.dumps(nb))
    path.chmod(0o644)


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """One batch: the snoop, a classmate's correct notebook, a malformed record, a killed parent, a jammed
    executor, a killed parent whose executed notebook was made to look as if nothing had started, a lone surrogate
    in the notebook. The submissions and a readable copy of the course (mode 755, as on an ordinary grading host) sit in
    /srv, outside every temporary folder."""
    srv = Path(tempfile.mkdtemp(prefix="sl-attack-", dir="/srv" if os.access("/srv", os.W_OK) else None))
    srv.chmod(0o755)
    try:
        copy = fake_checkout(srv / "course-copy")
        (copy / "hidden_checks.py").write_text(PLANTED)
        (copy / "lab.yaml").write_text("title: a copy\n")
        (copy / "lab.yaml").chmod(0o644)
        subs = srv / "subs"
        subs.mkdir(mode=0o755)
        ex1, ex2 = make_fixtures.solved(make_fixtures.EX1), make_fixtures.solved(make_fixtures.EX2)
        _write(subs / "snoop.ipynb", make_fixtures.lab_cells(ex1, ex2, [SNOOP]))
        _write(subs / f"{CLASSMATE}.ipynb", make_fixtures.lab_cells(ex1, ex2))
        _write(subs / "malformed_record.ipynb", make_fixtures.lab_cells(ex1, ex2, [MALFORMED_RECORD]))
        _write(subs / "kills_parent.ipynb", make_fixtures.lab_cells(ex1, ex2, [KILLS_PARENT]))
        _write(subs / "jams_executor.ipynb", make_fixtures.lab_cells(ex1, ex2, [JAMS_EXECUTOR]))
        _write(subs / "forges_unstarted.ipynb", make_fixtures.lab_cells(ex1, ex2, [FORGES_UNSTARTED]))
        lone = make_fixtures.lab_cells(ex1, ex2)  # a "\udc80" escape is valid JSON, and no UTF-8 text can hold it
        lone["cells"][0]["source"] = "LONE"
        (subs / "lone_surrogate.ipynb").write_text(json.dumps(lone).replace('"LONE"', '"a lone \\udc80 surrogate"'))
        out, stdout = tmp_path_factory.mktemp("attacks") / "grades", io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = main(["grade", str(LAB), *sorted(map(str, subs.glob("*.ipynb"))), "-j", "2", "--out", str(out),
                         "--json", "--cell-timeout", "120", "--total-timeout", "240"])
        data = json.loads(stdout.getvalue())
        yield {"code": code, "out": out, "by": {r["student"]: r for r in data["results"]}, "srv": srv}
    finally:
        shutil.rmtree(srv, ignore_errors=True)


def _records(attacked, student: str) -> dict:
    from scalelab.grade.untrusted import tolerant_records
    nb = json.loads((attacked["out"] / attacked["by"][student]["notebook"]).read_text())
    return tolerant_records(nb)[0]


def test_a_walk_of_the_whole_file_system_finds_no_hidden_check_course_copy_or_classmate(attacked):
    r = attacked["by"]["snoop"]
    found = _records(attacked, "snoop")["found"]
    assert found == {"hidden_checks": [], "lab_yaml": [], "git": [], "notebooks": [], "classmate": [],
                     "unreadable": found["unreadable"]}, found
    listing = _records(attacked, "snoop")["root_listing"]
    needed_tops = {Path(p).parts[1] for p in needed_paths()}  # a Python under /root (pyenv) brings /root/<it>
    assert not {"root", "home", "srv", "opt", "mnt", "boot"} - needed_tops & set(listing), listing  # absent
    assert str(attacked["srv"]) not in json.dumps(found)
    assert (r["status"], r["score"]) == ("ok", 8), r  # nothing stolen, nothing raised, full marks for the work


def test_no_hidden_check_or_classmates_text_reaches_any_report(attacked):
    bits = (make_fixtures.SECRET, PLANTED, "math.isclose", "_expected_mean")
    assert_nothing_leaks_into_reports(attacked["out"], bits)


def test_a_malformed_record_output_is_the_students_note_not_a_grader_error(attacked):
    r = attacked["by"]["malformed_record"]
    assert (r["status"], r["score"]) == ("ok", 8), r
    assert any("malformed record output was ignored" in n for n in r["notes"]), r["notes"]
    assert _records(attacked, "malformed_record")["after_the_malformed_one"] == 1


def test_a_lone_surrogate_in_the_notebook_is_graded_like_any_text(attacked):
    r = attacked["by"]["lone_surrogate"]
    assert (r["status"], r["score"]) == ("ok", 8), r  # was a grader_error: the grader could not write it back


@pytest.mark.parametrize("student", ["kills_parent", "jams_executor", "forges_unstarted"])
def test_a_kernel_that_kills_or_jams_its_parent_gets_its_own_status_without_internal_paths(attacked, student):
    r = attacked["by"][student]
    assert r["status"] == ("crashed" if student == "jams_executor" else "killed"), r
    # everything recorded before counts (the forger erased its own records)
    assert r["score"] == (0 if student == "forges_unstarted" else 8), r
    shown = json.dumps({k: r[k] for k in ("message", "execution", "notes")})
    for internal in ("scalelab-grade-", "scalelab-exec-", "job.json", "Traceback", "executor exited", "/work/",
                     str(attacked["out"])):
        assert internal not in shown, f"{internal!r} in what the student reads: {shown[:2000]}"


def test_the_batch_exits_0_when_only_the_submissions_misbehaved(attacked):
    assert {r["status"] for r in attacked["by"].values()} & {"grader_error"} == set(), \
        {s: (r["status"], r["message"][:300]) for s, r in attacked["by"].items()}
    assert attacked["code"] == 0
