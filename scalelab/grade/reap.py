"""After a graded run (in the grader): end whatever of it is left, however it tried to stay.

`cleanup(plan, runner_pid)` kills the runner's tree (its PID namespace's init: everything inside dies with it),
then every process of the run's throwaway uid with `kill -KILL -1` run as that uid until none is left, then what
the run's cgroup still holds, and removes the cgroup. `scalelab.grade.sandbox` plans the confinement; this module
is its other end.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..run.procs import kill_every_process_of, kill_processes, uid_processes
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


def kill_uid(uid: int, gid: int | None = None, rounds: int = 50) -> int:
    """SIGKILL every process of the throwaway `uid` (root only), repeating until none is left; returns how many.
    Refuses a uid outside the grader's throwaway range (`run.procs.kill_every_process_of` does the killing)."""
    if not UID_RANGE[0] <= uid < UID_RANGE[1]:
        raise SandboxError(f"refusing to kill every process of uid {uid}: not a throwaway uid of the grader")
    try:
        return kill_every_process_of(uid, gid, rounds)
    except RuntimeError as e:
        raise SandboxError(str(e)) from None


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
