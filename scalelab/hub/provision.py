"""Hand the course labs out: copy them into a student's home, never overwriting a student's work.

The rule, file by file (a manifest in ``~/.scalelab/labs-manifest.json`` remembers what was handed out):

- missing in the home (never handed out, or deleted by the student) → copied;
- identical to the course version → nothing to do;
- unchanged since it was handed out, and the course has a newer version → replaced by the new version;
- edited by the student (or not ours), and the course version differs → the course version is put *beside* it as
  ``<name> (course update <8 hex>).<ext>`` (e.g. ``lab (course update 3fa2c1d0).ipynb``); the student's file is
  never touched. The hex names the course version, so handing the same version out again changes nothing.

Symbolic links in the home are never followed (a student cannot make the hub write elsewhere), and files are
written atomically (temporary file + rename).

    python -m scalelab.hub.provision SOURCE HOME [--dest labs]     # what a job runs with labs.where: job
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..paths import student_labs_dir

MANIFEST = Path(".scalelab") / "labs-manifest.json"
DEFAULT_EXCLUDE = ("__pycache__", ".ipynb_checkpoints", "*.pyc", ".*", "hidden_*", "*_hidden.py", "solutions")


@dataclass
class ProvisionReport:
    """What one hand-out did, by path relative to the labs folder."""

    copied: list[str] = field(default_factory=list)
    """Missing, copied."""
    updated: list[str] = field(default_factory=list)
    """Unedited old versions replaced by the new course version."""
    beside: list[str] = field(default_factory=list)
    """New course versions put beside the student's edited file (the names written)."""
    unchanged: list[str] = field(default_factory=list)
    """Already up to date, or edited with no newer course version."""
    refused: list[str] = field(default_factory=list)
    """Not written because a symbolic link was in the way."""


def source_candidates(root: Path | None = None) -> list[Path]:
    """Where `labs.source: auto` looks: only the student copies `scalelab labs release` writes (hidden checks and
    solutions removed). The repository's labs/ holds the reference solutions, so 'auto' never hands it out;
    `scalelab hub` releases the labs into build/student/labs before it starts."""
    return [root / "build" / "student" / "labs"] if root else [student_labs_dir()]


def resolve_source(source: str, root: Path | None = None) -> Path | None:
    """The labs folder to hand out: `source` itself, or for 'auto' the first candidate that exists (else None)."""
    if source != "auto":
        return Path(source)
    for cand in source_candidates(root):
        if cand.is_dir():
            return cand
    return None


def _excluded(rel: Path, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in patterns)


def course_files(source: Path, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> list[Path]:
    """Files under `source` to hand out (relative paths, sorted), excluded names and symbolic links left out."""
    exclude = tuple(exclude)
    out = []
    for dirpath, dirnames, filenames in os.walk(source):
        here = Path(dirpath).relative_to(source)
        dirnames[:] = sorted(d for d in dirnames if not _excluded(here / d, exclude)
                             and not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(filenames):
            rel = here / name
            if not _excluded(rel, exclude) and not os.path.islink(os.path.join(dirpath, name)):
                out.append(rel)
    return out


#: A file in a home bigger than this is not read to compare it (a huge or sparse file planted in place of a lab
#: file would take minutes): it counts as the student's own, and the course's version goes beside it.
MAX_COMPARED_BYTES = 64 * 2**20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def beside_name(rel: Path, digest: str) -> Path:
    """Where a new course version goes when the student edited `rel`: 'lab (course update 1a2b3c4d).ipynb'."""
    return rel.with_name(f"{rel.stem} (course update {digest[:8]}){rel.suffix}")


class _Home:
    """Writes under one directory, refusing to follow a symbolic link anywhere below it."""

    def __init__(self, base: Path, owner: tuple[int, int] | None):
        self.base = base
        self.owner = owner

    def safe(self, rel: Path) -> bool:
        """True when no existing component of base/rel is a symbolic link."""
        path = self.base
        for part in rel.parts:
            path = path / part
            if path.is_symlink():
                return False
        return not self.base.is_symlink()

    def mkdirs(self, rel: Path) -> None:
        path = self.base
        for part in rel.parts:
            path = path / part
            if not path.exists():
                path.mkdir(mode=0o755)
                self._chown(path)

    def write_from(self, src: Path, rel: Path) -> None:
        self.mkdirs(rel.parent)
        target = self.base / rel
        fd, tmp = tempfile.mkstemp(prefix=".provision-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
                shutil.copyfileobj(inp, out)
            os.chmod(tmp, 0o644)
            self._chown(Path(tmp))
            os.replace(tmp, target)  # replaces a link itself, never writes through it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write_text(self, rel: Path, text: str) -> None:
        self.mkdirs(rel.parent)
        fd, tmp = tempfile.mkstemp(prefix=".provision-", dir=(self.base / rel).parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        self._chown(Path(tmp))
        os.replace(tmp, self.base / rel)

    def _chown(self, path: Path) -> None:
        if self.owner is not None:
            os.chown(path, *self.owner, follow_symlinks=False)


def provision_labs(source: str | os.PathLike, home: str | os.PathLike, dest: str = "labs",
                   exclude: Iterable[str] = DEFAULT_EXCLUDE, owner: tuple[int, int] | None = None) -> ProvisionReport:
    """Copy the course labs from `source` into `home`/`dest` following the module's rule; `owner` = (uid, gid)."""
    source, home = Path(source), Path(home)
    report = ProvisionReport()
    if not source.is_dir():
        return report
    writer = _Home(home, owner)
    if not home.exists():
        home.mkdir(parents=True, mode=0o755)
        writer._chown(home)
    manifest_rel = MANIFEST
    manifest = {}
    if writer.safe(manifest_rel) and (home / manifest_rel).is_file():
        try:
            manifest = json.loads((home / manifest_rel).read_text(encoding="utf-8")).get("files", {})
        except (OSError, ValueError):
            manifest = {}
    dest_rel = Path(dest)
    for rel in course_files(source, exclude):
        key = rel.as_posix()
        target_rel = dest_rel / rel
        if not writer.safe(target_rel):
            report.refused.append(key)
            continue
        src = source / rel
        new = _sha256(src)
        target = home / target_rel
        if not target.exists():
            writer.write_from(src, target_rel)
            manifest[key] = new
            report.copied.append(key)
            continue
        try:
            big = not target.is_file() or target.stat().st_size > MAX_COMPARED_BYTES
        except OSError:
            big = True
        have = "" if big else _sha256(target)  # unread: neither the course's version nor the one handed out
        if have == new:
            manifest[key] = new
            report.unchanged.append(key)
        elif manifest.get(key) == have:
            writer.write_from(src, target_rel)
            manifest[key] = new
            report.updated.append(key)
        elif manifest.get(key) == new:  # edited by the student, and the course has nothing newer
            report.unchanged.append(key)
        else:
            side_rel = dest_rel / beside_name(rel, new)
            if not writer.safe(side_rel):
                report.refused.append(key)
            elif not (home / side_rel).exists():
                writer.write_from(src, side_rel)
                report.beside.append(beside_name(rel, new).as_posix())
            else:
                report.unchanged.append(key)
    if writer.safe(manifest_rel):
        writer.write_text(manifest_rel, json.dumps({"source": str(source), "files": manifest}, indent=1,
                                                   sort_keys=True))
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m scalelab.hub.provision SOURCE HOME [--dest labs]`: hand the labs out as the current user."""
    p = argparse.ArgumentParser(prog="python -m scalelab.hub.provision", description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("home")
    p.add_argument("--dest", default="labs")
    p.add_argument("--exclude", action="append", default=None, help="glob of names not to copy (repeatable)")
    args = p.parse_args(argv)
    report = provision_labs(args.source, args.home, args.dest, args.exclude or DEFAULT_EXCLUDE)
    print(f"scalelab provision: copied {len(report.copied)}, updated {len(report.updated)}, new versions beside "
          f"edited files {len(report.beside)}, refused {len(report.refused)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
