"""What the local cluster's slurmd runs around a course account's jobs: what a centre's cgroups do for real.

The local cluster tracks a job's processes through /proc (proctrack/linuxproc: there are no cgroups in a container
or on a laptop), so a process a student daemonises (`setsid`, a double fork) leaves the job's process tree and
survives `scancel` and the job's time limit — the hole a centre closes with proctrack/cgroup. Two scripts close it
here, written beside slurm.conf by `scalelab cluster up`:

- **Epilog** (root, on the job's node, after the job): `python -m scalelab.cluster.job_end epilog`. For a course
  account only (the group `COURSE_GROUP`, never root or a person's own account) it ends the job's *leftovers*:
  every process of the account that hangs from nothing alive but the account itself, this job's slurmstepd or
  init — a daemon orphaned by this job or an earlier one. A process under another live job's slurmstepd, under
  the hub (a local-mode server) or under any other process of another account is left alone. It always exits 0:
  a failing Epilog would drain the node.
- **TaskProlog** (the job's user, before each task, the batch script's included): a job or step that asked for no
  GPU gets `CUDA_VISIBLE_DEVICES` (and ROCm's `ROCR_VISIBLE_DEVICES`) set empty, so a CPU profile's job does not
  use the node's GPUs by default. Without cgroups' device constraint (cgroup.conf ConstrainDevices=yes at a
  centre) a process can still open /dev/nvidia* itself: the binding is advice here, enforcement there.
"""
from __future__ import annotations

import grp
import os
import pwd
import signal
import sys
import time
from pathlib import Path

COURSE_GROUP = "scalelab-students"
"""The group of the course accounts the hub creates: the only accounts whose leftovers an Epilog ends."""

TASK_PROLOG = """#!/bin/sh
# Written by scalelab (scalelab/cluster/job_end.py): a job or step that asked for no GPU sees none.
if [ -z "${SLURM_STEP_GPUS:-}${SLURM_JOB_GPUS:-}" ]; then
  echo "export CUDA_VISIBLE_DEVICES="
  echo "export ROCR_VISIBLE_DEVICES="
fi
"""


def epilog_script(python: str = sys.executable) -> str:
    """The Epilog slurmd runs as root: this module's `epilog` with the project's Python."""
    return ("#!/bin/sh\n# Written by scalelab (scalelab/cluster/job_end.py): end a course account's leftovers.\n"
            f"exec {python} -m scalelab.cluster.job_end epilog\n")


def install_scripts(epilog_path: Path, task_prolog_path: Path) -> None:
    """Write the Epilog and the TaskProlog (root's, 0755: slurmd refuses scripts others could change)."""
    for path, text in ((epilog_path, epilog_script()), (task_prolog_path, TASK_PROLOG)):
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o755)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)


def is_course_account(user: str) -> bool:
    """True for an account of the course group (primary or supplementary); never for root."""
    try:
        pw = pwd.getpwnam(user)
        group = grp.getgrnam(COURSE_GROUP)
    except KeyError:
        return False
    return pw.pw_uid != 0 and (pw.pw_gid == group.gr_gid or user in group.gr_mem)


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, real uid, command line) of a live process, or None (gone, or a zombie: its parent reaps it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None
    return int(fields["PPid"]), int(fields["Uid"].split()[0]), cmdline.strip()


def _processes() -> dict[int, tuple[int, int, str]]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None:
                found[int(entry)] = info
    return found


def leftovers(uid: int, job_id: str | int, procs: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    """Pids of `uid`'s processes that hang from nothing alive but `uid` itself, job `job_id`'s slurmstepd or
    init: what is left of that job, or of an earlier one, once its steps have ended."""
    procs = _processes() if procs is None else procs
    own_stepd = f"slurmstepd: [{job_id}."
    found = []
    for pid, (ppid, owner, _) in procs.items():
        if owner != uid:
            continue
        parent, orphan = ppid, True
        for _ in range(256):  # up the tree, past the account's own processes
            if parent <= 1 or parent not in procs:  # init (or a container's), or gone: nothing holds it
                break
            p_ppid, p_owner, p_cmd = procs[parent]
            if p_owner == uid:
                parent = p_ppid
                continue
            orphan = p_cmd.startswith(own_stepd)  # this job's step daemon (ending); anything else holds it
            break
        if orphan:
            found.append(pid)
    return sorted(found)


def end_leftovers(uid: int, job_id: str | int, rounds: int = 20) -> int:
    """SIGKILL the leftovers of `uid` (see `leftovers`), looking again after each round (a daemon may fork while it
    is being killed); returns how many were killed. Root only."""
    killed = 0
    for _ in range(rounds):
        pids = leftovers(uid, job_id)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


def epilog(env: dict | None = None) -> int:
    """The Epilog: end a course account's leftovers after its job; logs one line to stderr; always returns 0."""
    env = os.environ if env is None else env
    user, job = env.get("SLURM_JOB_USER", ""), env.get("SLURM_JOB_ID", "")
    try:
        uid = int(env.get("SLURM_JOB_UID", "-1"))
        if uid <= 0 or not user or not is_course_account(user):
            return 0
        killed = end_leftovers(uid, job)
        if killed:
            print(f"scalelab epilog: job {job} of {user}: ended {killed} leftover process(es)", file=sys.stderr)
    except Exception as e:  # never drain the node over this: say so in slurmd's log
        print(f"scalelab epilog: job {job} of {user}: {type(e).__name__}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["epilog"]:
        raise SystemExit("usage: python -m scalelab.cluster.job_end epilog")
    raise SystemExit(epilog())
