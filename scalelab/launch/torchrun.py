"""torchrun: PyTorch's elastic launcher starts the ranks on this node. With world.max_restarts=0 its agent
restarts nothing, so a failed rank fails the run; with max_restarts=N it is elastic: a c10d rendezvous, and after a
failure the agent stops the other workers and starts all of them again (up to N times), each resuming from the
newest checkpoint."""
from __future__ import annotations

import re
import sys

from ..run.procs import free_port, scrub_env
from .base import ProcessRun, prepare_run_dir, start_process, threads_for, worker_command

# torchrun's failure report: "  rank      : 1 (local_rank: 1)"
_FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)


class TorchrunRun(ProcessRun):
    """A torchrun process and the ranks it started."""

    launcher = "torchrun"

    def _rank_from_log(self):
        m = _FAILED_RANK.search(self.logs())
        return int(m.group(1)) if m else None


def torchrun_command(spec, run_dir, port: int) -> list[str]:
    """`python -m torch.distributed.run ... -m scalelab.train.worker ...` for one node."""
    worker = worker_command(run_dir)
    if spec.world.max_restarts:  # elastic: a c10d rendezvous the agent re-runs after a failure, restarting workers
        rendezvous = ["--nnodes=1:1", f"--max-restarts={spec.world.max_restarts}", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_dir.name}"]
    else:
        rendezvous = ["--nnodes=1", "--max-restarts=0", "--master-addr=127.0.0.1", f"--master-port={port}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec.world.workers_per_node}",
            *rendezvous, "--monitor-interval=0.2", *worker[1:]]


def launch(spec, env: dict | None = None) -> TorchrunRun:
    """Start torchrun with spec.world.workers_per_node ranks; returns at once."""
    spec, run_dir, reader = prepare_run_dir(spec)
    env = scrub_env(env)
    env["OMP_NUM_THREADS"] = str(threads_for(spec))
    if spec.world.max_restarts:
        # the workers' store must be new in each round: on the agent's shared store a restarted rank can read the
        # dead attempt's gloo addresses (same keys) and wait on them until the process-group timeout
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = start_process(torchrun_command(spec, run_dir, free_port()), env, run_dir / "logs" / "launcher.log")
    return TorchrunRun(spec, run_dir, [proc], reader=reader)
