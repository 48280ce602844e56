"""`scalelab doctor`: one check per component, a JSON CLI, fixes for what is missing, exit status from required checks."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab import cli
from scalelab.cli import doctor
from scalelab.cli.doctor import Check

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = {"torch", "cuda", "horovod", "horovodrun", "mpirun", "slurm", "slurm cluster",
              "configurable-http-proxy", "chromium", "playwright"}
OPTIONAL = {"cuda", "slurm cluster"}


@pytest.fixture(scope="module")
def baseline() -> dict[str, Check]:
    """The checks on this machine as it is, by name (run once: each run imports torch and horovod)."""
    return {c.name: c for c in doctor.run_checks()}


def test_run_checks_returns_one_check_per_component(baseline):
    assert set(baseline) == COMPONENTS
    assert {n for n, c in baseline.items() if not c.required} == OPTIONAL
    for c in baseline.values():
        assert isinstance(c.ok, bool) and c.detail, c
        assert bool(c.fix) != c.ok or not c.required, f"a failing check must say how to fix it: {c}"


def test_torch_check_reports_version_and_threads(baseline):
    import torch
    c = baseline["torch"]
    assert c.ok and c.required
    assert torch.__version__ in c.detail and f"{torch.get_num_threads()} threads" in c.detail


def test_no_cuda_is_not_a_failure(baseline):
    import torch
    c = baseline["cuda"]
    assert not c.required
    if torch.cuda.is_available():
        assert c.ok and "NCCL" in c.detail and f"{torch.cuda.device_count()} device" in c.detail
    else:
        assert c.ok and "gloo will be used" in c.detail


def test_horovod_check_says_which_controllers_were_built(baseline):
    c = baseline["horovod"]
    if not c.ok:
        assert "ensure_horovod.sh" in c.fix
        pytest.skip(f"horovod not usable here: {c.detail}")
    assert "gloo yes" in c.detail and "mpi yes" in c.detail and ("nccl yes" in c.detail or "nccl no" in c.detail)


def _path_without(tool: str, tmp_path: Path) -> str:
    """PATH as it is, except that `tool` cannot be found: its directory is replaced by links to everything else."""
    shadow = tmp_path / "bin"
    shadow.mkdir()
    dirs = []
    for d in os.environ["PATH"].split(os.pathsep):
        if d and (Path(d) / tool).exists():
            for entry in Path(d).iterdir():
                if entry.name != tool and not (shadow / entry.name).exists():
                    (shadow / entry.name).symlink_to(entry)
            d = str(shadow)
        if d not in dirs:
            dirs.append(d)
    return os.pathsep.join(dirs)


def test_missing_mpirun_is_reported_with_the_command_that_installs_it(baseline, monkeypatch, tmp_path, capsys):
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed here, so there is nothing to hide")
    monkeypatch.setenv("PATH", _path_without("mpirun", tmp_path))
    assert shutil.which("mpirun") is None
    checks = {c.name: c for c in doctor.run_checks()}
    c = checks["mpirun"]
    assert not c.ok and "not found" in c.detail
    assert c.fix == "apt-get install -y openmpi-bin libopenmpi-dev"
    # Hiding mpirun changes that one check and no other required one (optional ones, like whether the shared
    # local cluster is up, may change under us).
    assert {n for n in checks if checks[n].required and checks[n].ok != baseline[n].ok} == {"mpirun"}
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  mpirun" in out and "fix: apt-get install -y openmpi-bin libopenmpi-dev" in out
    assert "required checks FAIL: mpirun" in out


def test_empty_path_reports_each_system_tool_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    checks = {c.name: c for c in doctor.run_checks()}
    assert not checks["slurm"].ok and checks["slurm"].fix == "apt-get install -y slurm-wlm munge"
    assert not checks["chromium"].ok and "chromium-driver" in checks["chromium"].fix
    assert not checks["mpirun"].ok


def test_json_cli_parses_and_exit_status_follows_required_checks():
    p = subprocess.run([sys.executable, "-m", "scalelab.cli", "doctor", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    checks = json.loads(p.stdout)
    assert {c["name"] for c in checks} == COMPONENTS
    assert all(set(c) == {"name", "ok", "required", "detail", "fix"} for c in checks)
    failed = [c["name"] for c in checks if c["required"] and not c["ok"]]
    assert p.returncode == (1 if failed else 0), (failed, p.stderr)


@pytest.mark.parametrize("checks, status", [
    ([Check("torch", True, "x", ""), Check("cuda", False, "no", "buy one", required=False)], 0),
    ([Check("torch", True, "x", ""), Check("mpirun", False, "missing", "apt-get install -y openmpi-bin")], 1),
])
def test_only_a_failing_required_check_fails_the_doctor(monkeypatch, capsys, checks, status):
    monkeypatch.setattr(doctor, "run_checks", lambda: checks)
    assert cli.main(["doctor"]) == status
    out = capsys.readouterr().out
    assert ("required checks FAIL" in out) == bool(status)
    assert [line.strip() for line in out.splitlines() if "fix:" in line] == [f"fix: {c.fix}" for c in checks if not c.ok]


def test_a_crashing_check_is_reported_not_raised(monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(doctor, "CHECKS", (doctor.check_playwright, boom))
    checks = doctor.run_checks()
    assert checks[-1].name == "boom" and not checks[-1].ok and "driver exploded" in checks[-1].detail


def test_under_ci_every_required_check_passes(baseline):
    failed = {n: f"{c.detail} -> fix: {c.fix}" for n, c in baseline.items() if c.required and not c.ok}
    if os.environ.get("CI") != "true":
        if failed:
            pytest.skip(f"not CI; missing here: {failed}")
        return
    assert not failed, f"CI=true: the set-up should have provided every required part: {failed}"
