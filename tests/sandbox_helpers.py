"""What the grader's sandbox tests share: root or a CI failure, a folder others may enter, a confined child."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from scalelab.grade.sandbox import SandboxPlan

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture
def _as_root():
    # As with the other real parts (conftest.py): skipped locally, a failure under CI=true.
    if os.geteuid() != 0:
        if CI:
            pytest.fail("CI=true: the grader's sandbox tests must run as root", pytrace=False)
        pytest.skip("the grader's full sandbox needs root")


root_only = pytest.mark.usefixtures("_as_root")


@pytest.fixture
def open_tmp():
    """A folder other users may enter (pytest's tmp_path sits under a 0700 folder)."""
    path = Path(tempfile.mkdtemp(prefix="sl-sbx-"))  # short: job folders in it hold Unix sockets
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def confined(plan: SandboxPlan, code: str, timeout=60) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python that first applies `plan` to itself (as the grader's runner does)."""
    prog = ("import json, sys; from scalelab.grade.sandbox import SandboxPlan; from scalelab.grade.confine import apply_sandbox; "
            "apply_sandbox(SandboxPlan.from_dict(json.loads(sys.argv[1])))\n" + textwrap.dedent(code))
    return subprocess.run([sys.executable, "-c", prog, json.dumps(plan.to_dict())], capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def fake_checkout(root: Path) -> Path:
    """A second copy of a course checkout: its own scalelab-less tree with a lab holding hidden checks."""
    (root / ".git").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'copy'\n")
    lab = root / "labs" / "90_copy"
    lab.mkdir(parents=True)
    (lab / "hidden_checks.py").write_text("SECRET")
    for p in (root, root / "labs", lab):
        p.chmod(0o755)
    (lab / "hidden_checks.py").chmod(0o644)
    return lab


def assert_nothing_leaks_into_reports(out, bits, what: str = "") -> None:
    """No file a student or a course page gets from a grading's output folder `out` (everything but instructor/)
    holds any of `bits` (text from hidden checks, a classmate's files, planted secrets)."""
    for path in out.rglob("*"):
        if path.is_file() and "instructor" not in path.parts:
            text = path.read_text(errors="replace")
            for bit in bits:
                assert bit not in text, f"{bit!r}{what} leaked into {path}"
