"""After a graded run (in the grader): end whatever of it is left, however it tried to stay.

`cleanup(plan, runner_pid)` kills the runner's tree (its PID namespace's init: everything inside dies with it),
then every process of the run's throwaway uid with `kill -KILL -1` run as that uid until none is left, then what
the run's cgroup still holds, and removes the cgroup. `scalelab.grade.sandbox` plans the confinement; this module
is its other end.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from ..run.procs import kill_processes
from .sandbox import UID_RANGE, SandboxError, SandboxPlan


def cleanup(plan: SandboxPlan, runner_pid: int | None = None) -> int:
    """Kill whatever of the run is left (runner tree, cgroup, throwaway uid); remove the cgroup. Returns count.

    The runner tree goes first: killing the run's init ends its PID namespace and everything in it. Then every
    process of the throwaway uid, with kill(-1) *as that uid* until none is left: one system call reaches them
    all at once, so a daemon that keeps forking (its pid changing all the time) cannot slip through a list.
    """
    killed = 0
    if runner_pid is not None:
        runner = _proc(runner_pid)
        if runner is not None:
            killed += kill_processes([runner, *_children(runner)], grace_s=0, tree=False)
    victims = {}
    if plan.uid is not None and UID_RANGE[0] <= plan.uid < UID_RANGE[1]:
        killed += kill_uid(plan.uid, plan.gid)
    elif plan.uid is not None:  # a uid given by hand (tests): only what a list finds
        victims.update((pid, _proc(pid)) for pid in uid_processes(plan.uid))
    if plan.cgroup and Path(plan.cgroup, "cgroup.procs").exists():
        for pid in Path(plan.cgroup, "cgroup.procs").read_text().split():
            victims.setdefault(int(pid), _proc(int(pid)))
    killed += kill_processes([p for p in victims.values() if p is not None], grace_s=0, tree=False)
    if plan.cgroup:
        for _ in range(50):  # the kernel frees a cgroup a moment after its last process exits
            try:
                os.rmdir(plan.cgroup)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
    return killed


def uid_processes(uid: int) -> list[int]:
    """Pids of every live process with `uid` as its real, effective or saved uid (zombies are dead already: only
    their parent's wait removes them, and an orphan's parent is the machine's init)."""
    import psutil
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        if p.info["uids"] and uid in p.info["uids"] and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def kill_uid(uid: int, gid: int | None = None, rounds: int = 50) -> int:
    """SIGKILL every process of the throwaway `uid` (root only), repeating until none is left; returns how many.

    `kill -KILL -1` (procps) run *as* `uid` signals every process that uid may signal, all in one pass of the kernel over
    the process table (no fork can slip in while it runs). Never call it with a uid anyone else uses.
    """
    if not UID_RANGE[0] <= uid < UID_RANGE[1]:
        raise SandboxError(f"refusing to kill every process of uid {uid}: not a throwaway uid of the grader")
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
    raise SandboxError(f"processes of uid {uid} survive {rounds} rounds of SIGKILL: {uid_processes(uid)[:10]}")


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


__all__ = ["cleanup", "kill_uid", "uid_processes"]
