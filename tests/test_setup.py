"""The two-command set-up: idempotent tools/ensure_*.sh steps, the Makefile's wiring, .ci/run and the README."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "tools").glob("ensure_*.sh")) + [ROOT / ".ci/run"]
VENV = Path(sys.prefix)  # the venv running these tests: the one the ensure steps must find ready
APT_PREFIX = "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y"


def sh(*cmd: str, env: dict | None = None, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "VENV": str(VENV), **(env or {})}, **kw)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_parses_and_is_executable(script):
    assert sh("bash", "-n", str(script)).returncode == 0
    assert os.access(script, os.X_OK), f"{script} must be executable (chmod +x)"


@pytest.mark.parametrize("script, already", [
    ("tools/ensure_debian.sh", "ensure_debian: already installed, ok"),
    ("tools/ensure_venv.sh", "ensure_venv: already up to date, ok"),
    ("tools/ensure_chp.sh", "ensure_chp: already installed, ok"),
])
def test_second_run_does_no_work_and_is_fast(script, already):
    if script.endswith("debian.sh") and os.geteuid() != 0 and os.environ.get("CI") != "true":
        pytest.skip("as another user than root ensure_debian can only report what is missing")
    first = sh("bash", script)  # does the work if it is due (it is not, after `make setup`)
    assert first.returncode == 0, first.stdout + first.stderr
    t0 = time.monotonic()
    second = sh("bash", script, timeout=60)
    elapsed = time.monotonic() - t0
    assert second.returncode == 0, second.stdout + second.stderr
    assert already in second.stdout, second.stdout
    assert "install" not in second.stdout.replace("installed", ""), f"second run did work: {second.stdout}"
    assert elapsed < 8, f"{script} took {elapsed:.1f} s on its second run; it should only check"


def test_venv_stamp_follows_constraints_and_extras(tmp_path):
    stamps = sorted(VENV.glob(".scalelab-setup-*"))
    assert len(stamps) == 1, f"expected one set-up stamp in {VENV}, found {stamps}"
    assert sh("bash", "tools/ensure_venv.sh", "--check").returncode == 0
    changed = tmp_path / "constraints.txt"
    changed.write_text((ROOT / "constraints/cpu.txt").read_text() + "# a site edit\n")
    p = sh("bash", "tools/ensure_venv.sh", "--check", env={"SCALELAB_CONSTRAINTS": str(changed)})
    assert p.returncode == 1 and "install due" in p.stdout, p.stdout + p.stderr
    p = sh("bash", "tools/ensure_venv.sh", "--check", env={"SCALELAB_EXTRAS": "labs,hub"})
    assert p.returncode == 1 and "install due" in p.stdout, p.stdout + p.stderr
    assert sorted(VENV.glob(".scalelab-setup-*")) == stamps, "--check must not change anything"


def test_ensure_venv_names_a_missing_constraints_file(tmp_path):
    p = sh("bash", "tools/ensure_venv.sh", "--check", env={"SCALELAB_CONSTRAINTS": str(tmp_path / "gpu.txt")})
    assert p.returncode == 1
    assert f"constraints file {tmp_path / 'gpu.txt'} not found" in p.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root (to drop to nobody)")
def test_ensure_debian_as_another_user_prints_the_apt_command_and_fails():
    # The script goes in on stdin, so `nobody` needs no access to the checkout.
    with open(ROOT / "tools/ensure_debian.sh") as script:
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-s"],
                           stdin=script, capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "SCALELAB_DEBIAN_EXTRA": "scalelab-no-such-package"})
    assert p.returncode == 1, p.stdout + p.stderr
    fix = next(line.strip() for line in p.stderr.splitlines() if line.strip().startswith("apt-get"))
    assert fix.startswith(APT_PREFIX) and fix.endswith("scalelab-no-such-package"), p.stderr
    assert "missing Debian packages:" in p.stderr


def test_ensure_chp_links_the_proxy_into_the_venv_bin():
    link = VENV / "bin/configurable-http-proxy"
    p = subprocess.run([str(link), "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+", p.stdout.strip()), p.stdout + p.stderr


def test_make_test_runs_every_setup_step_before_pytest_with_its_arguments():
    p = sh("make", "-n", "test", "PYTEST_ARGS=-k some_name tests/test_x.py")
    assert p.returncode == 0, p.stderr
    steps = ["tools/ensure_debian.sh", "tools/ensure_venv.sh", "tools/ensure_chp.sh", "tools/ensure_horovod.sh",
             "-m pytest -n 2 --dist loadgroup -k some_name tests/test_x.py"]
    positions = [p.stdout.find(s) for s in steps]
    assert -1 not in positions and positions == sorted(positions), p.stdout


def test_make_test_does_not_hide_pytest_finding_no_tests():
    p = sh("make", "test", "PYTEST_ARGS=tests/test_setup.py -k no_test_has_this_name", timeout=600)
    assert p.returncode != 0
    assert "pytest collected no tests (exit 5)" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]


def test_make_help_lists_every_target():
    out = sh("make", "help").stdout
    for target in ("hub", "test", "test-quick", "bench", "site", "doctor", "setup", "clean", "help"):
        assert re.search(rf"^\s+make {target}\s", out, re.M), f"make help does not list {target}:\n{out}"


def test_make_clean_removes_a_venv_but_nothing_that_is_not_one(tmp_path):
    not_a_venv = tmp_path / "precious"
    (not_a_venv / "data").mkdir(parents=True)
    p = sh("make", "clean", f"VENV={not_a_venv}")
    assert p.returncode != 0 and "not a venv" in p.stderr and (not_a_venv / "data").exists()
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    (fake / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (fake / ".scalelab-setup-0123456789abcdef").write_text("stamp\n")
    assert sh("make", "clean", f"VENV={fake}").returncode == 0 and not fake.exists()


def test_ci_run_is_strict_bash_that_runs_make_test():
    text = (ROOT / ".ci/run").read_text()
    code = [line.split("#")[0].strip() for line in text.splitlines()[1:]]
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in code
    assert any(re.search(r"(^|\s)make test$", line) for line in code), "no `make test` line in .ci/run"


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("# scalelab\n")
    first_block = re.search(r"```\w*\n(.*?)```", text, re.S)
    assert first_block, "README has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make hub", "make test"]
    headings = [m.start() for m in re.finditer(r"^## ", text, re.M)]
    assert len(headings) >= 2 and headings[0] < first_block.start() < headings[1], \
        "the two commands must come in the first section, before any other"
