"""The confined side of a grading run: what the runner (`scalelab.grade.runner`) does to itself before any student
code exists in it (the threat model and the plan are in `scalelab.grade.sandbox`, the grader's side).

`apply_sandbox(plan)` unshares namespaces, pivots into a fresh root holding only the allow-list (`_fresh_root`; or,
without it, covers and hides paths of the host's file system), brings up a private loopback, sets limits, drops to
the throwaway uid and sets no-new-privileges; then `confinement_leaks(plan)` must find nothing, or the run refuses
to start. `probe_main` is the child of `sandbox.verify_network_isolation`.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import resource
import socket
import stat
import struct
import sys
from pathlib import Path

from .sandbox import PRIVATE_KEEP, SandboxError, SandboxPlan, blocking_ancestor, inside

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x10000000, 0x08000000
CLONE_NEWPID, CLONE_NEWUTS = 0x20000000, 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
BUILD_AT = "/tmp"
"""Where the init builds the fresh root before pivoting into it: a tmpfs mounted over this folder, in the run's
own mount namespace only (every path it binds was opened before, so nothing is lost under it)."""
FRESH_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0", "/dev/stdout": "/proc/self/fd/1",
               "/dev/stderr": "/proc/self/fd/2", "/var/lock": "../run/lock"}
"""Symbolic links every fresh root has (as the host's /dev and /var have them)."""
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 36, 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise SandboxError(f"{name}{args!r} failed: {os.strerror(e)} (errno {e})")


def apply_sandbox(plan: SandboxPlan) -> None:
    """Confine this process's future as `plan` says: return only in the confined process; raises SandboxError.

    With a PID namespace (`plan.pidns`) the caller cannot enter it itself: it forks the namespace's init, waits
    for it and exits with the confined process's status, so the code after this call runs confined either way.
    """
    pid = start_sandboxed(plan)
    if pid:
        os._exit(wait_status(pid))


def start_sandboxed(plan: SandboxPlan, report_fd: int | None = None) -> int:
    """Fork the confined process, like `os.fork()`: 0 in it (confined as `plan` says), the init's pid in the caller.

    The caller keeps no confinement, its host namespaces and its uid (the grader's runner stays root and writes
    the outcome where the run cannot). The child is an *init*: it makes the namespaces, covers and hides paths
    and mounts a /proc of the new PID namespace, then forks the confined process (which drops to the throwaway uid
    and checks for leaks) and reaps every orphan until that process ends. When the init exits, the kernel kills
    every process left in its PID namespace, daemons that changed their pid included. Without a PID namespace
    the init is a child subreaper and kills what is left itself.

    A failure of the set-up is written as an outcome ({"status": "grader_error", ...}) to `report_fd` when
    given, and the init exits with status 70.
    """
    if plan.pidns:
        _call("unshare", CLONE_NEWPID)  # our next child is pid 1 of a new PID namespace; we stay where we are
    pid = os.fork()
    if pid:
        return pid
    try:
        role, code = _init(plan, report_fd)
    except BaseException as e:  # noqa: BLE001 - the init must never return into the caller's code
        _report_setup_failure(report_fd, e)
        os._exit(70)
    if role == "init":
        os._exit(code)
    return 0


def _init(plan: SandboxPlan, report_fd: int | None) -> tuple[str, int]:
    """The init's life: set up the namespaces, fork the confined process, reap until it ends.

    Returns ("init", exit code) in the init, ("worker", 0) in the confined process."""
    _call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the run come back to us, not to the host init
    if plan.cgroup:
        Path(plan.cgroup, "cgroup.procs").write_text("0")  # "0": the writer; its children are born inside
    _unshare_and_mount(plan)
    worker = os.fork()
    if worker == 0:
        try:
            _drop_privileges(plan)
        except BaseException as e:  # noqa: BLE001
            _report_setup_failure(report_fd, e)
            os._exit(70)
        return "worker", 0
    if report_fd is not None:
        os.close(report_fd)  # only the confined process may still write an outcome
    status = None
    while True:
        try:
            pid, st = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == worker:
            status = st
            if plan.pidns:
                break  # our exit ends the PID namespace: the kernel kills everything left in it
            _kill_descendants()
    return "init", (70 if status is None else _exit_code(status))


def _unshare_and_mount(plan: SandboxPlan) -> None:
    mounts = bool(plan.fresh_root or plan.hide or plan.cover or plan.expose or plan.private or plan.pidns)
    flags = (CLONE_NEWNET if plan.netns in ("root", "user") else 0) | (CLONE_NEWNS if mounts else 0)
    uid, gid = os.getuid(), os.getgid()
    if plan.userns or plan.netns == "user":
        flags |= CLONE_NEWUSER
    if flags:  # allowed to make namespaces: System V shared memory, semaphores and queues of the run's own too,
        flags |= CLONE_NEWIPC | CLONE_NEWUTS  # gone with its last process; and a host name of its own
        _call("unshare", flags)
    if flags & CLONE_NEWUSER:
        _map_ids(uid, gid)
    if flags & CLONE_NEWUTS:
        socket.sethostname("localhost")  # resolvable everywhere (gloo crashes on a name it cannot resolve)
    if flags & CLONE_NEWNS and plan.fresh_root:
        _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)  # our mounts must not leak to the host
        _fresh_root(plan)
    elif flags & CLONE_NEWNS:
        _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)  # our mounts must not leak to the host
        _expose(plan.expose, plan.cover, blocking=plan.uid is not None, private=plan.private,
                writable=plan.writable, tmp_bytes=plan.tmp_bytes)
        _hide(plan.hide)
        if plan.pidns:  # a /proc of our own PID namespace: the run sees its own processes only
            _call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    if flags & CLONE_NEWNET:
        loopback_up()


def _drop_privileges(plan: SandboxPlan) -> None:
    """In the confined process: limits, the throwaway uid, no new privileges, not dumpable; then the leak check."""
    _limits(plan)
    if plan.uid is not None:
        os.setgroups([])
        os.setgid(plan.gid)
        os.setuid(plan.uid)
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # Not dumpable: the run's other processes (same uid) can neither trace this one nor open its /proc files
    # (its file descriptors: the outcome pipe). A program it execs (the kernel) is dumpable again.
    _call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    leaks = confinement_leaks(plan) if (plan.fresh_root or plan.hide or plan.cover or plan.expose or
                                        plan.private) else []
    if leaks:
        raise SandboxError(f"hidden paths are still visible after confinement: {leaks[:5]}"
                           f"{' ...' if len(leaks) > 5 else ''}; the submission was not run")


def _report_setup_failure(report_fd: int | None, e: BaseException) -> None:
    import traceback
    message = f"the sandbox could not be set up: {e}" if isinstance(e, (SandboxError, OSError)) else (
        f"the sandbox could not be set up: {type(e).__name__}: {e}")
    sys.stderr.write(message + "\n" + traceback.format_exc())
    sys.stderr.flush()
    if report_fd is not None:
        with contextlib.suppress(OSError):
            os.write(report_fd, json.dumps({"status": "grader_error", "message": message}).encode())


def _kill_descendants() -> None:
    """Without a PID namespace: kill whatever of the run came back to us (subreaper), until nothing does."""
    import psutil
    for _ in range(50):
        left = psutil.Process().children(recursive=True)
        if not left:
            return
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def wait_status(pid: int) -> int:
    """Wait for child `pid`; its exit code (128 + signal when a signal ended it)."""
    while True:
        try:
            return _exit_code(os.waitpid(pid, 0)[1])
        except InterruptedError:
            continue


def _map_ids(uid: int, gid: int) -> None:
    # Same ids inside as outside: the run keeps its user and loses the namespace's capabilities at its next exec.
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _expose(paths: list[str], covers: list[str], blocking: bool, private: list[str] = (),
            writable: list[str] = (), tmp_bytes: int = 512 * 2**20) -> None:
    # Cover each covered checkout and each blocking folder (e.g. /root) with an empty read-only tmpfs, and each
    # private temporary folder with an empty writable one; then bind back only the needed paths (read-only) and
    # the run's own folder (read-write) into them: nothing else of those folders is reachable.
    binds = [(p, True) for p in paths] + [(w, False) for w in writable]
    tops = {}
    for p, _ in binds:  # worked out before any tmpfs changes the answer
        cands = [c for c in [*covers, *private] if inside(p, c)]
        if blocking and (closed := blocking_ancestor(p)):
            cands.append(closed)
        tops[p] = min(cands, key=len) if cands else None  # all are ancestors of p: the shortest is the outermost
    fds = {p: os.open(p, os.O_PATH) for p, _ in binds}  # opened before they disappear under the tmpfs
    covered = set(private)
    try:
        for t in private:
            _call("mount", b"tmpfs", os.fsencode(t), b"tmpfs", MS_NOSUID | MS_NODEV,
                  f"mode=1777,size={tmp_bytes}".encode())
            for name in PRIVATE_KEEP.get(t, ()):
                os.mkdir(os.path.join(t, name))
                os.chmod(os.path.join(t, name), 0o1777)
        for p, readonly in sorted(binds):
            top = tops[p]
            if top is None:
                continue
            if top not in covered:
                _call("mount", b"tmpfs", os.fsencode(top), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=755")
                covered.add(top)
            os.makedirs(p, mode=0o755, exist_ok=True)
            _call("mount", os.fsencode(f"/proc/self/fd/{fds[p]}"), os.fsencode(p), None, MS_BIND | MS_REC, None)
            if readonly:
                _call("mount", None, os.fsencode(p), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        for top in covered - set(private):
            _call("mount", None, os.fsencode(top), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    finally:
        for fd in fds.values():
            os.close(fd)


def _fresh_root(plan: SandboxPlan) -> None:
    """Build a root holding only the plan's allow-list and pivot into it; the host's root is detached, not covered.

    On an empty tmpfs: the private temporary folders (fresh tmpfs mounts), then every allowed path bound at its own
    path (system files, devices and the needed paths read-only, nosuid; devices and the job folder writable), the
    top-level links as links, a /proc of the run's PID namespace; then pivot_root, detach the old root, and make
    the new root itself read-only. Paths not on the list do not exist in the run at all.
    """
    links = {p: os.readlink(p) for p in plan.system + plan.expose if os.path.islink(p)}  # a venv reached by a link
    links.update({p: t for p, t in FRESH_LINKS.items() if p not in links})
    binds = [(p, "ro") for p in plan.system + plan.expose if p not in links]
    binds += [(p, "dev") for p in plan.devices] + [(p, "rw") for p in plan.writable]
    fds = {p: os.open(p, os.O_PATH | os.O_NOFOLLOW) for p, _ in binds}  # before any tmpfs can hide them
    new = BUILD_AT
    try:
        _call("mount", b"tmpfs", os.fsencode(new), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755")
        for t in plan.private:
            os.makedirs(new + t, mode=0o755, exist_ok=True)
            _call("mount", b"tmpfs", os.fsencode(new + t), b"tmpfs", MS_NOSUID | MS_NODEV,
                  f"mode=1777,size={plan.tmp_bytes}".encode())
            for name in PRIVATE_KEEP.get(t, ()):
                os.mkdir(os.path.join(new + t, name))
                os.chmod(os.path.join(new + t, name), 0o1777)
        for p, kind in sorted(binds):
            target = new + p
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            if stat.S_ISDIR(os.fstat(fds[p]).st_mode):
                os.makedirs(target, mode=0o755, exist_ok=True)
            elif not os.path.lexists(target):
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
            _call("mount", os.fsencode(f"/proc/self/fd/{fds[p]}"), os.fsencode(target), None, MS_BIND | MS_REC, None)
            if kind == "ro":
                _call("mount", None, os.fsencode(target), None,
                      MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    finally:
        for fd in fds.values():
            os.close(fd)
    for p, target in sorted(links.items()):
        os.makedirs(os.path.dirname(new + p), mode=0o755, exist_ok=True)
        if not os.path.lexists(new + p):
            os.symlink(target, new + p)
    os.makedirs(new + "/proc", mode=0o555, exist_ok=True)
    if plan.pidns:  # a /proc of our own PID namespace: the run sees its own processes only
        _call("mount", b"proc", os.fsencode(new + "/proc"), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.chdir(new)
    _pivot_root(b".", b".")  # the old root now sits on top of the new one, at "/": detach it
    _call("umount2", b".", MNT_DETACH)
    os.chdir("/")
    _call("mount", None, b"/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _pivot_root(new_root: bytes, put_old: bytes) -> None:
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SandboxError(f"pivot_root's system call number is not known for {platform.machine()}: grade with "
                           "a deny-list (SandboxPolicy.fresh_root=False) on this machine")
    if _libc.syscall(number, new_root, put_old) != 0:
        e = ctypes.get_errno()
        raise SandboxError(f"pivot_root failed: {os.strerror(e)} (errno {e})")


def _hide(paths: list[str]) -> None:
    for p in sorted(paths):
        if not os.path.lexists(p):
            continue  # inside a folder hidden just before
        target = os.fsencode(p)
        if os.path.isdir(p):
            _call("mount", b"tmpfs", target, b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=555")
        elif os.path.lexists(p):
            _call("mount", b"/dev/null", target, None, MS_BIND, None)
            _call("mount", None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)


def loopback_up() -> None:
    """Bring `lo` up in this (new) network namespace; nothing else exists there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _limits(plan: SandboxPlan) -> None:
    def cap(which, value):
        resource.setrlimit(which, (value, value))
    cap(resource.RLIMIT_CORE, 0)
    if plan.memory_via == "rlimit" and plan.memory_bytes:
        cap(resource.RLIMIT_AS, plan.memory_bytes)
    if plan.max_file_bytes:
        cap(resource.RLIMIT_FSIZE, plan.max_file_bytes)
    if plan.max_processes and plan.uid is not None:  # per uid: only meaningful for a throwaway uid
        cap(resource.RLIMIT_NPROC, plan.max_processes)


def confinement_leaks(plan: SandboxPlan) -> list[str]:
    """Hidden or covered paths this process can still read (what `apply_sandbox` checks last; [] when confined)."""
    leaks = []
    for p in plan.hide:
        try:
            if os.path.isdir(p) and os.listdir(p):
                leaks.append(p)
            elif os.path.isfile(p) and os.path.getsize(p) > 0:
                leaks.append(p)
        except OSError:
            pass  # cannot be read: hidden enough
    if plan.fresh_root:
        return leaks + _fresh_root_extras(plan)
    for c in plan.cover + plan.private:
        allowed = {Path(p).relative_to(c).parts[0] for p in plan.expose + plan.writable if inside(p, c)}
        allowed |= set(PRIVATE_KEEP.get(c, ()) if c in plan.private else ())
        try:
            extra = sorted(set(os.listdir(c)) - allowed)
        except OSError:
            continue
        leaks += [os.path.join(c, name) for name in extra]
    return leaks


def _fresh_root_extras(plan: SandboxPlan) -> list[str]:
    """What a fresh root shows beyond its allow-list: every folder made to hold an allowed path (/, /etc, the
    checkout holding the package folders, the private /tmp on the way to the job folder, ...) must hold exactly the
    names that lead to one."""
    allowed: dict[str, set[str]] = {}
    keep = [f"{t}/{name}" for t, names in PRIVATE_KEEP.items() for name in names]
    for p in [*plan.system, *plan.devices, *plan.expose, *plan.writable, *plan.private, *FRESH_LINKS, *keep, "/proc"]:
        parts = Path(p).parts
        for i in range(1, len(parts)):
            allowed.setdefault(str(Path(*parts[:i])), set()).add(parts[i])
    bound = set(plan.system + plan.devices + plan.expose + plan.writable)
    extras = []
    for folder, names in sorted(allowed.items()):
        if folder in bound or any(inside(folder, b) for b in bound):
            continue  # a bound folder shows the host's contents: it is on the list
        try:
            extras += [os.path.join(folder, n) for n in sorted(set(os.listdir(folder)) - names)]
        except OSError:
            extras.append(folder)
    return extras


def probe_main(plan_json: str, port: int) -> None:
    """Child side of `verify_network_isolation`: confine, then try the host's port."""
    apply_sandbox(SandboxPlan.from_dict(json.loads(plan_json)))  # returns in the confined process only
    with socket.socket() as s:
        s.settimeout(3)
        try:
            s.connect(("127.0.0.1", port))
            print("connected")
        except OSError as e:
            print("blocked" if e.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, None)
                  or isinstance(e, socket.timeout) else f"error {e}")


__all__ = ["apply_sandbox", "start_sandboxed", "wait_status", "confinement_leaks", "loopback_up", "probe_main"]
