"""Every way `scalelab run` can end ends all of its ranks: Ctrl-C, SIGTERM (kill, systemd, Slurm at the time
limit), SIGHUP (a closed terminal) are caught and stop the run; a SIGKILL cannot be caught, so launcher processes
get SIGTERM when their parent dies and each rank ends itself once it is re-parented. A notebook kernel that dies
is a killed parent too (the last test kills a plain Python that launched a run)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import processes_of

pytestmark = pytest.mark.slow

STEPS = 100_000  # never finishes by itself: only a signal ends it


def _wait_for_ranks(run_dir: Path, ranks: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    events = run_dir / "events"
    while time.monotonic() < deadline:
        started = [f for f in events.glob("rank-*.jsonl") if '"type": "step"' in f.read_text(errors="replace")] \
            if events.is_dir() else []
        if len(started) >= ranks:
            return
        time.sleep(0.3)
    raise AssertionError(f"{ranks} ranks did not start stepping in {timeout} s under {run_dir}")


def _gone_within(run_dir: Path, seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = processes_of(run_dir)
        if not left:
            return []
        time.sleep(0.25)
    return processes_of(run_dir)


def _scalelab_run(run_dir: Path, launcher: str) -> subprocess.Popen:
    strategy = ["--strategy", "horovod"] if launcher in ("horovodrun", "mpirun") else []
    cmd = [sys.executable, "-m", "scalelab.cli", "run", "--preset", "tiny", "--workers", "2", "--launcher", launcher,
           *strategy, "--set", f"steps={STEPS}", "--out", str(run_dir), "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})


MARKS = {"local": [], "torchrun": [], "mpirun": [pytest.mark.mpi], "horovodrun": [pytest.mark.horovod],
         "slurm": [pytest.mark.slurm]}


@pytest.mark.parametrize("launcher, sig", [
    pytest.param(launcher, sig, marks=marks, id=f"{launcher}-{sig.name}")
    for launcher, marks in MARKS.items() for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)
])
def test_a_signal_to_scalelab_run_leaves_no_process_within_15_s(tmp_path, request, launcher, sig):
    if launcher == "slurm":
        request.getfixturevalue("slurm_cluster")  # the job is cancelled, its ranks end with it
    run_dir = tmp_path / "run"
    cli = _scalelab_run(run_dir, launcher)
    try:
        _wait_for_ranks(run_dir, 2)
        assert len(processes_of(run_dir)) >= 2
        cli.send_signal(sig)
        code = cli.wait(timeout=30)
        left = _gone_within(run_dir, 15)
        assert not left, f"after {sig.name}: still running {[(p.pid, p.name()) for p in left]}"
        if sig != signal.SIGKILL:  # caught: the run was stopped, and the exit status says by what
            assert code == 128 + sig, (code, cli.stderr.read()[-500:])
            assert f"stopped by {sig.name}" in cli.stderr.read()
    finally:
        for p in processes_of(run_dir):
            p.kill()
        if cli.poll() is None:
            cli.kill()


def test_ranks_end_when_the_process_that_launched_them_is_killed(tmp_path):
    # What a notebook kernel is to a run it launched: kill it, and its local ranks must not train on.
    run_dir = tmp_path / "run"
    code = ("import time\nfrom scalelab import launch, preset\n"
            f"launch(preset('tiny').with_overrides({{'world.workers_per_node': 2, 'steps': {STEPS}, "
            f"'output_dir': {str(run_dir)!r}}}))\ntime.sleep(3600)\n")
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_ranks(run_dir, 2)
        kernel.kill()
        kernel.wait(timeout=30)
        left = _gone_within(run_dir, 15)
        assert not left, f"ranks outlived the killed launcher: {[(p.pid, p.name()) for p in left]}"
    finally:
        for p in processes_of(run_dir):
            p.kill()
        if kernel.poll() is None:
            kernel.kill()


@pytest.mark.parametrize("how", ["shutdown", "restart"])
def test_a_kernel_shutdown_or_restart_ends_a_running_launch_panels_run(tmp_path, how):
    # A real Jupyter kernel runs the LaunchPanel as a lab cell does, then the student shuts the kernel down (a
    # clean exit) or restarts it (JupyterLab kills it): the panel's ranks must not train on.
    from jupyter_client.manager import start_new_kernel
    run_root = tmp_path / "panel"
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        code = ("from scalelab.widgets import LaunchPanel\n"
                f"panel = LaunchPanel(preset='tiny', out_dir={str(run_root)!r}, "
                f"overrides={{'world.workers_per_node': 2, 'steps': {STEPS}}})\n"
                "run = panel.launch()\nprint(run.run_dir)")
        reply = kc.execute_interactive(code, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        [run_dir] = [p for p in run_root.iterdir() if p.is_dir()]
        _wait_for_ranks(run_dir, 2)
        if how == "shutdown":
            km.shutdown_kernel(now=False)
        else:
            km.restart_kernel(now=True)
        left = _gone_within(run_dir, 15)
        assert not left, f"after a kernel {how}: still running {[(p.pid, p.name()) for p in left]}"
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        for p in processes_of(run_root):
            p.kill()


@pytest.mark.slurm
def test_a_finished_slurm_run_leaves_no_guard_behind(slurm_cluster, tmp_path):
    import psutil

    from scalelab import launch, preset
    run = launch(preset("tiny").with_overrides({"launcher": "slurm", "output_dir": str(tmp_path / "r")}))
    assert run.guard is not None and run.guard.poll() is None  # on watch while the job runs
    assert run.wait(timeout=300)["status"] == "succeeded"
    guards = [p for p in psutil.Process().children(recursive=True)
              if "scalelab.cluster.guard" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]
    assert guards == []
