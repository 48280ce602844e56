"""What every launcher shares: the run directory, the worker command, and a Run over local processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ..dist import threads_per_rank

from ..errors import LaunchError
from ..run.events import EventReader
from ..run.handle import Run
from ..run.user_code import copy_user_code
from ..run.procs import describe_exit, dies_with_this_process, kill_processes


def prepare_run_dir(spec):
    """Resolve output_dir (default runs/<name>-<time>), create it with logs/, write spec.json.

    Returns (spec, run_dir, reader): the reader is positioned at the end of any earlier attempt's event files
    (a resume relaunches into the same directory), taken before a rank of this attempt can write.
    """
    if spec.output_dir:
        run_dir = Path(spec.output_dir).resolve()
    else:  # a fresh folder: two runs started in the same second by one process must not share it
        stem = Path("runs", f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").resolve()
        run_dir, n = stem, 1
        while run_dir.exists():
            n += 1
            run_dir = stem.with_name(f"{stem.name}-{n}")
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LaunchError(f"output_dir (--out) {str(run_dir)!r}: cannot create the run directory there: "
                          f"{e.strerror}; choose a folder you can write, or leave it unset for runs/<name>-<time>"
                          ) from None
    spec = spec.replace(output_dir=str(run_dir))
    spec.save(run_dir / "spec.json")
    copy_user_code(spec, run_dir)  # a hook or schedule of the student's own: the ranks import it from run_dir/code
    return spec, run_dir, EventReader(run_dir, from_now=True)


def worker_command(run_dir: Path, python: str | None = None) -> list[str]:
    """The command every launcher runs once per rank."""
    return [python or sys.executable, "-m", "scalelab.train.worker", "--spec", str(run_dir / "spec.json"),
            "--log-dir", str(run_dir / "logs")]


def threads_for(spec) -> int:
    """Intra-op threads per rank: the spec's, or this node's CPUs shared among its ranks."""
    return threads_per_rank(spec, spec.world.workers_per_node)


class ProcessRun(Run):
    """A run whose processes are children of this one: a launcher process (torchrun, horovodrun, mpirun)
    or one process per rank (local)."""

    def __init__(self, spec, run_dir, procs: list[subprocess.Popen], rank_of_proc: bool = False,
                 reader: EventReader | None = None):
        super().__init__(spec, run_dir, reader)
        self.procs = procs
        self._rank_of_proc = rank_of_proc  # procs[i] is rank i
        self._psprocs = [psutil.Process(p.pid) for p in procs]
        self._state = "running"
        self._loss_seen: float | None = None  # when a rank was first seen dead (runs that recover from it)

    def _backend_state(self):
        codes = [p.poll() for p in self.procs]
        if self._rank_of_proc and self.tolerates_rank_loss:
            lost = self.lost_ranks()
            dead = [i for i, code in enumerate(codes) if code not in (None, 0) and i not in lost]
            if dead and self._loss_seen is None:
                self._loss_seen = time.monotonic()
            # a lost rank is for the survivors to recover from: they have the detection timeout and a margin
            waiting = dead and time.monotonic() - self._loss_seen < self.spec.fault.detect_timeout_s + 30
            if None in codes and (not dead or waiting):
                return "running", None, None
            codes = [0 if i in lost else code for i, code in enumerate(codes)]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                if self._rank_of_proc:
                    return "failed", f"rank {i} {describe_exit(code)}; see {self.run_dir / 'logs'}/rank-{i}.log", i
                rank = self._rank_from_log()
                where = f"rank {rank}" if rank is not None else "a rank"
                return "failed", (f"{self.launcher} exited with {describe_exit(code)}: {where} failed; "
                                  f"last lines of its log:\n{self.logs(tail=8)}"), rank
        return ("succeeded" if all(c == 0 for c in codes) else "running"), None, None

    def _rank_from_log(self) -> int | None:
        """The failed rank as the launcher's own log names it (each launcher words it differently)."""
        return None

    def _cancel(self) -> None:
        kill_processes(self._psprocs)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def start_process(cmd: list[str], env: dict, log_path: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start `cmd` in its own session (so a stop reaches all it starts), output appended to `log_path`; it gets
    SIGTERM if this process dies (`dies_with_this_process`), so no launcher outlives a killed CLI or kernel.
    `pass_fds`: descriptors the child inherits under the same numbers (rank 0's rendezvous socket)."""
    with open(log_path, "ab") as log:
        try:
            return subprocess.Popen(dies_with_this_process(cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=pass_fds)
        except FileNotFoundError as e:
            raise LaunchError(f"cannot start {cmd[0]}: {e.strerror}") from e
