"""The sandbox on this machine, with plain Python children (no kernel): each confinement proven by an attempt.

Most need root (the grader's intended mode); the unprivileged user-namespace fallback is tried as `nobody`.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from scalelab.grade.sandbox import (UID_RANGE, SandboxError, SandboxPlan, SandboxPolicy, blocking_ancestor,
                                    plan_sandbox)
from scalelab.grade.confine import confinement_leaks
from scalelab.grade.sandbox import verify_network_isolation
from scalelab.grade.reap import cleanup
from sandbox_helpers import _as_root, confined, fake_checkout, open_tmp, root_only  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "grading"))
import make_fixtures  # noqa: E402


CONNECT = """
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("127.0.0.1", {port})); print("connected")
except OSError as e:
    print("refused", e.errno)
"""


@root_only
def test_network_namespace_blocks_a_host_port_and_the_probe_would_see_a_leak():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        isolated = confined(SandboxPlan(netns="root"), CONNECT.format(port=port))
        open_ = confined(SandboxPlan(netns="none"), CONNECT.format(port=port))
    assert isolated.stdout.startswith("refused"), isolated.stderr
    assert open_.stdout.strip() == "connected"  # the same attempt does reach the host without the namespace
    assert verify_network_isolation("root")["isolated"] is True


def test_unprivileged_user_namespace_isolates_the_network_as_nobody():
    # Ask as an ordinary user (nobody) whether it can cut its own network: the fallback when not root.
    if os.geteuid() != 0:
        result = verify_network_isolation("user")
    else:  # become nobody the grader's way (the interpreter may sit under root's 0700 home)
        plan = plan_sandbox(SandboxPolicy(network=True, memory_mb=None), uid=65534)
        proc = confined(plan, "import json; from scalelab.grade.sandbox import verify_network_isolation as v\n"
                               "print(json.dumps(v('user')))")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
    if not result["isolated"]:
        pytest.skip(f"this kernel has no unprivileged user namespaces: {result['detail']}")
    assert "refused inside the sandbox" in result["detail"]


@root_only
def test_throwaway_uid_cannot_read_hidden_paths_or_roots_files(open_tmp):
    tmp_path = open_tmp
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "hidden_checks.py").write_text("SECRET")
    lonely = tmp_path / "single.txt"
    lonely.write_text("SECRET")
    for p in (tmp_path, lab):
        p.chmod(0o755)
    for p in (lab / "hidden_checks.py", lonely):
        p.chmod(0o644)
    code = f"""
    import os
    for p in ({str(lab / 'hidden_checks.py')!r}, {str(lonely)!r}, "/root/.bashrc", "/etc/shadow"):
        try:
            print(p, repr(open(p).read()[:6]))
        except OSError as e:
            print(p, type(e).__name__)
    print("uid", os.getuid())
    try:
        print("root listing", os.listdir("/root"))
    except OSError as e:
        print("root listing", type(e).__name__)
    """
    # The deny-list (as without root), private_tmp off: this test is about hiding named paths of the host's file
    # system (the lab sits in /tmp, which is private by default; a fresh root has none of them: see below)
    shown = confined(plan_sandbox(SandboxPolicy(memory_mb=None, private_tmp=False, fresh_root=False)), code)
    hidden = confined(plan_sandbox(SandboxPolicy(memory_mb=None, private_tmp=False, fresh_root=False,
                                                  hide=(str(lab), str(lonely)))), code)
    assert f"{lab / 'hidden_checks.py'} 'SECRET'" in shown.stdout  # readable unless hidden: the test can fail
    assert f"{lab / 'hidden_checks.py'} FileNotFoundError" in hidden.stdout, hidden.stderr
    assert f"{lonely} ''" in hidden.stdout  # a hidden single file reads as /dev/null
    assert "/etc/shadow PermissionError" in hidden.stdout
    # root's home: covered by an empty tmpfs when the interpreter lives there (pyenv), else closed (0700) to the uid
    assert ("/root/.bashrc FileNotFoundError" in hidden.stdout or "/root/.bashrc PermissionError" in hidden.stdout), \
        hidden.stdout
    uid = int(hidden.stdout.split("uid ")[1].split()[0])
    assert UID_RANGE[0] <= uid < UID_RANGE[1]


def test_memory_limit_stops_a_big_allocation():
    plan = SandboxPlan(memory_bytes=512 * 2**20, memory_via="rlimit")
    proc = confined(plan, "x = bytearray(2 * 2**30)\nprint('allocated')")
    assert "MemoryError" in proc.stderr and "allocated" not in proc.stdout


def _hopper(beat: Path) -> str:
    """The fixtures' pid-hopping daemon, beating into `beat` and printing "started" once it is off."""
    return make_fixtures.PID_HOPPER.replace("BEAT = None", f"BEAT = {str(beat)!r}").replace("DONE", 'print("started")')


def _beats(path: Path, wait: float) -> bool:
    """Whether the hopper's heartbeat file changes within `wait` seconds."""
    before = path.read_text() if path.exists() else None
    time.sleep(wait)
    return (path.read_text() if path.exists() else None) != before


def _of_uid(uid: int) -> list[int]:
    return [p.pid for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] and uid in p.info["uids"] and p.info["status"] != psutil.STATUS_ZOMBIE]


@root_only
def test_a_pid_hopping_daemon_dies_with_the_runs_pid_namespace(open_tmp):
    open_tmp.chmod(0o777)
    beat = open_tmp / "beat"
    plan = plan_sandbox(SandboxPolicy(memory_mb=None, workdir=str(open_tmp)))  # the run's folder: seen from here
    assert plan.pidns
    try:
        proc = confined(plan, _hopper(beat))
        assert proc.stdout.strip() == "started", proc.stderr
        assert beat.exists()  # it did hop inside the run
        alive = _beats(beat, 0.5)  # before any clean-up of ours: the namespace's end took the daemon with it
    finally:
        cleanup(plan)
    assert not alive and _of_uid(plan.uid) == []


@root_only
def test_cleanup_kills_a_pid_hopping_daemon_by_uid_until_none_is_left(open_tmp):
    open_tmp.chmod(0o777)
    beat = open_tmp / "beat"
    plan = plan_sandbox(SandboxPolicy(memory_mb=None))
    try:  # started as the run's uid outside any namespace: as if it had escaped the run's init and subreaper
        proc = subprocess.run([sys.executable, "-c", _hopper(beat)], user=plan.uid,
                              group=plan.gid, extra_groups=[], capture_output=True, text=True, timeout=60, cwd="/")
        assert proc.stdout.strip() == "started", proc.stderr
        assert _beats(beat, 0.5), "the daemon should be alive and hopping"
        cleanup(plan)
        assert not _beats(beat, 1.0)  # 50 hops' time, had one survived
        assert _of_uid(plan.uid) == []
    finally:
        cleanup(plan)


@root_only
def test_proc_shows_only_the_runs_own_processes():
    # A process on the host whose command line names a classmate: a run must not see it.
    witness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "classmate-alice-secret"])
    try:
        code = """
        import os
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
        lines = []
        for pid in pids:
            try:
                lines.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(bytes(1), b" ").decode())
            except OSError:
                pass
        print(len(pids), os.getpid())
        print(chr(10).join(lines))
        """
        inside = confined(plan_sandbox(SandboxPolicy(memory_mb=None)), code)
        unconfined = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    finally:
        witness.kill()
        witness.wait()
    assert "classmate-alice-secret" in unconfined.stdout  # the same look does see it on the host
    assert "classmate-alice-secret" not in inside.stdout, inside.stdout
    count, own_pid = map(int, inside.stdout.split("\n")[0].split())
    assert count <= 3 and own_pid <= 3, inside.stdout  # the init, the confined process and nothing else


@root_only
def test_fork_bomb_hits_the_process_limit():
    plan = plan_sandbox(SandboxPolicy(memory_mb=None, max_processes=20))
    code = """
    import os
    pids = []
    try:
        for _ in range(100):
            pid = os.fork()
            if pid == 0:
                null = os.open(os.devnull, os.O_RDWR); os.dup2(null, 1); os.dup2(null, 2)
                import time; time.sleep(3); os._exit(0)
            pids.append(pid)
    except OSError as e:
        print("stopped after", len(pids))
    """
    try:
        proc = confined(plan, code)
    finally:
        cleanup(plan)
    assert proc.stdout.startswith("stopped after"), proc.stderr
    assert int(proc.stdout.split()[-1]) < 20


def test_blocking_ancestor_finds_the_folder_others_cannot_enter(tmp_path):
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    (tmp_path / "a").chmod(0o700)
    tmp_path.chmod(0o755)
    assert blocking_ancestor(str(inner)) in (str(tmp_path / "a"), *map(str, tmp_path.parents))
    (tmp_path / "a").chmod(0o755)
    assert blocking_ancestor(str(inner)) != str(tmp_path / "a")


def test_plan_notes_what_this_machine_cannot_do():
    plan = plan_sandbox(SandboxPolicy(memory_mb=1024, own_user=False), cgroup_root=None)
    described = plan.describe()
    assert described["memory"].startswith("1024 MiB via")
    if plan.memory_via == "rlimit":
        assert any("RLIMIT_AS" in n for n in plan.notes)
    assert SandboxPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


@root_only
def test_grading_as_an_ordinary_user_works_and_says_what_it_could_not_do(open_tmp):
    # The grader itself runs as nobody here: no throwaway uid, network and hiding through a user namespace.
    open_tmp.chmod(0o777)
    sub = open_tmp / "subs" / "carol.ipynb"
    sub.parent.mkdir()
    sub.write_text("{not a notebook")
    sub.parent.chmod(0o777)
    lab = Path(__file__).parent / "fixtures" / "grading" / "labs" / "90_fixture"
    code = f"""
    import json
    from scalelab.grade.grader import GradeOptions, grade
    r = grade({str(lab)!r}, [{str(sub)!r}], {str(open_tmp / 'out')!r}, GradeOptions()).results[0]
    print(json.dumps({{"status": r.status, "message": r.message, "sandbox": r.sandbox}}))
    """
    plan = plan_sandbox(SandboxPolicy(network=True, memory_mb=None, private_tmp=False, fresh_root=False), uid=65534)
    proc = confined(plan, code, timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "malformed" and "not valid JSON" in result["message"]  # the sandbox was applied
    assert result["sandbox"]["user"] == "grader's user"
    assert any("not root" in n for n in result["sandbox"]["notes"])
    if result["sandbox"]["network"] != "not isolated":
        assert result["sandbox"]["network"] == "isolated (user namespace)"


@root_only
def test_hiding_works_without_root_through_a_user_namespace(open_tmp):
    (open_tmp / "lab").mkdir(mode=0o755)
    (open_tmp / "lab" / "hidden_checks.py").write_text("SECRET")
    (open_tmp / "lab" / "hidden_checks.py").chmod(0o644)
    # As nobody (a fresh interpreter, as the runner is): plan, confine, then try to read and to unmount.
    inner = f"""
import os, subprocess
from scalelab.grade.sandbox import SandboxPolicy, plan_sandbox
from scalelab.grade.confine import apply_sandbox
plan = plan_sandbox(SandboxPolicy(hide=({str(open_tmp / 'lab')!r},), memory_mb=None, private_tmp=False))
apply_sandbox(plan)
print("userns", plan.userns, "listing", os.listdir({str(open_tmp / 'lab')!r}))
print("umount", subprocess.run(["umount", {str(open_tmp / 'lab')!r}], capture_output=True).returncode)
"""
    outer = plan_sandbox(SandboxPolicy(network=True, memory_mb=None, private_tmp=False, fresh_root=False), uid=65534)
    proc = confined(outer, f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}])")
    if "userns False" in proc.stdout:
        pytest.skip("no unprivileged user namespaces on this kernel")
    assert "userns True listing []" in proc.stdout, proc.stderr
    assert "umount 0" not in proc.stdout


@root_only
def test_a_covered_checkout_shows_only_what_the_run_needs(open_tmp):
    # The checkout is covered whole: its labs (and any copy of them) vanish, the needed folder inside stays.
    lab = fake_checkout(open_tmp / "course")
    pkg = open_tmp / "course" / "pkg"
    pkg.mkdir(mode=0o755)
    (pkg / "mod.py").write_text("VALUE = 7\n")
    (pkg / "mod.py").chmod(0o644)
    policy = SandboxPolicy(memory_mb=None, cover=(str(open_tmp / "course"),), fresh_root=False,  # the deny-list
                           needed=(*json.loads(subprocess.check_output(
                               [sys.executable, "-c", "import json; from scalelab.grade.sandbox import needed_paths;"
                                " print(json.dumps(needed_paths()))"])), str(pkg)))
    plan = plan_sandbox(policy)
    assert plan.cover == [str(open_tmp / "course")] and str(pkg) in plan.expose
    code = f"""
    import os
    print("listing", sorted(os.listdir({str(open_tmp / 'course')!r})))
    print("pkg", open({str(pkg / 'mod.py')!r}).read().strip())
    print("hidden", os.path.exists({str(lab / 'hidden_checks.py')!r}))
    """
    proc = confined(plan, code)
    assert proc.returncode == 0, proc.stderr
    assert "listing ['pkg']" in proc.stdout and "pkg VALUE = 7" in proc.stdout and "hidden False" in proc.stdout


def _needed_here() -> list[str]:
    return json.loads(subprocess.check_output([sys.executable, "-c", "import json; from scalelab.grade.sandbox "
                                               "import needed_paths; print(json.dumps(needed_paths()))"]))


@root_only
def test_a_fresh_root_holds_only_the_allow_list(open_tmp, tmp_path):
    # A course copy other users may read, outside every temporary folder (/srv), and a checkout whose package
    # folder the run needs: the first is absent, the second shows only that folder. Under the deny-list (no path
    # named to hide) the same look finds the copy: the test can fail.
    srv = Path(tempfile.mkdtemp(prefix="sl-sbx-", dir="/srv" if os.access("/srv", os.W_OK) else None))
    srv.chmod(0o755)
    try:
        copy = fake_checkout(srv / "copy")
        lab = fake_checkout(open_tmp / "course")
        pkg = open_tmp / "course" / "pkg"
        pkg.mkdir(mode=0o755)
        (pkg / "mod.py").write_text("VALUE = 7\n")
        (pkg / "mod.py").chmod(0o644)
        job = open_tmp / "job"
        job.mkdir()
        job.chmod(0o777)
        code = f"""
        import json, os
        print(json.dumps({{"root": sorted(os.listdir("/")), "course": sorted(os.listdir({str(open_tmp / 'course')!r})),
                          "pkg": open({str(pkg / 'mod.py')!r}).read().strip(),
                          "copy": os.path.exists({str(copy / 'hidden_checks.py')!r}),
                          "lab": os.path.exists({str(lab / 'hidden_checks.py')!r}),
                          "etc": sorted(os.listdir("/etc")), "shadow": os.path.exists("/etc/shadow"),
                          "wrote": open(f"{job}/{{os.getuid()}}.txt", "w").write("ok")}}))
        """
        policy = dict(memory_mb=None, needed=(*_needed_here(), str(pkg)), workdir=str(job))
        fresh = confined(plan_sandbox(SandboxPolicy(**policy)), code)
        deny = confined(plan_sandbox(SandboxPolicy(**policy, fresh_root=False)), code)
    finally:
        shutil.rmtree(srv, ignore_errors=True)
    assert fresh.returncode == 0, fresh.stderr
    seen = json.loads(fresh.stdout)
    assert deny.returncode == 0, deny.stderr
    assert json.loads(deny.stdout)["copy"] is True  # the deny-list shows what it was not told about
    assert seen["copy"] is False and seen["lab"] is False and seen["shadow"] is False
    assert seen["course"] == ["pkg"] and seen["pkg"] == "VALUE = 7" and seen["wrote"] == 2
    assert set(seen["root"]) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "sys",
                                 "tmp", "var", "run", *(Path(p).parts[1] for p in _needed_here())}, seen["root"]
    assert not {"srv", "root", "home"} - {Path(p).parts[1] for p in _needed_here()} & set(seen["root"]), seen["root"]
    assert "passwd" in seen["etc"] and "ld.so.cache" in seen["etc"] and "munge" not in seen["etc"]


def test_a_fresh_roots_leak_check_names_what_is_beyond_the_list():
    # What the runner checks after pivoting: unapplied (here, on the host's root), everything beyond the list shows.
    plan = SandboxPlan(fresh_root=True, system=["/usr", "/etc/passwd"], private=["/tmp", "/var/tmp"],
                       devices=["/dev/null"])
    leaks = confinement_leaks(plan)
    assert "/etc/hostname" in leaks or "/etc/group" in leaks, leaks
    assert {"/srv", "/home", "/root", "/opt", "/var/lib"} & set(leaks), leaks
    assert "/usr" not in leaks and "/etc/passwd" not in leaks and "/dev/null" not in leaks


def test_confinement_leaks_names_a_hidden_path_still_readable(tmp_path):
    # What the runner checks after confining itself: unapplied, the plan's hidden folder and file both leak.
    lab = fake_checkout(tmp_path / "course")
    lonely = tmp_path / "answer.txt"
    lonely.write_text("42")
    plan = SandboxPlan(hide=[str(lab), str(lonely), str(tmp_path / "gone")], cover=[str(tmp_path / "course")],
                       expose=[str(tmp_path / "course" / "labs")])
    assert confinement_leaks(plan) == [str(lab), str(lonely), str(tmp_path / "course" / ".git"),
                                       str(tmp_path / "course" / "pyproject.toml")]
    assert confinement_leaks(SandboxPlan()) == []


@root_only
def test_a_needed_folder_others_cannot_enter_is_refused_with_what_to_do(open_tmp):
    closed = open_tmp / "venv"
    closed.mkdir(mode=0o700)
    with pytest.raises(SandboxError, match=r"venv is needed by every graded run.*chmod o\+rx"):
        plan_sandbox(SandboxPolicy(memory_mb=None, needed=(str(closed),)))


def test_hidden_paths_covers_every_checkout_and_keeps_what_runs_need(tmp_path):
    # The lab lives in one checkout, the runs import scalelab from another: both are covered, neither is lost.
    from scalelab.grade.job import hidden_paths
    from scalelab.course.lab import load_lab
    here = Path(__file__).resolve().parents[1]
    copy = tmp_path / "copy"
    shutil.copytree(here / "tests" / "fixtures" / "grading" / "labs" / "90_fixture", copy / "labs" / "90_fixture")
    (copy / ".git").mkdir()
    runs = tmp_path / "elsewhere"
    (runs / "scalelab").mkdir(parents=True)
    (runs / "scalelab" / "__init__.py").write_text("")
    (runs / "pyproject.toml").write_text("")
    base = tmp_path / "jobs"
    base.mkdir()
    hide, cover = hidden_paths(load_lab(copy / "labs" / "90_fixture"), [], tmp_path / "out", base, (),
                               [str(runs / "scalelab"), sys.prefix])
    assert str(copy) in hide and str(copy / "labs" / "90_fixture") in hide  # no needed path inside: hidden whole
    assert str(runs) in cover  # holds the runs' package: covered, the package bound back
    assert str(runs / "scalelab") not in hide and str(base) not in hide
