"""Confine one submission's run: a throwaway user, no network, hidden paths, memory and process limits.

The grader (parent, this module) works out a `SandboxPlan` from a `SandboxPolicy` with `plan_sandbox()`: what
this machine allows, with a note for everything it does not, and `reap.cleanup()` ends what a run left. The sandboxed
process (`scalelab.grade.runner`) calls `scalelab.grade.confine.apply_sandbox(plan)` on itself *before* any student code exists in it; everything it starts afterwards — the
papermill child, the kernel, whatever the kernel starts — inherits the confinement.

As root (the intended way to run a batch):

- own user: a fresh, unused uid/gid per submission (no passwd entry needed), so submissions cannot signal,
  trace or read each other, cannot read root's files, and `PR_SET_NO_NEW_PRIVS` stops setuid programs;
- network: a new network namespace with only its own loopback up (the kernel's ZMQ sockets need it); a TCP
  connect to a port the host listens on fails. `verify_network_isolation()` proves this on the machine;
- a fresh root (allow-list, not deny-list): a new mount namespace whose root is an empty tmpfs holding only what
  the run needs (`pivot_root`, the host's root detached): the system's read-only files (/usr, /lib*, /bin, /sbin,
  /sys and a few files of /etc: `SYSTEM_PATHS`, `ETC_FILES`), a minimal /dev (`DEVICES`, GPUs), a /proc of its own
  PID namespace, the course's Python environment and package folders (`needed_paths`: the interpreter, the venv,
  scalelab's `scalelab/` and `widgets/`) read-only at their own paths, and its job folder read-write. Everything
  else of the host is not covered but absent: hidden checks, other checkouts and copies of the course, other
  submissions, /root, /home, /srv, /var/lib (the scheduler's state), the grading output;
- private temporary folders: /tmp, /var/tmp, /dev/shm and /run are fresh, empty tmpfs mounts of the run's own (as
  systemd's PrivateTmp), the job folder bound back inside, so no host daemon's Unix socket in /run is reachable;
- `plan.hide` (what `scalelab.grade.job.hidden_paths` names: the lab's reference folder and its siblings, the
  repository's .git, the submissions, the grading output) is what the run checks is gone once confined
  (`confinement_leaks`). Without the fresh root (not root, or `SandboxPolicy.fresh_root=False`) it is the old
  deny-list: each hidden folder is covered by an empty read-only tmpfs, each file by /dev/null, whole checkouts
  are covered with the needed folders bound back;
- disk: the job folder itself is a tmpfs of `GradeOptions.job_mb` (`job.cap_job_folder`, mounted by the grader),
  so writing file after file ends in ENOSPC there, not on the host's disk;
- after confining itself the run checks that every hidden path is gone and that its root holds only the
  allow-list (`confinement_leaks`), and refuses to start the notebook otherwise: a mount that did not take effect
  fails loudly instead of leaking;
- memory: a cgroup v2 `memory.max` (+ `pids.max`) when a writable cgroup2 with the memory controller exists,
  else RLIMIT_AS per process; always RLIMIT_NPROC (per uid), RLIMIT_FSIZE, no core files.

Not root: network isolation through an unprivileged user namespace when the kernel allows one, RLIMIT_AS; the
student's code runs as the grader's own user, and its file system is the host's with the hidden paths covered
(the deny-list), so hiding and process separation are best effort (noted).

What the fresh root does not hide: the whole of /usr, /sys (the machine's hardware and kernel settings), the listed
files of /etc (the account list in /etc/passwd among them), the venv, and the scalelab package folders. A copy of
the course kept under /usr or inside the venv is visible; keep private course files elsewhere.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ScalelabError
from ..machine import gpu_device_files

UID_RANGE = (1_000_000_000, 1_500_000_000)  # far above any site's real accounts
# /run too: the host daemons' sockets live there (D-Bus, journald, nscd, munge), and a filesystem socket, unlike
# an abstract one, is not behind the network namespace
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run")
PRIVATE_KEEP = {"/run": ("lock",)}  # empty folders (1777) a private one starts with: /var/lock links to /run/lock
# The fresh root's allow-list. The system's programs and libraries (read-only, at their own paths; a top-level link
# such as /lib -> usr/lib is made as the same link), and /sys (CPU counts, GPUs: glibc, torch and CUDA read it).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
# Of /etc only what programs read to run: accounts and name resolution (gloo resolves "localhost"), the dynamic
# linker's cache (without it no library in /usr/lib/<arch> is found), time zone, certificates, the alternatives
# that /usr/bin links through (cc, c++ for torch.compile), Debian's sitecustomize (python3*), MPI's defaults.
ETC_FILES = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "resolv.conf", "localtime",
             "timezone", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl", "ca-certificates", "alternatives",
             "mime.types", "os-release", "protocols", "services", "fonts", "mtab", "matplotlibrc", "openmpi",
             "python3", "python3.*")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""Device files of the fresh root's /dev (with every /dev/nvidia*: `device_paths`); /dev/shm is a private tmpfs."""


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
    cover: tuple[str, ...] = ()
    """Folders shown empty but for the needed paths inside them (the checkouts labs and packages live in)."""
    needed: tuple[str, ...] = ()
    """What the run must read (interpreter, venv, the scalelab it imports); empty: `needed_paths()` of this process."""
    private_tmp: bool = True
    """Give the run empty /tmp, /var/tmp, /dev/shm and /run (with an empty /run/lock) of its own (always so in a
    fresh root)."""
    fresh_root: bool = True
    """As root: the run's root holds only the allow-list (system files, `needed`, `workdir`), not the host's file
    system with `hide` covered (False: the deny-list, as without root)."""
    tmp_mb: int = 512
    """Size limit of each private temporary folder (tmpfs lives in memory: unbounded, it outgrows memory_mb)."""
    workdir: str | None = None
    """The run's own folder (job folder): stays visible and writable inside a private temporary folder."""
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
    pidns: bool = False
    """A PID namespace of the run's own, with its own /proc (root only): the run sees and signals only its own
    processes, and everything in it dies with its init."""
    hide: list[str] = field(default_factory=list)
    """Paths the run must not see: covered (deny-list), or simply absent from a fresh root (checked after it)."""
    fresh_root: bool = False
    """Pivot into a fresh root holding only `system`, `devices`, `expose` (read-only), `writable` and `private`."""
    system: list[str] = field(default_factory=list)
    """The system's read-only paths (and top-level links) of a fresh root, and the files of /etc it keeps."""
    devices: list[str] = field(default_factory=list)
    """Device files of a fresh root's /dev."""
    cover: list[str] = field(default_factory=list)
    """Folders covered by an empty tmpfs before the `expose` paths inside them are bound back."""
    expose: list[str] = field(default_factory=list)
    """Paths the run needs under a covered folder or one the throwaway uid may not enter (e.g. /root, mode 700)."""
    private: list[str] = field(default_factory=list)
    """Temporary folders replaced by an empty writable tmpfs (mode 1777)."""
    writable: list[str] = field(default_factory=list)
    """Folders bound back read-write into a private temporary folder (the job folder)."""
    tmp_bytes: int = 512 * 2**20
    """Size limit of each private temporary folder."""
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
        return {"user": "own uid" if self.uid is not None else "grader's user", "uid": self.uid,
                "network": {"root": "isolated (network namespace)", "user": "isolated (user namespace)",
                            "none": "not isolated"}[self.netns],
                "memory": f"{self.memory_bytes // 2**20} MiB via {self.memory_via}" if self.memory_bytes else "none",
                "processes": "own PID namespace" if self.pidns else "shared with the host",
                "file_system": ("fresh root: only the allow-list" if self.fresh_root else
                                "the host's, hidden paths covered" if self.hide or self.cover else "the host's"),
                "hidden_paths": len(self.hide), "covered_folders": len(self.cover), "notes": list(self.notes)}


# -- planning (in the grader) ------------------------------------------------------------------------------------

def plan_sandbox(policy: SandboxPolicy, *, uid: int | None = None, cgroup_root: str | None = None) -> SandboxPlan:
    """The plan for one run under `policy` on this machine; `uid` overrides the throwaway uid picked."""
    root = os.geteuid() == 0
    plan = SandboxPlan(hide=[os.path.realpath(p) for p in policy.hide if os.path.lexists(p)],
                       max_processes=policy.max_processes, max_file_bytes=policy.max_file_mb * 2**20)
    needed = [bind_target(p) for p in (policy.needed or needed_paths())]
    covers = sorted({os.path.realpath(c) for c in policy.cover if os.path.isdir(c)})
    plan.cover = [c for c in covers if any(inside(p, c) for p in needed)]
    plan.hide = sorted(set(plan.hide) | {c for c in covers if c not in plan.cover and
                                         not any(p == c or inside(c, p) for p in needed)})
    plan.tmp_bytes = policy.tmp_mb * 2**20
    if policy.private_tmp:
        plan.private = [t for t in PRIVATE_TMP if os.path.isdir(t) and not os.path.islink(t)
                        and not any(p == t or inside(t, p) for p in needed)]
        plan.writable = [bind_target(policy.workdir)] if policy.workdir and any(
            inside(bind_target(policy.workdir), t) for t in plan.private) else []
    plan.expose = [p for p in needed if any(inside(p, c) for c in plan.cover + plan.private)]
    plan.pidns = root  # /proc of a PID namespace can be mounted only where it is fully visible: root, here
    if root and policy.own_user:
        plan.uid = plan.gid = uid if uid is not None else free_uid()
        for p in needed:
            if blocking_ancestor(p) == os.path.realpath(p):
                raise SandboxError(f"{p} is needed by every graded run but other users may not enter it (mode "
                                   f"{os.stat(p).st_mode & 0o777:o}); each submission runs as a throwaway user: "
                                   f"chmod o+rx {p}, or grade with --no-sandbox on a machine you trust")
        plan.expose = sorted(set(plan.expose) | {p for p in needed if blocking_ancestor(p) is not None})
    elif policy.own_user:
        plan.notes.append("not root: the submission runs as the grader's own user (it can read what that user "
                          "can, including hidden checks on disk; hiding paths is best effort)")
    if root and policy.fresh_root:
        _plan_fresh_root(plan, policy, needed)
    if not root:
        userns_ok = verify_network_isolation("user")["isolated"]  # also proves user namespaces work here
        if (plan.hide or plan.cover or plan.private) and not userns_ok:
            plan.hide, plan.cover, plan.expose, plan.private, plan.writable = [], [], [], [], []
            plan.notes.append("no user namespaces here: paths cannot be hidden from the submission")
        plan.userns = userns_ok and bool(plan.hide or plan.cover or plan.private or not policy.network)
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


def _plan_fresh_root(plan: SandboxPlan, policy: SandboxPolicy, needed: list[str]) -> None:
    """The allow-list: the system's files, the needed paths, the job folder, private temporary folders; no cover."""
    plan.fresh_root = True
    plan.system = system_paths()
    plan.devices = device_paths()
    plan.cover = []
    plan.private = list(PRIVATE_TMP)
    plan.expose = sorted(p for p in needed if os.path.lexists(p)
                         and not any(p == s or inside(p, s) for s in plan.system))
    plan.writable = [bind_target(policy.workdir)] if policy.workdir else []


def system_paths() -> list[str]:
    """This machine's part of the fresh root's allow-list: `SYSTEM_PATHS` and /etc's `ETC_FILES` that exist."""
    import glob
    found = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    for pattern in ETC_FILES:
        found += sorted(glob.glob(os.path.join("/etc", pattern)))
    return sorted(set(found))


def device_paths() -> list[str]:
    """The fresh root's device files: `DEVICES` and every NVIDIA one (nvidiactl, nvidia-uvm, nvidia0, ...)."""
    found = [f"/dev/{d}" for d in DEVICES if os.path.exists(f"/dev/{d}")]
    return found + sorted(str(p) for p in Path("/dev").glob("nvidia*"))


def needed_paths() -> list[str]:
    """What a run of this interpreter needs to read: its installation, the environment, scalelab's package folders.

    Not the checkout scalelab lives in: only `scalelab/` and `widgets/` of it (with an editable install), so that
    the checkout can be covered and its labs and tests stay out of sight. A venv reached through a symbolic link
    is listed under both names (the link is what the interpreter's path goes through).
    """
    import importlib.util
    packages = [Path(__file__).resolve().parents[1]]
    spec = importlib.util.find_spec("scalelab.widgets")
    if spec is not None and spec.origin:
        packages.append(Path(spec.origin).resolve().parent)
    paths = {bind_target(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable), *packages)}
    paths |= {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable)))}
    # Keep the outermost only: binding a folder brings its subfolders along.
    return sorted(p for p in paths if not any(inside(p, q) for q in paths))


def runner_needed_paths(env: dict, cwd: str | Path, timeout: float = 120.0) -> list[str]:
    """`needed_paths()` as seen by a fresh run of this interpreter with `env` (what the runner and kernel import).

    The grader may import scalelab from elsewhere (e.g. the current folder) than its runs do (the venv's editable
    install): what must stay readable, and which checkout to cover, is decided by the runs' view.
    """
    code = "import json; from scalelab.grade.sandbox import needed_paths; print(json.dumps(needed_paths()))"
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        why = proc.stderr.strip()[-1500:]
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        why = str(e)
    raise SandboxError(f"{sys.executable} cannot import scalelab with the environment a submission gets (PATH, "
                       f"PYTHONPATH, VIRTUAL_ENV kept): {why}; grade from the course venv (make setup) or set "
                       "PYTHONPATH so that scalelab imports")


def bind_target(path: str | os.PathLike) -> str:
    """`path` with its folders' symbolic links resolved but not a link at its end: where a bind mount must go."""
    path = os.path.abspath(os.fspath(path))
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def inside(path: str, folder: str) -> bool:
    """Whether `path` lies strictly inside `folder` (by name)."""
    return path != folder and path.startswith(folder.rstrip("/") + "/")


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
    return list(gpu_device_files())


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
        code = "import sys; from scalelab.grade.confine import probe_main; probe_main(sys.argv[1], int(sys.argv[2]))"
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


__all__ = ["SandboxPolicy", "SandboxPlan", "SandboxError", "plan_sandbox", "gpu_devices", "system_paths", "device_paths",
           "verify_network_isolation", "free_uid", "cgroup2_base", "needed_paths", "runner_needed_paths", "bind_target",
           "blocking_ancestor", "inside"]
