"""Handing out labs: copy what is missing, update what the student did not touch, never overwrite their work."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scalelab.hub.provision import (MANIFEST, beside_name, course_files, main, provision_labs, resolve_source,
                                    source_candidates)


@pytest.fixture
def course(tmp_path):
    src = tmp_path / "course"
    (src / "01_ddp").mkdir(parents=True)
    (src / "01_ddp" / "lab.ipynb").write_text("v1")
    (src / "01_ddp" / "checks.py").write_text("checks")
    (src / "01_ddp" / "hidden_checks.py").write_text("secret")
    (src / "01_ddp" / "__pycache__").mkdir()
    (src / "01_ddp" / "__pycache__" / "x.pyc").write_text("")
    (src / "01_ddp" / ".ipynb_checkpoints").mkdir()
    (src / "solutions").mkdir()
    (src / "solutions" / "01.ipynb").write_text("answers")
    return src


def test_hidden_files_and_caches_are_not_handed_out(course):
    assert [p.as_posix() for p in course_files(course)] == ["01_ddp/checks.py", "01_ddp/lab.ipynb"]


def test_first_hand_out_copies_everything(course, tmp_path):
    home = tmp_path / "home"
    r = provision_labs(course, home)
    assert sorted(r.copied) == ["01_ddp/checks.py", "01_ddp/lab.ipynb"]
    assert (home / "labs/01_ddp/lab.ipynb").read_text() == "v1"
    assert not (home / "labs/01_ddp/hidden_checks.py").exists() and not (home / "labs/solutions").exists()
    manifest = json.loads((home / MANIFEST).read_text())
    assert set(manifest["files"]) == {"01_ddp/checks.py", "01_ddp/lab.ipynb"}


def test_second_hand_out_changes_nothing(course, tmp_path):
    home = tmp_path / "home"
    provision_labs(course, home)
    r = provision_labs(course, home)
    assert r.copied == [] and r.updated == [] and r.beside == [] and len(r.unchanged) == 2


def test_a_deleted_lab_comes_back(course, tmp_path):
    home = tmp_path / "home"
    provision_labs(course, home)
    (home / "labs/01_ddp/lab.ipynb").unlink()
    assert provision_labs(course, home).copied == ["01_ddp/lab.ipynb"]


def test_an_untouched_lab_gets_the_new_course_version(course, tmp_path):
    home = tmp_path / "home"
    provision_labs(course, home)
    (course / "01_ddp" / "lab.ipynb").write_text("v2")
    r = provision_labs(course, home)
    assert r.updated == ["01_ddp/lab.ipynb"]
    assert (home / "labs/01_ddp/lab.ipynb").read_text() == "v2"


def test_an_edited_lab_is_never_overwritten_and_the_new_version_lands_beside_it(course, tmp_path):
    home = tmp_path / "home"
    provision_labs(course, home)
    (home / "labs/01_ddp/lab.ipynb").write_text("my answers")
    (course / "01_ddp" / "lab.ipynb").write_text("v2")
    r = provision_labs(course, home)
    assert (home / "labs/01_ddp/lab.ipynb").read_text() == "my answers"
    assert len(r.beside) == 1 and r.beside[0].startswith("01_ddp/lab (course update ")
    assert (home / "labs" / r.beside[0]).read_text() == "v2"
    again = provision_labs(course, home)
    assert again.beside == [] and (home / "labs/01_ddp/lab.ipynb").read_text() == "my answers", "idempotent"
    (course / "01_ddp" / "lab.ipynb").write_text("v3")
    third = provision_labs(course, home)
    assert len(third.beside) == 1 and third.beside != r.beside, "each course version gets its own name"


def test_an_edited_lab_with_no_new_version_is_left_alone(course, tmp_path):
    home = tmp_path / "home"
    provision_labs(course, home)
    (home / "labs/01_ddp/lab.ipynb").write_text("my answers")
    r = provision_labs(course, home)
    assert r.beside == [] and "01_ddp/lab.ipynb" in r.unchanged


def test_a_students_own_file_of_the_same_name_is_kept(course, tmp_path):
    home = tmp_path / "home"
    (home / "labs/01_ddp").mkdir(parents=True)
    (home / "labs/01_ddp/lab.ipynb").write_text("mine, from before the course")
    r = provision_labs(course, home)
    assert (home / "labs/01_ddp/lab.ipynb").read_text() == "mine, from before the course"
    assert len(r.beside) == 1


def test_symbolic_links_in_the_home_are_never_followed(course, tmp_path):
    home = tmp_path / "home"
    outside = tmp_path / "outside"
    outside.mkdir()
    (home / "labs").mkdir(parents=True)
    os.symlink(outside, home / "labs" / "01_ddp")
    r = provision_labs(course, home)
    assert sorted(r.refused) == ["01_ddp/checks.py", "01_ddp/lab.ipynb"]
    assert list(outside.iterdir()) == []


def test_beside_name():
    from pathlib import Path
    assert beside_name(Path("a/lab.ipynb"), "0123456789abcdef") == Path("a/lab (course update 01234567).ipynb")


def test_auto_source_hands_out_released_copies_never_the_reference_labs(tmp_path):
    assert resolve_source("auto", tmp_path) is None
    (tmp_path / "labs").mkdir()
    assert resolve_source("auto", tmp_path) is None  # reference labs hold the solutions
    released = source_candidates(tmp_path)[0]
    released.mkdir(parents=True)
    assert resolve_source("auto", tmp_path) == released
    assert resolve_source("/x/y", tmp_path).as_posix() == "/x/y"


def test_command_line_entry(course, tmp_path, capsys):
    assert main([str(course), str(tmp_path / "h"), "--dest", "course"]) == 0
    assert (tmp_path / "h/course/01_ddp/lab.ipynb").exists()
    assert "copied 2" in capsys.readouterr().err


def test_missing_source_hands_out_nothing(tmp_path):
    r = provision_labs(tmp_path / "nope", tmp_path / "home")
    assert r.copied == [] and not (tmp_path / "home").exists()


def test_a_huge_sparse_file_in_place_of_a_lab_file_is_not_read(course, tmp_path):
    """ATTACK: a student replaces a lab file with a 1 TB sparse file: comparing it read it all (minutes, and the
    whole `labs update` batch stopped at its timeout). It is now not read: it counts as the student's own, and the
    course's version goes beside it. The control: the other file is updated as usual."""
    import time
    home = tmp_path / "home"
    provision_labs(course, home)
    huge = home / "labs/01_ddp/lab.ipynb"
    with open(huge, "r+b") as f:
        f.truncate(2**40)
    (course / "01_ddp" / "lab.ipynb").write_text("v2")
    (course / "01_ddp" / "checks.py").write_text("checks v2")
    t0 = time.monotonic()
    r = provision_labs(course, home)
    assert time.monotonic() - t0 < 10
    assert r.updated == ["01_ddp/checks.py"] and r.beside == [beside_name(Path("01_ddp/lab.ipynb"), _digest("v2")).as_posix()]
    assert huge.stat().st_size == 2**40


def _digest(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()


def test_one_students_home_that_times_out_never_stops_labs_update_for_the_others(tmp_path, monkeypatch, capsys):
    """ATTACK: `labs update` stopped at the first home whose copy ran past its timeout (an uncaught
    TimeoutExpired): every student after it got nothing. Now that student's line says why; the others go on."""
    import subprocess
    from types import SimpleNamespace
    from scalelab.cli import course as cli_course
    from scalelab.cli.grade import labs_update_command
    from scalelab.course import collect
    homes = {name: tmp_path / name for name in ("ann", "ben", "cat")}
    monkeypatch.setattr(cli_course, "student_homes", lambda args: (homes, "labs"))
    done = []

    def run_as_owner(home, argv, **kw):
        if home.name == "ben":
            raise subprocess.TimeoutExpired(argv, 120)
        done.append(home.name)
        return subprocess.CompletedProcess(argv, 0, b"", b"scalelab provision: copied 2\n")
    monkeypatch.setattr(collect, "run_as_owner", run_as_owner)
    source = tmp_path / "labs"
    (source / "01_x").mkdir(parents=True)
    (source / "01_x" / "lab.ipynb").write_text("{}")
    config = tmp_path / "course.yaml"
    config.write_text(f"labs:\n  source: {source}\nhub:\n  state_dir: {tmp_path / 'state'}\n")
    assert labs_update_command(SimpleNamespace(config=str(config), users=None, homes=None)) == 0
    out = capsys.readouterr().out
    assert done == ["ann", "cat"]
    assert "not updated: the copy took longer than 120 s" in out.split("ben", 1)[1].splitlines()[0]
    assert "copied 2" in out.split("cat", 1)[1].splitlines()[0]
