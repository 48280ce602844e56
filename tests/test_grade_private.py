"""The sandbox's private namespaces, each proven by an attempt: temporary folders, /run and the host daemons'
sockets in it, System V shared memory, the host name. All need root (the grader's intended mode)."""
from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

from scalelab.grade.sandbox import SandboxPolicy, plan_sandbox
from sandbox_helpers import _as_root, confined, fake_checkout, open_tmp, root_only  # noqa: F401 (fixtures)


@root_only
def test_private_tmp_hides_what_others_left_there_and_keeps_the_runs_own_folder(open_tmp):
    # A copy of the course left in /tmp by someone: invisible; the run's job folder (also in /tmp): writable.
    lab = fake_checkout(open_tmp / "stale-copy")
    job = open_tmp / "job"
    job.mkdir()
    job.chmod(0o777)  # the grader chowns it to the throwaway uid; any uid will do here
    plan = plan_sandbox(SandboxPolicy(memory_mb=None, workdir=str(job)))
    assert "/tmp" in plan.private and plan.writable == [str(job)]
    code = f"""
    import os
    print("stale", os.path.exists({str(lab / 'hidden_checks.py')!r}))
    open({str(job / 'out.txt')!r}, "w").write("mine")
    print("tmp", sorted(os.listdir("/tmp")), os.listdir({str(open_tmp)!r}))
    open("/tmp/scratch", "w").write("x")
    open("/dev/shm/scratch", "w").write("x")
    """
    proc = confined(plan, code)
    assert proc.returncode == 0, proc.stderr
    assert "stale False" in proc.stdout
    # /tmp shows the job's folder and what the run needs (the checkout scalelab is imported from, when that lies
    # in /tmp, as in CI); the open folder shows the job only, not the stale copy beside it
    needed_in_tmp = {Path(p).relative_to("/tmp").parts[0] for p in plan.expose if p.startswith("/tmp/")}
    listing = proc.stdout.split("tmp ", 1)[1]
    assert set(ast.literal_eval(listing.split("] ", 1)[0] + "]")) == {open_tmp.name} | needed_in_tmp, listing
    assert listing.rstrip().endswith("['job']"), listing
    assert (job / "out.txt").read_text() == "mine"  # written through the bind: it lands in the real folder
    assert not Path("/tmp/scratch").exists() and not Path("/dev/shm/scratch").exists()  # private ones are gone


SHM = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT = 0o1000
print("host segment seen", libc.shmget({host_key}, 0, 0) != -1)
seg = libc.shmget({run_key}, 4096, IPC_CREAT | 0o666)
print("run segment made", seg != -1)
"""


def _shm_keys() -> set[int]:
    out = subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout
    return {int(line.split()[0], 16) for line in out.splitlines() if line.startswith("0x")}


@root_only
def test_shared_memory_of_a_run_is_its_own_and_gone_after_it():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    host_key, run_key = 0x5C1A0001, 0x5C1A0002
    host_seg = libc.shmget(host_key, 4096, 0o1000 | 0o600)
    assert host_seg != -1
    try:
        proc = confined(plan_sandbox(SandboxPolicy(memory_mb=None)), SHM.format(host_key=host_key, run_key=run_key))
        assert "host segment seen False" in proc.stdout, proc.stdout + proc.stderr
        assert "run segment made True" in proc.stdout  # the control: the run could make one
        assert run_key not in _shm_keys(), "the run's segment outlived it on the host"
    finally:
        libc.shmctl(host_seg, 0, None)  # IPC_RMID
        if run_key in _shm_keys():  # only when the test failed: leave nothing behind
            subprocess.run(["ipcrm", "-M", hex(run_key)], capture_output=True)


@root_only
def test_private_temporary_folders_are_size_limited_and_lock_folders_are_private(open_tmp):
    (Path("/run/lock") / "scalelab-host-lock").write_text("host")
    code = """
    import errno
    try:
        with open("/dev/shm/big", "wb") as f:
            for _ in range(64):
                f.write(b"x" * 2**20)
        print("wrote 64 MiB")
    except OSError as e:
        print("full", errno.errorcode[e.errno])
    import os
    print("host lock seen", os.path.exists("/run/lock/scalelab-host-lock"))
    open("/var/lock/scalelab-run-lock", "w").write("run")
    print("run lock made")
    """
    try:
        proc = confined(plan_sandbox(SandboxPolicy(memory_mb=None, tmp_mb=16)), code)
        assert "full ENOSPC" in proc.stdout, proc.stdout + proc.stderr
        assert "host lock seen False" in proc.stdout and "run lock made" in proc.stdout
        assert not Path("/run/lock/scalelab-run-lock").exists(), "the run's lock file reached the host"
    finally:
        Path("/run/lock/scalelab-host-lock").unlink(missing_ok=True)
        Path("/run/lock/scalelab-run-lock").unlink(missing_ok=True)


@root_only
def test_a_run_has_a_host_name_of_its_own_that_resolves():
    # UTS namespace: the host's name is not the run's, and the run's resolves (gloo crashes on one that does not).
    proc = confined(plan_sandbox(SandboxPolicy(memory_mb=None)),
                     "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))")
    assert proc.stdout.split() == ["localhost", "127.0.0.1"], proc.stderr
    assert socket.gethostname() != "localhost"  # so the name inside did change


UNIX_CONNECT = """
import socket
for where in {wheres!r}:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(where); print("reached", repr(where), s.recv(16).decode())
    except OSError as e:
        print("unreachable", repr(where), type(e).__name__)
"""


@root_only
def test_a_host_daemons_unix_socket_in_run_is_out_of_reach():
    # D-Bus, journald, nscd and munge listen on sockets in /run, most of them 0666: a network namespace does not
    # cover a filesystem socket (an abstract one it does). The run's /run is its own, so neither is reachable.
    path = f"/run/scalelab-test-{os.getpid()}.sock"
    abstract = f"\0scalelab-test-{os.getpid()}"
    servers = []
    for where in (path, abstract):
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(where)
        srv.listen(4)
        servers.append(srv)
    os.chmod(path, 0o666)
    stop = threading.Event()

    def serve(srv):
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.sendall(b"host daemon")
            conn.close()
    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        wheres = [path, "/var/run" + path[len("/run"):], abstract]
        run = confined(plan_sandbox(SandboxPolicy(memory_mb=None)), UNIX_CONNECT.format(wheres=wheres))
        assert run.stdout.count("unreachable") == 3, run.stdout + run.stderr
        # the control: the same throwaway user, with the host's /run and network, reaches both
        shared = confined(plan_sandbox(SandboxPolicy(memory_mb=None, private_tmp=False, network=True,
                                                      fresh_root=False)),
                          UNIX_CONNECT.format(wheres=[path, abstract]))
        assert shared.stdout.count("reached") == 2 and "host daemon" in shared.stdout, shared.stdout + shared.stderr
        assert "uid" not in run.stderr and run.returncode == 0, run.stderr
    finally:
        stop.set()
        for s in servers:
            s.close()
        Path(path).unlink(missing_ok=True)


# Files of 8 MiB each, so the per-file RLIMIT_FSIZE is never what stops the run: only a cap on the folder does.
FILL = """import errno
written, stopped = 0, None
try:
    for i in range(12):
        with open(f"filler-{i}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * 2**20)
                f.flush()
                written += 1
except OSError as e:
    stopped = errno.errorcode[e.errno]
record("filled_mb", written)
record("stopped_by", stopped)"""


def _solved_with(path: Path, cell: str) -> Path:
    """The grading fixture lab, solved, with `cell` after its exercises, written to `path`."""
    import json
    sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "grading"))
    import make_fixtures
    ex1, ex2 = make_fixtures.solved(make_fixtures.EX1), make_fixtures.solved(make_fixtures.EX2)
    path.write_text(json.dumps(make_fixtures.lab_cells(ex1, ex2, [cell])))
    return path


def _mounts_under(folder: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(folder))]


@root_only
def test_a_run_that_fills_its_job_folder_stops_there_not_on_the_hosts_disk(open_tmp, tmp_path):
    # RLIMIT_FSIZE caps one file; a run writing file after file filled the workdir's disk (the host's /tmp) for
    # everyone until its time ran out. As root each job folder is a tmpfs of job_mb: the run gets ENOSPC there.
    from scalelab.grade.grader import GradeOptions, grade
    from scalelab.record import read_records
    sub = _solved_with(tmp_path / "filler.ipynb", FILL)
    import make_fixtures  # on the path now
    got = {}
    for name, cap in (("capped", 40), ("open", None)):  # the control: the same run on the workdir's filesystem
        batch = grade(make_fixtures.LAB, [sub], tmp_path / name, GradeOptions(job_mb=cap, workdir=str(open_tmp)))
        result = batch.results[0]
        got[name] = (result, read_records(tmp_path / name / "notebooks" / "filler.ipynb"))
        assert not _mounts_under(open_tmp), "a job folder's tmpfs outlived its run"
        assert not list(open_tmp.glob("scalelab-grade-*/*")), "a job folder outlived its run"
    (capped, capped_records), (open_, open_records) = got["capped"], got["open"]
    assert capped_records["stopped_by"] == "ENOSPC" and capped_records["filled_mb"] < 40, capped_records
    assert capped.sandbox["job_folder"] == "40 MiB tmpfs"
    assert capped.percent == open_.percent == 100, (capped.message, open_.message)  # the rest of it still graded
    assert open_records["stopped_by"] is None and open_records["filled_mb"] == 96, open_records
    assert open_.sandbox["job_folder"] == "on the workdir's filesystem, not capped"


KEEPSAKES = """
import os, stat
from scalelab.record import record
os.makedirs("kept/deep", exist_ok=True)
with open("kept/deep/result.txt", "w") as f:
    f.write("made in the run")
with open("kept/setuid", "w") as f:
    f.write("#!/bin/sh\\n")
os.chmod("kept/setuid", 0o4755)
os.mkfifo("kept/fifo")
os.symlink("/etc/shadow", "kept/shadow")
record("keepsakes", sorted(os.listdir("kept")))"""


@root_only
def test_a_kept_job_folder_ran_under_its_cap_and_is_copied_without_following_anything(open_tmp, tmp_path):
    # --keep-workdirs used to switch the job folder's tmpfs off, so a run kept for debugging ran under other limits
    # than the graded one. Now the run is capped and its folder copied to the disk after it: no link followed (the
    # copy of a link to /etc/shadow is a link), no FIFO (reading one would hang the grader), no set-user-ID bit.
    from scalelab.grade.grader import GradeOptions, grade
    from scalelab.record import read_records
    sub = _solved_with(tmp_path / "keeper.ipynb", KEEPSAKES)
    import make_fixtures  # on the path now
    batch = grade(make_fixtures.LAB, [sub], tmp_path / "out",
                  GradeOptions(job_mb=40, keep_workdirs=True, workdir=str(open_tmp)))
    result = batch.results[0]
    assert result.percent == 100, result.message
    assert read_records(tmp_path / "out" / "notebooks" / "keeper.ipynb")["keepsakes"] == \
        ["deep", "fifo", "setuid", "shadow"]  # all four were made in the (capped) run
    assert result.sandbox["job_folder"] == "40 MiB tmpfs, copied to the workdir's filesystem after the run"
    assert not _mounts_under(open_tmp), "a kept job folder's tmpfs outlived its run"
    [kept] = open_tmp.glob("scalelab-grade-*/keeper-*/work/kept")
    assert (kept / "deep" / "result.txt").read_text() == "made in the run"
    assert os.readlink(kept / "shadow") == "/etc/shadow" and (kept / "shadow").is_symlink()
    assert not (kept / "fifo").exists() and not (kept / "fifo").is_symlink()
    assert (kept / "setuid").stat().st_mode & 0o7777 == 0o755
    assert (kept / "deep" / "result.txt").stat().st_uid == result.sandbox["uid"]
    from scalelab.grade.report import read_records_file  # what the checks ran on, kept for the instructor
    seen = read_records_file(tmp_path / "out", "keeper")
    assert seen["keepsakes"] == ["deep", "fifo", "setuid", "shadow"] and "grader.runs" in seen
    assert seen["grader.workdir"] == str(kept.parent)


SLEEPER = """
from pathlib import Path
import time
Path("started").write_text("the run is under way")
time.sleep(600)"""


def _processes_of(uid: int) -> list[int]:
    import psutil
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]


@root_only
def test_a_grader_killed_mid_batch_leaves_nothing_once_the_next_one_starts(open_tmp, tmp_path):
    # A grader SIGKILLed mid-batch left its capped job folders mounted (a tmpfs each, in memory), its batch folder
    # and its run (the runner has a session of its own) behind, and no later grader cleaned them. Now each batch is
    # marked with its grader's pid and start time, and a grader starting in the same workdir ends, unmounts and
    # removes a batch whose grader is gone, and nothing else: a live grader's batch and a folder it did not mark stay.
    import signal
    import time
    from scalelab.grade.grader import GradeOptions, grade
    from scalelab.grade.job import cap_job_folder, job_base
    sub = _solved_with(tmp_path / "sleeper.ipynb", SLEEPER)
    import make_fixtures  # on the path now
    prog = ("import sys; from scalelab.grade.grader import GradeOptions, grade; "
            "grade(sys.argv[1], [sys.argv[2]], sys.argv[3], GradeOptions(job_mb=40, workdir=sys.argv[4], "
            "cell_timeout_s=600, total_timeout_s=600))")
    dead = subprocess.Popen([sys.executable, "-c", prog, str(make_fixtures.LAB), str(sub), str(tmp_path / "dead"),
                             str(open_tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not list(open_tmp.glob("scalelab-grade-*/sleeper-*/work/started")):
        assert dead.poll() is None, dead.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.5)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    [left] = open_tmp.glob("scalelab-grade-*")
    [job] = [p for p in left.glob("sleeper-*") if p.is_dir()]
    run_uid = job.stat().st_uid
    assert _mounts_under(left) == [str(job)] and _processes_of(run_uid), "the killed grader left nothing to clean"
    # Beside it: a live grader's batch (marked by this process, its job folder mounted) and an unmarked folder.
    live = job_base(str(open_tmp), sandbox=True)
    (live / "busy-abcdefgh").mkdir()
    assert cap_job_folder(live / "busy-abcdefgh", 8)
    (live / "busy-abcdefgh" / "file").write_text("a live run's")
    unmarked = open_tmp / "scalelab-grade-unmarked"
    (unmarked / "job-abcdefgh").mkdir(parents=True)
    try:
        sub_ok = _solved_with(tmp_path / "next.ipynb", "x = 1")
        batch = grade(make_fixtures.LAB, [sub_ok], tmp_path / "next", GradeOptions(job_mb=40, workdir=str(open_tmp)))
        assert batch.results[0].percent == 100, batch.results[0].message  # the next batch grades as ever
        assert not left.exists() and not _mounts_under(left), "the dead grader's batch outlived the next start"
        assert batch.reaped == [left]
        deadline = time.monotonic() + 30  # SIGKILLed processes leave the table a moment later on a loaded machine
        while _processes_of(run_uid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes_of(run_uid), "the dead grader's run still runs"
        assert _mounts_under(live) == [str(live / "busy-abcdefgh")]  # the live batch: untouched
        assert (live / "busy-abcdefgh" / "file").read_text() == "a live run's"
        assert (unmarked / "job-abcdefgh").is_dir()  # not marked by a grader: not ours to remove
    finally:
        from scalelab.grade.reap import kill_uid
        kill_uid(run_uid)  # a failed test leaves no run behind either
        for point in _mounts_under(open_tmp):
            subprocess.run(["umount", "-l", point], check=False)
