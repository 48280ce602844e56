"""Run directories never merge, and a bad path on any command is one line naming it, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.launch.base import prepare_run_dir
from scalelab.run.spec import preset

ROOT = Path(__file__).resolve().parent.parent


def scalelab(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalelab.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def tiny_run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return scalelab("run", "--preset", "tiny", "--set", "steps=20", "--set", "checkpoint.every_steps=5",
                    "--out", str(out), "--json", *extra)


def starts(out: Path) -> list[dict]:
    lines = (out / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == "start"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "r"
    r = tiny_run(out)
    assert r.returncode == 0, r.stderr[-500:]
    return out


def test_a_second_run_into_the_same_folder_is_refused_and_the_first_is_untouched(first_run):
    before = {p: p.read_bytes() for p in first_run.rglob("*") if p.is_file()}
    r = tiny_run(first_run)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "holds an earlier run; pass --resume" in r.stderr and "--overwrite" in r.stderr
    assert {p: p.read_bytes() for p in first_run.rglob("*") if p.is_file()} == before


def test_resume_continues_the_run_from_its_checkpoint(first_run, tmp_path):
    r = scalelab("run", "--preset", "tiny", "--set", "steps=30", "--set", "checkpoint.every_steps=5",
                 "--out", str(first_run), "--json", "--resume")
    assert r.returncode == 0, r.stderr[-500:]
    assert [e["start_step"] for e in starts(first_run)][-1] > 0


def test_overwrite_starts_again_with_only_the_new_runs_files(tmp_path):
    out = tmp_path / "r"
    assert tiny_run(out).returncode == 0
    (out / "my_notes.txt").write_text("mine")  # not a run's file: kept
    assert tiny_run(out, "--overwrite").returncode == 0
    assert len(starts(out)) == 1 and (out / "my_notes.txt").read_text() == "mine"


def test_a_folder_that_holds_no_run_is_never_cleared(tmp_path):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "chapter1.tex").write_text("precious")
    r = tiny_run(out, "--overwrite")
    assert r.returncode == 1 and "holds no run" in r.stderr
    assert (out / "chapter1.tex").read_text() == "precious"


def test_default_run_directories_never_collide():
    spec = preset("tiny")
    cwd = os.getcwd()
    dirs = []
    try:
        os.chdir(Path(os.environ.get("TMPDIR", "/tmp")))
        for _ in range(3):  # the same second, the same process
            _, run_dir, _ = prepare_run_dir(spec)
            dirs.append(run_dir)
    finally:
        os.chdir(cwd)
        for d in dirs:
            import shutil
            shutil.rmtree(d, ignore_errors=True)
    assert len(set(dirs)) == 3


@pytest.mark.parametrize("argv, words", [
    (["run", "--preset", "tiny", "--out", "/etc/passwd/x", "--json"], "output_dir (--out) '/etc/passwd/x'"),
    (["run", "--preset", "tiny", "--out", "/etc/passwd", "--json"], "is a file, not a folder"),
    (["run", "--preset", "tiny", "--resume", "--out", "/nonexistent-scalelab-run", "--json"], "no run to continue"),
    (["run", "--spec", "/nonexistent.yaml"], "cannot read /nonexistent.yaml"),
    (["labs", "release", "--out", "/etc/passwd/x", "01_single_device"], "/etc/passwd/x: Not a directory"),
    (["kernels", "install", "--prefix", "/etc/passwd/x"], "/etc/passwd/x: Not a directory"),
    (["grade", str(ROOT / "labs" / "01_single_device"), "/nonexistent", "--out", "/etc/passwd/x"],
     "Not a directory"),
    (["hub", "--config", "/nonexistent.yaml", "--check"], "'/nonexistent.yaml' not found"),
])
def test_a_bad_path_is_one_line_naming_it(argv, words):
    r = scalelab(*argv, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-800:]
    assert words in r.stderr, r.stderr[-500:]
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1
