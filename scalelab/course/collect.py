"""The instructor's week: collect a lab from every student's home, and return the feedback there.

    homes = {"alice": Path("/home/alice"), "bob": Path("/home/bob")}
    report = collect("labs/01_single_device", homes, Path("build/collected/01_single_device"), deadline=deadline)
    # scalelab grade labs/01_single_device build/collected/01_single_device/*/ --out build/grades/01_single_device
    return_feedback("01_single_device", homes, {"alice": Path("build/grades/01_single_device/feedback/alice.html")})

`scalelab course collect|return|gradebook` are the commands (`scalelab.cli.course`); the homes come from the hub's
settings there.

Homes belong to students, and the instructor (root, usually) reads and writes them, so:

- **collect** reads each file with `read_beneath`: no symbolic link anywhere below the home is followed, only
  regular files with one hard link are read, at most 32 MiB each. A planted link (`lab.ipynb -> /etc/shadow`, or a
  classmate's file) is refused and reported, never copied. Each student's files land in `OUT/<student>/`, the
  folder form `scalelab grade` takes (the notebook and the student's own versions of the lab's modules), and
  `OUT/collected.json` says what was found: when each notebook was last modified, and whether after the deadline.
  The modification time is the student's file's: a student can set it back. Collect at the deadline to take a
  snapshot that no later edit changes; a later collect into the same folder keeps that snapshot and reports the
  changed copy as late (`keep_on_time`).
- **return** writes `feedback.html` into the student's copy of the lab *as the home's owner* (a child process with
  the owner's uid and gid), so a link a student planted can only lead where that student may write anyway.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import UntrustedFileError
from ..paths import read_beneath
from .lab import CHECKS, NOTEBOOK, SETTINGS, GradingError, student_files

MANIFEST = "collected.json"
MAX_FILE_BYTES = 32 * 2**20
FEEDBACK = "feedback.html"


@dataclass
class Collected:
    """What collect found for one student."""

    student: str
    status: str
    """'collected', 'kept' (the on-time snapshot kept; a changed copy came late), 'missing' or 'refused'."""
    files: list[str] = field(default_factory=list)
    modified: str | None = None
    """When the student's notebook was last modified (ISO 8601, UTC): the file's own time, set by the student."""
    late: bool = False
    """Modified after the deadline (or changed after an on-time snapshot)."""
    note: str = ""
    sha256: str | None = None
    """Of the collected notebook."""


def collect(lab_dir: str | Path, homes: dict[str, Path], out: str | Path, *, labs_dest: str = "labs",
            deadline: datetime | None = None, keep_on_time: bool = True) -> list[Collected]:
    """Copy lab `lab_dir`'s student files from each home's `labs_dest/<lab>/` into `out/<student>/`."""
    lab_dir, out = Path(lab_dir), Path(out)
    names = [rel for rel in student_files(lab_dir)
             if rel.name not in (CHECKS, SETTINGS) and rel.suffix in (".ipynb", ".py")]
    if Path(NOTEBOOK) not in names:
        raise GradingError(f"{lab_dir} has no {NOTEBOOK}: is it a lab folder?")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # students' work: only the instructor who collected it reads it
    previous = {c["student"]: c for c in _read_manifest(out)}
    found = []
    for student, home in sorted(homes.items()):
        found.append(_collect_one(lab_dir.name, student, Path(home), names, out, labs_dest, deadline,
                                  previous.get(student) if keep_on_time else None))
    manifest = {"lab": lab_dir.name, "collected_at": _iso(time.time()),
                "deadline": deadline.isoformat() if deadline else None, "students": [asdict(c) for c in found]}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.replace(out / MANIFEST)
    return found


def _collect_one(lab: str, student: str, home: Path, names: list[Path], out: Path, labs_dest: str,
                 deadline: datetime | None, before: dict | None) -> Collected:
    base = Path(labs_dest) / lab
    try:
        data = {rel: read_beneath(home, base / rel, MAX_FILE_BYTES, single_link=True) for rel in [Path(NOTEBOOK)]}
    except UntrustedFileError as e:
        missing = "No such file" in str(e) or not home.is_dir()
        return Collected(student, "missing" if missing else "refused",
                         note=f"{base / NOTEBOOK}: not collected ({_short(e)})")
    except OSError as e:  # the home itself: missing, or not a folder
        return Collected(student, "missing", note=f"{home}: {e.strerror}")
    notes = []
    for rel in names:
        if rel == Path(NOTEBOOK):
            continue
        try:
            data[rel] = read_beneath(home, base / rel, MAX_FILE_BYTES, single_link=True)
        except UntrustedFileError as e:
            if "No such file" not in str(e):
                notes.append(f"{rel}: not collected ({_short(e)})")
    mtime = _mtime(home / base / NOTEBOOK)
    digest = hashlib.sha256(data[Path(NOTEBOOK)]).hexdigest()
    late = bool(deadline and mtime is not None and mtime > deadline.timestamp())
    if before and not before.get("late") and before.get("status") in ("collected", "kept") and \
            before.get("sha256") != digest and deadline and time.time() > deadline.timestamp():
        # The on-time snapshot stays what is graded; the changed copy is kept beside it as late work.
        target = out / student / "late"
        _write_files(target, data)
        return Collected(student, "kept", before.get("files", []), before.get("modified"), late=True,
                         note=f"changed after the deadline: the on-time copy is graded, the late one is in "
                              f"{student}/late/", sha256=before.get("sha256"))
    _write_files(out / student, data)
    return Collected(student, "collected", sorted(r.as_posix() for r in data),
                     _iso(mtime) if mtime is not None else None, late, "; ".join(notes), digest)


def _write_files(target: Path, data: dict[Path, bytes]) -> None:
    if target.exists():
        import shutil
        shutil.rmtree(target)
    for rel, content in data.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_bytes(content)


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _short(e: Exception) -> str:
    return str(e).split(": ", 1)[-1][:200]


def _read_manifest(out: Path) -> list[dict]:
    try:
        data = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        return [s for s in data.get("students", []) if isinstance(s, dict) and "student" in s]
    except (OSError, ValueError, AttributeError):
        return []


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 date or time ('2026-12-01', '2026-12-01T17:00', with or without a zone; no zone: local time)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise GradingError(f"deadline {text!r} is not an ISO 8601 date or time: write e.g. 2026-12-01T17:00 "
                           "(local time) or 2026-12-01T17:00+01:00") from None
    return when if when.tzinfo else when.astimezone()


# -- return -------------------------------------------------------------------------------------------------------

_WRITER = """import os, sys
rel = sys.argv[1]
data = sys.stdin.buffer.read()
folder, name = os.path.split(rel)
os.makedirs(folder, exist_ok=True)
tmp = os.path.join(folder, "." + name + ".tmp")
with open(tmp, "wb") as f:
    f.write(data)
os.replace(tmp, rel)
"""


class OwnerError(GradingError):
    """A home that cannot be written as its owner (missing, not a folder, or root's)."""


def owner_python(module: str, *args: str) -> list[str]:
    """The command that runs `module`'s main(argv) in a student's home without importing anything from it: with
    `python -m` the home would come first on the import path, so a planted scalelab/ there would run instead."""
    code = f"import sys; del sys.path[0]; from {module} import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, *args]


def printable(text: str) -> str:
    """What a student's process said, safe to print on the instructor's terminal (no escape sequences)."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def run_as_owner(home: Path, argv: list[str], stdin: bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `argv` in `home` as the home's owner (uid and gid, no other groups) when we are root, else as
    ourselves: whatever it writes can only go where that owner may write, links planted in the home included.
    A Python `argv` must not import from the home (start it with `owner_python`): the student owns what is there."""
    try:
        info = os.stat(home, follow_symlinks=False)
    except OSError as e:
        raise OwnerError(f"{home}: {e.strerror}") from None
    if not os.path.isdir(home) or os.path.islink(home):
        raise OwnerError(f"{home} is not a folder")
    owner = {}
    if os.geteuid() == 0:
        if info.st_uid == 0:
            raise OwnerError(f"{home} belongs to root: nothing is written into it as root")
        owner = {"user": info.st_uid, "group": info.st_gid, "extra_groups": []}
    # A session of its own: no controlling terminal, so nothing it starts can read or type into the instructor's
    # (a root shell, often); a daemon it leaves behind cannot open /dev/tty either.
    return subprocess.run(argv, input=stdin, cwd=home, capture_output=True, timeout=timeout, start_new_session=True,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
                               "HOME": str(home)}, **owner)


@dataclass
class Returned:
    """Where one student's feedback went, or why it did not."""

    student: str
    path: str | None
    note: str = ""


def return_feedback(lab: str, homes: dict[str, Path], feedback: dict[str, Path], *,
                    labs_dest: str = "labs") -> list[Returned]:
    """Write each student's feedback page to `<home>/<labs_dest>/<lab>/feedback.html`, as the home's owner."""
    done = []
    for student, home in sorted(homes.items()):
        page = feedback.get(student)
        if page is None or not Path(page).is_file():
            done.append(Returned(student, None, "no feedback for this student (not graded?)"))
            continue
        rel = Path(labs_dest) / lab / FEEDBACK
        try:
            r = run_as_owner(home, [sys.executable, "-c", _WRITER, str(rel)], Path(page).read_bytes())
        except OwnerError as e:
            done.append(Returned(student, None, str(e)))
            continue
        if r.returncode:
            err = r.stderr.decode(errors="replace").strip().splitlines()
            done.append(Returned(student, None, f"not written: {err[-1] if err else f'exit {r.returncode}'}"))
        else:
            done.append(Returned(student, str(home / rel)))
    return done


__all__ = ["Collected", "Returned", "OwnerError", "collect", "return_feedback", "run_as_owner", "owner_python",
           "printable", "parse_deadline", "MANIFEST", "FEEDBACK"]
