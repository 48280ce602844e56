"""The confined side of a grading run: what `python -m scalelab.grade.runner` does to itself before any student
code exists in it (the threat model and the plan are in `scalelab.grade.sandbox`, the grader's side).

`apply_sandbox(plan)` unshares namespaces, covers and hides paths, brings up a private loopback, sets limits,
drops to the throwaway uid and sets no-new-privileges; then `confinement_leaks(plan)` must find nothing, or the
run refuses to start. `probe_main` is the child of `sandbox.verify_network_isolation`.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import socket
import struct
from pathlib import Path

from .sandbox import SandboxError, SandboxPlan, blocking_ancestor, inside

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER, CLONE_NEWIPC = 0x00020000, 0x40000000, 0x10000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise SandboxError(f"{name}{args!r} failed: {os.strerror(e)} (errno {e})")


def apply_sandbox(plan: SandboxPlan) -> None:
    """Confine this process (and all it will start) as `plan` says; raises SandboxError if a step fails."""
    _call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the run come back to us, not to init
    if plan.cgroup:
        Path(plan.cgroup, "cgroup.procs").write_text(str(os.getpid()))
    mounts = bool(plan.hide or plan.cover or plan.expose or plan.private)
    flags = (CLONE_NEWNET if plan.netns in ("root", "user") else 0) | (CLONE_NEWNS if mounts else 0)
    uid, gid = os.getuid(), os.getgid()
    if plan.userns or plan.netns == "user":
        flags |= CLONE_NEWUSER
    if flags:  # allowed to make namespaces: System V shared memory, semaphores and queues of the run's own too,
        flags |= CLONE_NEWIPC  # gone with its last process (nothing left on the host, nothing of others seen)
        _call("unshare", flags)
    if flags & CLONE_NEWUSER:
        _map_ids(uid, gid)
    if flags & CLONE_NEWNS:
        _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)  # our mounts must not leak to the host
        _expose(plan.expose, plan.cover, blocking=plan.uid is not None, private=plan.private,
                writable=plan.writable, tmp_bytes=plan.tmp_bytes)
        _hide(plan.hide)
    if flags & CLONE_NEWNET:
        loopback_up()
    _limits(plan)
    if plan.uid is not None:
        os.setgroups([])
        os.setgid(plan.gid)
        os.setuid(plan.uid)
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    leaks = confinement_leaks(plan) if mounts else []
    if leaks:
        raise SandboxError(f"hidden paths are still visible after confinement: {leaks[:5]}"
                           f"{' ...' if len(leaks) > 5 else ''}; the submission was not run")


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
    for c in plan.cover + plan.private:
        allowed = {Path(p).relative_to(c).parts[0] for p in plan.expose + plan.writable if inside(p, c)}
        try:
            extra = sorted(set(os.listdir(c)) - allowed)
        except OSError:
            continue
        leaks += [os.path.join(c, name) for name in extra]
    return leaks


def probe_main(plan_json: str, port: int) -> None:
    """Child side of `verify_network_isolation`: confine, then try the host's port."""
    apply_sandbox(SandboxPlan.from_dict(json.loads(plan_json)))
    with socket.socket() as s:
        s.settimeout(3)
        try:
            s.connect(("127.0.0.1", port))
            print("connected")
        except OSError as e:
            print("blocked" if e.errno in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, None)
                  or isinstance(e, socket.timeout) else f"error {e}")


__all__ = ["apply_sandbox", "confinement_leaks", "loopback_up", "probe_main"]
