"""Confine one submission's run: a throwaway user, no network, hidden paths, memory and process limits.

The grader (parent) works out a `SandboxPlan` from a `SandboxPolicy` with `plan_sandbox()`: what this machine
allows, with a note for everything it does not. The sandboxed process (`scalelab.grade.runner`) calls
`apply_sandbox(plan)` on itself *before* any student code exists in it; everything it starts afterwards — the
papermill child, the kernel, whatever the kernel starts — inherits the confinement.

As root (the intended way to run a batch):

- own user: a fresh, unused uid/gid per submission (no passwd entry needed), so submissions cannot signal,
  trace or read each other, cannot read root's files, and `PR_SET_NO_NEW_PRIVS` stops setuid programs;
- network: a new network namespace with only its own loopback up (the kernel's ZMQ sockets need it); a TCP
  connect to a port the host listens on fails. `verify_network_isolation()` proves this on the machine;
- hidden paths: a new mount namespace where each hidden folder is covered by an empty read-only tmpfs and
  each hidden file by /dev/null (the lab's reference folder, hidden checks, the repository's .git, other
  students' submissions, the grading output);
- memory: a cgroup v2 `memory.max` (+ `pids.max`) when a writable cgroup2 with the memory controller exists,
  else RLIMIT_AS per process; always RLIMIT_NPROC (per uid), RLIMIT_FSIZE, no core files.

Not root: network isolation through an unprivileged user namespace when the kernel allows one, RLIMIT_AS; the
student's code runs as the grader's own user, so hiding and process separation are best effort (noted).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ScalelabError

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
UID_RANGE = (1_000_000_000, 1_500_000_000)  # far above any site's real accounts


class SandboxError(ScalelabError):
    """The sandbox could not be set up as planned (the submission is not run unconfined instead)."""


@dataclass
class SandboxPolicy:
    """What the grader asks for; `plan_sandbox` works out what this machine allows."""

    memory_mb: int | None = 4096
    """Memory limit of the run (cgroup: whole run; RLIMIT_AS: per process). None: no limit."""
    network: bool = False
    """Allow network access (False: a new network namespace where the OS allows one)."""
    own_user: bool = True
    """As root: run each submission as a fresh throwaway uid."""
    hide: tuple[str, ...] = ()
    """Paths the submission must not see (folders get an empty tmpfs, files /dev/null)."""
    max_processes: int = 256
    """Processes the run may have at once (RLIMIT_NPROC per throwaway uid; pids.max with a cgroup)."""
    max_file_mb: int = 2048
    """Largest file the run may write (RLIMIT_FSIZE)."""


@dataclass
class SandboxPlan:
    """What the sandboxed process applies to itself (JSON-ready: it crosses a process boundary)."""

    uid: int | None = None
    """Throwaway uid/gid to switch to (root only); None: stay the grader's user."""
    gid: int | None = None
    netns: str = "none"
    """'root' (new network namespace), 'user' (user + network namespace, not root) or 'none'."""
    userns: bool = False
    """Not root: enter a user namespace first (what lets an ordinary user make network and mount namespaces)."""
    hide: list[str] = field(default_factory=list)
    expose: list[str] = field(default_factory=list)
    """Paths the throwaway uid needs (the interpreter) under a folder it may not enter (e.g. /root, mode 700)."""
    memory_bytes: int | None = None
    memory_via: str = "none"
    """'cgroup2', 'rlimit' or 'none'."""
    cgroup: str | None = None
    """cgroup v2 folder created for this run (joined by the sandboxed process, removed by `cleanup`)."""
    max_processes: int | None = None
    max_file_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    """What could not be applied on this machine, and why (shown to the instructor with every result)."""

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SandboxPlan":
        """Inverse of `to_dict`."""
        return cls(**data)

    def describe(self) -> dict:
        """Short summary for results: user, network, memory, hidden paths, notes."""
        return {"user": "own uid" if self.uid is not None else "grader's user",
                "network": {"root": "isolated (network namespace)", "user": "isolated (user namespace)",
                            "none": "not isolated"}[self.netns],
                "memory": f"{self.memory_bytes // 2**20} MiB via {self.memory_via}" if self.memory_bytes else "none",
                "hidden_paths": len(self.hide), "notes": list(self.notes)}


# -- planning (in the grader) ------------------------------------------------------------------------------------

def plan_sandbox(policy: SandboxPolicy, *, uid: int | None = None, cgroup_root: str | None = None) -> SandboxPlan:
    """The plan for one run under `policy` on this machine; `uid` overrides the throwaway uid picked."""
    root = os.geteuid() == 0
    plan = SandboxPlan(hide=[os.path.realpath(p) for p in policy.hide if os.path.lexists(p)],
                       max_processes=policy.max_processes, max_file_bytes=policy.max_file_mb * 2**20)
    if root and policy.own_user:
        plan.uid = plan.gid = uid if uid is not None else free_uid()
        plan.expose = [p for p in needed_paths() if blocking_ancestor(p) is not None]
    elif policy.own_user:
        plan.notes.append("not root: the submission runs as the grader's own user (it can read what that user "
                          "can, including hidden checks on disk; hiding paths is best effort)")
    if not root:
        userns_ok = verify_network_isolation("user")["isolated"]  # also proves user namespaces work here
        if plan.hide and not userns_ok:
            plan.hide = []
            plan.notes.append("no user namespaces here: paths cannot be hidden from the submission")
        plan.userns = userns_ok and bool(plan.hide or not policy.network)
    if not policy.network:
        mode = "root" if root else "user"
        check = verify_network_isolation(mode)
        if check["isolated"]:
            plan.netns = mode
        else:
            plan.notes.append(f"network NOT isolated: {check['detail']}")
    if policy.memory_mb:
        plan.memory_bytes = int(policy.memory_mb) * 2**20
        base = cgroup_root or (cgroup2_base() if root else None)
        if base:
            plan.cgroup, plan.memory_via = _make_cgroup(base, plan), "cgroup2"
        elif gpu_devices():
            plan.memory_via = "none"  # CUDA reserves far more address space than it uses: RLIMIT_AS breaks it
            plan.notes.append("GPU node without a writable cgroup v2 memory controller: memory NOT limited "
                              "(RLIMIT_AS would stop CUDA from initialising)")
        else:
            plan.memory_via = "rlimit"
            plan.notes.append("no writable cgroup v2 with the memory controller: memory limited per process "
                              "(RLIMIT_AS), not for the run as a whole")
    return plan


def needed_paths() -> list[str]:
    """What any run needs to read: the interpreter's installation, the environment, this package."""
    here = Path(__file__).resolve().parents[2]
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, here,
                                           os.path.dirname(os.path.realpath(sys.executable)))}
    # Keep the outermost only: binding a folder brings its subfolders along.
    return sorted(p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths))


def blocking_ancestor(path: str) -> str | None:
    """The outermost folder on `path` that other users may not enter (no o+x), or None."""
    current = Path("/")
    for part in Path(path).parts[1:]:
        current = current / part
        try:
            if current.is_dir() and not current.stat().st_mode & 0o001:
                return str(current)
        except OSError:
            return None
    return None


def gpu_devices() -> list[str]:
    """NVIDIA device files on this machine (/dev/nvidia0, ...)."""
    return sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))


_HANDED_OUT: set[int] = set()  # uids given to runs of this grader: two threads never share one


def free_uid() -> int:
    """A uid no account and no running process uses (a fresh one per run, so runs cannot touch each other)."""
    import pwd
    import psutil
    used = set(_HANDED_OUT)
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"]:
            used.update(p.info["uids"])
    for _ in range(100):
        uid = random.randrange(*UID_RANGE)
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if uid not in used:
                _HANDED_OUT.add(uid)
                return uid
    raise SandboxError(f"found no free uid in {UID_RANGE}")


def cgroup2_base() -> str | None:
    """A cgroup v2 folder where a child with the memory controller can be created, or None."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    for line in mounts:
        parts = line.split()
        if len(parts) < 3 or parts[2] != "cgroup2":
            continue
        base = Path(parts[1])
        own = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::")), "/")
        for cand in (base / own.lstrip("/"), base):
            if _cgroup_memory_ok(cand):
                return str(cand)
    return None


def _cgroup_memory_ok(cand: Path) -> bool:
    try:
        if "memory" not in (cand / "cgroup.subtree_control").read_text().split():
            (cand / "cgroup.subtree_control").write_text("+memory +pids")
        return "memory" in (cand / "cgroup.subtree_control").read_text().split() and os.access(cand, os.W_OK)
    except OSError:
        return False


def _make_cgroup(base: str, plan: SandboxPlan) -> str:
    path = Path(base) / f"scalelab-grade-{os.getpid()}-{random.randrange(16**8):08x}"
    path.mkdir()
    (path / "memory.max").write_text(str(plan.memory_bytes))
    for name, value in (("memory.swap.max", "0"), ("pids.max", str(plan.max_processes or "max"))):
        if (path / name).exists():
            (path / name).write_text(value)
    return str(path)


# -- applying (in the sandboxed process, before any student code) ------------------------------------------------

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
    flags = (CLONE_NEWNET if plan.netns in ("root", "user") else 0) | (CLONE_NEWNS if plan.hide or plan.expose else 0)
    uid, gid = os.getuid(), os.getgid()
    if plan.userns or plan.netns == "user":
        flags |= CLONE_NEWUSER
    if flags:
        _call("unshare", flags)
    if flags & CLONE_NEWUSER:
        _map_ids(uid, gid)
    if flags & CLONE_NEWNS:
        _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)  # our mounts must not leak to the host
        _expose(plan.expose)
        _hide(plan.hide)
    if flags & CLONE_NEWNET:
        loopback_up()
    _limits(plan)
    if plan.uid is not None:
        os.setgroups([])
        os.setgid(plan.gid)
        os.setuid(plan.uid)
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _map_ids(uid: int, gid: int) -> None:
    # Same ids inside as outside: the run keeps its user and loses the namespace's capabilities at its next exec.
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _expose(paths: list[str]) -> None:
    # Cover each blocking folder (e.g. /root) with an empty tmpfs, then bind back only the needed paths into it:
    # the throwaway uid reaches the interpreter and nothing else of that folder.
    tops = {p: blocking_ancestor(p) for p in paths}  # worked out before any tmpfs changes the answer
    fds = {p: os.open(p, os.O_PATH) for p in paths}  # opened before they disappear under the tmpfs
    covered = set()
    try:
        for p, fd in fds.items():
            top = tops[p]
            if top is None:
                continue
            if top not in covered:
                _call("mount", b"tmpfs", os.fsencode(top), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=755")
                covered.add(top)
            os.makedirs(p, mode=0o755, exist_ok=True)
            _call("mount", os.fsencode(f"/proc/self/fd/{fd}"), os.fsencode(p), None, MS_BIND | MS_REC, None)
            _call("mount", None, os.fsencode(p), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        for top in covered:
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


# -- after the run (in the grader) -------------------------------------------------------------------------------

def cleanup(plan: SandboxPlan, runner_pid: int | None = None) -> int:
    """Kill whatever of the run is left (by throwaway uid, cgroup, runner tree); remove the cgroup. Returns count."""
    import psutil
    victims = {}
    if plan.uid is not None:
        for p in psutil.process_iter(["uids"]):
            if p.info["uids"] and plan.uid in p.info["uids"]:
                victims[p.pid] = p
    if plan.cgroup and Path(plan.cgroup, "cgroup.procs").exists():
        for pid in Path(plan.cgroup, "cgroup.procs").read_text().split():
            victims.setdefault(int(pid), _proc(int(pid)))
    if runner_pid is not None:
        runner = _proc(runner_pid)
        if runner is not None:
            for p in [runner, *_children(runner)]:
                victims.setdefault(p.pid, p)
    procs = [p for p in victims.values() if p is not None and p.pid != os.getpid()]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    if plan.cgroup:
        for _ in range(50):  # the kernel frees a cgroup a moment after its last process exits
            try:
                os.rmdir(plan.cgroup)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
    return len(procs)


def _proc(pid):
    import psutil
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _children(proc):
    import psutil
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


# -- proving the network is cut ----------------------------------------------------------------------------------

_NET_CACHE: dict[str, dict] = {}


def verify_network_isolation(mode: str) -> dict:
    """Start a process confined with `mode` ('root'|'user') and have it connect to a port this host listens on.

    Returns {"isolated": bool, "detail": str}; cached per mode for the life of the grader process.
    """
    if mode in _NET_CACHE:
        return _NET_CACHE[mode]
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        plan = SandboxPlan(netns=mode)
        code = "import sys; from scalelab.grade.sandbox import _probe_main; _probe_main(sys.argv[1], int(sys.argv[2]))"
        try:
            proc = subprocess.run([sys.executable, "-c", code, json.dumps(plan.to_dict()), str(port)],
                                  capture_output=True, text=True, timeout=60)
            answer = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        except subprocess.TimeoutExpired:
            answer = "probe timed out"
        if answer == "blocked":
            result = {"isolated": True, "detail": f"connect to host port 127.0.0.1:{port} refused inside the sandbox"}
        elif answer == "connected":
            result = {"isolated": False, "detail": f"a {mode} namespace was made but the host port was reachable"}
        else:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1] if answer != "probe timed out" else answer
            result = {"isolated": False, "detail": f"no {mode} network namespace here ({err})"}
    _NET_CACHE[mode] = result
    return result


def _probe_main(plan_json: str, port: int) -> None:
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


__all__ = ["SandboxPolicy", "SandboxPlan", "SandboxError", "plan_sandbox", "apply_sandbox", "cleanup", "gpu_devices",
           "verify_network_isolation", "free_uid", "cgroup2_base", "loopback_up"]
