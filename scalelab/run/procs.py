"""Process helpers every launcher, pool, grader and test hub shares: one copy each.

- `kill_processes`: end processes and all their descendants (SIGTERM, a grace period, then SIGKILL).
- `free_port`: a TCP port free on the loopback now (rendezvous, hubs under test).
- `scrub_env`: the environment minus an enclosing run's distributed variables.
- `describe_exit`: 'exit status 3' or 'killed by SIGKILL'.
- `is_peer_failure`: whether an error a rank saw was caused by *another* rank dying.
- `dies_with_this_process` / `exit_with_parent`: a run never outlives what started it, whatever ends that (a
  SIGKILL, a dead notebook kernel): a launcher process gets SIGTERM when its parent goes (the kernel's
  PR_SET_PDEATHSIG, through util-linux's setpriv), and a rank watches its own parent and ends itself when it is
  re-parented.

psutil is imported when a function needs it, so importing this module stays cheap (the grader, the CLI).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path


def alive(proc) -> bool:
    """True while a psutil.Process runs and is not a zombie."""
    import psutil
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_processes(procs, grace_s: float = 3.0, *, tree: bool = True) -> int:
    """End `procs` (psutil.Process, Popen or pid) and, with `tree`, all their descendants: SIGTERM, then SIGKILL
    whatever is left after `grace_s` (grace_s=0: SIGKILL at once). Returns how many processes were signalled."""
    import psutil
    family: dict[int, psutil.Process] = {}
    for p in procs:
        try:
            p = p if isinstance(p, psutil.Process) else psutil.Process(p if isinstance(p, int) else p.pid)
            # descendants first seen before any signal: a dying parent's children are re-parented away
            for q in [p, *(p.children(recursive=True) if tree else [])]:
                if q.pid != os.getpid():
                    family[q.pid] = q
        except psutil.Error:
            continue
    victims = [p for p in family.values() if alive(p)]
    left = victims
    if grace_s > 0:
        for p in left:
            _signal(p, signal.SIGTERM)
        _, left = psutil.wait_procs(left, timeout=grace_s)
    for p in left:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(left, timeout=max(grace_s, 5.0))
    return len(victims)


def _signal(p, sig) -> None:
    import psutil
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def dies_with_this_process(cmd: list[str]) -> list[str]:
    """`cmd` prefixed so that it gets SIGTERM when this process dies (setpriv --pdeathsig TERM).

    Only from the main thread: the kernel sends the signal when the *thread* that started the child ends, and a
    worker thread (a widget's sweep) may end long before the run. Elsewhere, or without setpriv, `cmd` as is."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return list(cmd)
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd]


def exit_with_parent(poll_s: float = 1.0, grace_s: float = 5.0) -> threading.Thread | None:
    """End this process (SIGTERM to itself, then exit after `grace_s`) once its parent is gone: a rank whose
    launcher, `scalelab run` or notebook kernel was killed is re-parented, and stops instead of training on."""
    parent = os.getppid()
    if parent == 1:
        return None  # started by init (a daemon): nothing to watch

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def describe_exit(code: int) -> str:
    """'exit status 3' or 'killed by SIGKILL' for a Popen return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


PORT_FLOOR = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port free on every address right now (for a rendezvous or a hub under test), picked at random below
    the kernel's ephemeral range. The caller binds it later; a port from bind(0) is ephemeral, so in between the
    kernel could give it to any connection on the machine (two test runs side by side hit EADDRINUSE in a rank's
    TCPStore). Below that range only another pick like this one can land on it (1 in ~12 000)."""
    import random
    low, _ = _ephemeral_range()
    top = low if low > PORT_FLOOR + 1000 else 65536
    for _ in range(200):
        port = random.randrange(PORT_FLOOR, top)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DISTRIBUTED_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "HOROVOD_", "TORCHELASTIC_")
DISTRIBUTED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "ROLE_RANK", "SCALELAB_RDZV_SECRET", "SCALELAB_RDZV_FD")


def scrub_env(env: dict | None = None) -> dict:
    """The parent environment minus the distributed variables of an enclosing run (a notebook under srun)."""
    env = dict(os.environ if env is None else env)
    for key in list(env):
        if (key.startswith(DISTRIBUTED_PREFIXES) or key in DISTRIBUTED_VARS) and key != "SLURM_CONF":
            del env[key]
    return env


def redirect_output(path) -> None:
    """Point this process's fds 1 and 2 at `path` (appending), so C++ output from gloo/NCCL/Horovod lands there too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# What a rank sees when *another* rank died (gloo, Horovod, NCCL, torch.distributed). A Run or a pool reports
# such an error only when no root cause is found.
PEER_FAILURE_PHRASES = ("Connection closed by peer", "Connection reset by peer", "Connection reset", "Broken pipe",
                        "Horovod has been shut down", "Socket Timeout", "Connection refused",
                        "NCCL communicator was aborted", "remote worker", "Read error")
# How long only a peer's connection error waits for the rank that died to show itself: a starved 2-core machine
# (CI with two test workers) has taken more than 3 s to let a dying rank's exit be seen.
PEER_GRACE_S = 10.0
PEER_FAILURE_TYPES = frozenset({"HorovodInternalError", "DistNetworkError", "DistBackendError"})


def is_peer_failure(exc: BaseException | str) -> bool:
    """True when the error (an exception, or its message) is a communication failure caused by a peer."""
    if isinstance(exc, BaseException):
        if {cls.__name__ for cls in type(exc).__mro__} & PEER_FAILURE_TYPES:
            return True
        exc = str(exc)
    return any(p in exc for p in PEER_FAILURE_PHRASES)


def uid_processes(uid: int) -> list[int]:
    """Pids of every live process with `uid` as its real, effective or saved uid (zombies are dead already: only
    their parent's wait removes them, and an orphan's parent is the machine's init)."""
    import psutil
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        if p.info["uids"] and uid in p.info["uids"] and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def kill_every_process_of(uid: int, gid: int | None = None, rounds: int = 50) -> int:
    """SIGKILL every process of `uid` (root only), repeating until none is left; returns how many were left after
    each round, summed (RuntimeError if some survive every round).

    `kill -KILL -1` (procps) run *as* `uid` signals every process that uid may signal, all in one pass of the kernel
    over the process table (no fork can slip in while it runs). Only for a uid that exists for one job alone: the
    grader's throwaway uids, a course account whose last server stopped.
    """
    import subprocess
    count = 0
    for _ in range(rounds):
        # Kill first, then look: a list of a hopping daemon's pids is out of date before it is finished, so an
        # empty look before the kill would prove nothing.
        subprocess.run(["kill", "-KILL", "-1"], user=uid, group=gid if gid is not None else uid,
                       extra_groups=[], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, cwd="/", timeout=30)
        time.sleep(0.05)
        left = uid_processes(uid)
        if not left:
            return count
        count += len(left)
    raise RuntimeError(f"processes of uid {uid} survive {rounds} rounds of SIGKILL: {uid_processes(uid)[:10]}")


__all__ = ["alive", "kill_processes", "dies_with_this_process", "exit_with_parent", "describe_exit", "free_port",
           "scrub_env", "is_peer_failure", "PEER_GRACE_S", "redirect_output", "uid_processes", "kill_every_process_of",
           "PEER_FAILURE_PHRASES"]
