"""horovodrun: Horovod's launcher with its Gloo controller (no MPI needed) on this node."""
from __future__ import annotations

import re

from ..run.procs import scrub_env
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command
from ..errors import LaunchError
from ..paths import require_tool

# horovodrun's gloo driver: "Process 1 exit with status code 1."
_FAILED_RANK = re.compile(r"Process (\d+) exit with status code")


class HorovodrunRun(ProcessRun):
    """A horovodrun process and the ranks it started."""

    launcher = "horovodrun"

    def _rank_from_log(self):
        m = _FAILED_RANK.search(self.logs())
        return int(m.group(1)) if m else None


def horovodrun_command(spec, run_dir) -> list[str]:
    """`horovodrun -np N -H localhost:N --gloo python -m scalelab.train.worker ...`."""
    n = spec.world.workers_per_node
    exe = require_tool("horovodrun", LaunchError)
    return [exe, "-np", str(n), "-H", f"localhost:{n}", "--gloo", "--network-interfaces", "lo",
            *worker_command(run_dir)]


def launch(spec, env: dict | None = None) -> HorovodrunRun:
    """Start horovodrun with spec.world.workers_per_node ranks over Gloo; returns at once."""
    spec, run_dir, reader = prepare_run_dir(spec)
    env = scrub_env(env)
    env["OMP_NUM_THREADS"] = str(threads_for(spec))
    proc = start_process(horovodrun_command(spec, run_dir), env, run_dir / "logs" / "launcher.log")
    return HorovodrunRun(spec, run_dir, [proc], reader=reader)
