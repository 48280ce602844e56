"""run_as: student-accounts — the hub prepares a student's home *as the student*, never as root.

Needs root (to create a test account and to switch to it); the course Python here lives under root's home, so a
shim runs Debian's /usr/bin/python3 with this checkout on its path for the hand-out (which uses only the stdlib).
"""
from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from scalelab.hub.local_spawner import CourseLocalSpawner

ROOT = Path(__file__).resolve().parent.parent
ACCOUNT = "slhubtest"


@pytest.fixture(scope="module")
def student():
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a Unix account and switches to it")
    if not Path("/usr/bin/python3").exists():
        pytest.skip("needs /usr/bin/python3 for the student-side hand-out")
    from scalelab.cluster.local import LocalCluster

    existed = True
    try:
        pwd.getpwnam(ACCOUNT)
    except KeyError:
        existed = False
        LocalCluster(state_dir=tempfile.gettempdir()).ensure_user(ACCOUNT)
    pw = pwd.getpwnam(ACCOUNT)
    yield pw
    for name in ("labs", ".scalelab"):
        shutil.rmtree(Path(pw.pw_dir) / name, ignore_errors=True)
    if not existed:
        subprocess.run(["userdel", "-r", ACCOUNT], capture_output=True)


@pytest.fixture
def shared(tmp_path):
    """A world-readable folder with the labs and a python shim (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="hubacct-"))
    os.chmod(d, 0o755)
    (d / "labs" / "01_x").mkdir(parents=True)
    (d / "labs" / "01_x" / "lab.ipynb").write_text("v1")
    (d / "bin").mkdir()
    shim = d / "bin" / "python"
    shim.write_text(f'#!/bin/sh\nexec env PYTHONPATH={ROOT} /usr/bin/python3 "$@"\n')
    for p in (d / "labs", d / "labs" / "01_x", d / "bin"):
        os.chmod(p, 0o755)
    os.chmod(d / "labs" / "01_x" / "lab.ipynb", 0o644)
    os.chmod(shim, 0o755)
    yield d
    shutil.rmtree(d)


def spawner(shared) -> CourseLocalSpawner:
    sp = CourseLocalSpawner(user=SimpleNamespace(name=ACCOUNT), run_as="student-accounts",
                            labs_source=str(shared / "labs"), python_bin=str(shared / "bin"))
    return sp


def test_labs_are_handed_out_as_the_student(student, shared):
    sp = spawner(shared)
    assert sp.course_home() == Path(student.pw_dir)
    asyncio.run(sp.prepare_home())
    lab = Path(student.pw_dir) / "labs" / "01_x" / "lab.ipynb"
    assert lab.read_text() == "v1"
    for p in (lab, lab.parent, Path(student.pw_dir) / ".scalelab" / "labs-manifest.json"):
        assert p.stat().st_uid == student.pw_uid, f"{p} is not the student's"
    assert sp.user_env({})["HOME"] == student.pw_dir
    assert "--allow-root" not in sp.get_args()


def test_a_planted_symlink_cannot_make_the_hub_write_elsewhere(student, shared):
    target = Path(tempfile.mkdtemp(prefix="hubacct-target-"))  # root-owned: the student cannot write here
    home = Path(student.pw_dir)
    shutil.rmtree(home / "labs", ignore_errors=True)
    os.symlink(target, home / "labs")
    os.lchown(home / "labs", student.pw_uid, student.pw_gid)
    try:
        asyncio.run(spawner(shared).prepare_home())
        assert list(target.iterdir()) == []
    finally:
        (home / "labs").unlink()
        shutil.rmtree(target)
