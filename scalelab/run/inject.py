"""Instructor injection: a kill or a preemption, issued once by the instructor, felt by every student's run.

In the capstone's live challenge (lab 12: students race to a target accuracy) the instructor can make the runs
fail during the window, so recovery time counts:

    sudo scalelab course inject kill --window-s 300        # the last rank of every run is SIGKILLed
    sudo scalelab course inject preempt --lab 12_capstone  # every rank of the lab's runs gets SIGTERM

`issue` writes one JSON record to a *spool file* (the hub setting capstone.inject_file); every engine run whose
environment names that file in SCALELAB_INJECT_FILE stats it once per step (`InjectionWatch.due`, read again only
when it changed) and acts on a record once: when it is unexpired, was issued after that launch of the run started
(so the relaunch or restart after the failure does not fail again), and matches the run (its lab and rank).

Threat model. The spool file is the instructor's word to every student's run, so who can write it decides who can
kill a classmate's runs. `issue` refuses a link and a folder that group or others may write, and writes the record
0644 by an atomic rename: only its owner (root) can change it. A run reads it as untrusted data (`read`): no link
followed, a regular file of at most MAX_BYTES, owned by root or by the run's own account, in a folder and with a mode
nobody else may write, JSON with the right types; anything else is no record, never an exception, so a malformed,
huge or planted file cannot crash or steer a run. Not protected: a student's own runs (a student can unset the
variable, or point it at a file of their own: the challenge's evidence shows the recovery, or its absence) and a
root-owned file's content (root decides).
"""
from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import time
import uuid
from pathlib import Path

from ..errors import SpecError

ENV_VAR = "SCALELAB_INJECT_FILE"
"""The environment variable naming the spool file an engine run watches (unset: no watch, no cost)."""
KINDS = ("kill", "preempt")
"""kill: SIGKILL to the chosen rank, as a crashed node; preempt: SIGTERM to every rank, as a scheduler's preemption."""
MAX_BYTES = 4096
"""A spool file larger than this is no record (a record is ~200 bytes)."""
MAX_WINDOW_S = 7 * 24 * 3600.0
"""The longest window a record may stay in force."""


def issue(path: str | os.PathLike, kind: str, by: str = "", lab: str = "", rank: int = -1,
          window_s: float = 600.0) -> dict:
    """Write a new record to the spool file `path` (atomically, mode 0644) and return it."""
    if kind not in KINDS:
        raise SpecError("kind", f"got {kind!r}; choose one of {', '.join(KINDS)}")
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not math.isfinite(window_s) \
            or not 0 < window_s <= MAX_WINDOW_S:
        raise SpecError("window_s", f"got {window_s!r}; give the seconds the injection stays in force, "
                                    f"more than 0 and at most {MAX_WINDOW_S:g} (a week)")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < -1:
        raise SpecError("rank", f"got {rank!r}; give a rank >= 0, or -1 for each run's last rank")
    if not isinstance(lab, str) or "/" in lab or lab in (".", "..") or len(lab) > 255:
        raise SpecError("lab", f"got {lab!r}; give one folder name (e.g. 12_capstone) or '' for every run")
    path = Path(path)
    folder = _writable_folder(path)
    now = time.time()
    record = {"id": uuid.uuid4().hex, "kind": kind, "issued_at": now, "expires_at": now + float(window_s),
              "lab": lab, "rank": rank, "by": str(by)[:200]}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".inject-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a run reads the old record or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return record


def _writable_folder(path: Path) -> Path:
    """The spool file's folder, made 0755 if missing; SpecError for a link or a folder others may write."""
    if path.is_symlink():
        raise SpecError("path", f"{str(path)!r} is a symbolic link; the spool file must be a plain file (a link "
                                "would let whoever controls its target decide what every run reads): remove it, or "
                                "give another path")
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o755, parents=True)
        os.chmod(folder, 0o755)  # the umask may have taken bits away; runs of every account must read it
    mode = folder.stat().st_mode
    if mode & 0o022:
        raise SpecError("path", f"the folder {str(folder)!r} is writable by group or others (mode "
                                f"{stat.S_IMODE(mode):o}): anyone who can write there could replace the record and "
                                f"kill every student's runs; use a folder only root writes (chmod go-w {folder}, or "
                                "the default /var/lib/scalelab/)")
    if path.exists() and not path.is_file():
        raise SpecError("path", f"{str(path)!r} exists and is not a regular file; give a file path")
    return folder


def read(path: str | os.PathLike) -> dict | None:
    """The record in the spool file `path`, read as untrusted data; None for anything that is not a safe, well-formed
    record (missing, a link, not a regular file, too big, writable by others, bad JSON or types). Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError, TypeError):
        return None
    try:
        st = os.fstat(fd)
        if not _trusted(st) or st.st_size > MAX_BYTES or not _trusted(os.stat(os.path.dirname(
                os.path.abspath(path)) or "/")):
            return None
        data = os.read(fd, MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            return None
        return _record(json.loads(data.decode("utf-8")))
    except (OSError, ValueError, TypeError, RecursionError):
        return None
    finally:
        os.close(fd)


def _trusted(st: os.stat_result) -> bool:
    """A regular file or folder owned by root or by this account, that group and others cannot write."""
    kind_ok = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
    return kind_ok and st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _record(value) -> dict | None:
    """`value` as a record if every field has its type, else None."""
    if not isinstance(value, dict):
        return None
    times = [value.get(k) for k in ("issued_at", "expires_at")]
    rank = value.get("rank")
    if not (isinstance(value.get("id"), str) and 0 < len(value["id"]) <= 64 and value.get("kind") in KINDS
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in times)
            and isinstance(rank, int) and not isinstance(rank, bool) and rank >= -1
            and isinstance(value.get("lab", ""), str) and isinstance(value.get("by", ""), str)):
        return None
    return {"id": value["id"], "kind": value["kind"], "issued_at": float(times[0]), "expires_at": float(times[1]),
            "lab": value.get("lab", ""), "rank": rank, "by": value.get("by", "")}


class InjectionWatch:
    """One rank's watch on the spool file: `due(step)` returns a record once, when it is meant for this rank now."""

    def __init__(self, path: str | os.PathLike, launch_started_at: float, rank: int, world: int, output_dir: str):
        self.path = os.fspath(path)
        self.launch_started_at = launch_started_at
        self.rank, self.world = rank, world
        self.parts = set(Path(output_dir).resolve().parts)
        self._key: tuple | None = None  # (inode, size, mtime) of the file last read
        self._record: dict | None = None
        self._fired: set[str] = set()

    def due(self, step: int) -> dict | None:
        """The record to act on at this step, or None; a stat per call, the file read only when it changed."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
        except (OSError, ValueError):
            key = None
        if key != self._key:
            self._key, self._record = key, read(self.path) if key else None
        record = self._record
        if record is None or record["id"] in self._fired or not self._meant_for_us(record):
            return None
        self._fired.add(record["id"])
        return record

    def _meant_for_us(self, record: dict) -> bool:
        if not record["issued_at"] >= self.launch_started_at or time.time() > record["expires_at"]:
            return False  # issued before this launch (the relaunch after it), or its window is over
        if record["lab"] and record["lab"] not in self.parts:
            return False
        if record["kind"] == "preempt":
            return True
        target = self.world - 1 if record["rank"] == -1 or record["rank"] >= self.world else record["rank"]
        return self.rank == target


__all__ = ["ENV_VAR", "KINDS", "MAX_BYTES", "MAX_WINDOW_S", "issue", "read", "InjectionWatch"]
