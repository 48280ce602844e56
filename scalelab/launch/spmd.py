"""Run importable functions on N local ranks and collect what each rank returns (SPMD experiments).

Training runs go through a RunSpec and `launch()`; the labs also need small distributed experiments that are
not a training run: time an allreduce, compare gradients averaged by hand with DDP's, check that replicas stay
identical, try a Horovod port. Two ways to run them:

    from scalelab import SpmdPool, run_spmd            # (they live in scalelab.launch.spmd)
    results = run_spmd("scalelab.experiments.collectives:allreduce_sweep", world=2, kwargs={"sizes": [1024]})

    with SpmdPool(world=2) as pool:          # ranks start once, then run job after job
        a = pool.run("scalelab.experiments.collectives:allreduce_sweep", sizes=[1024])
        b = pool.run("my_average:check")     # a module the notebook wrote with %%writefile

Each returns the list of the ranks' (JSON-able) return values, rank 0 first. A pool keeps its ranks, their
imports and their process group between jobs, so a job costs what its function costs, not a Python and torch
start-up per rank; a module that changed on disk since a rank imported it is reloaded before the next job.

- launcher "local": ranks get torchrun's variables and a process group is ready when the function runs:
  `init="gloo"` (default), `"nccl"` (each rank on cuda:<local rank>), `"auto"` (nccl where CUDA is available,
  else gloo) or `"none"` (the function sets up what it needs).
- launcher "horovodrun" (Gloo controller) or "mpirun" (MPI controller): the function calls `hvd.init()` itself.

Functions must live in importable modules (a spawned rank cannot see a notebook's globals); the caller's
working directory is on the ranks' PYTHONPATH. A rank that raises writes its traceback; the first failure ends
every rank of the pool and raises `RunFailed` naming it (the next job starts fresh ranks).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..machine import usable_cpus
from ..errors import LaunchError, RunFailed, RunTimeout
from ..run.procs import PEER_GRACE_S, describe_exit, is_peer_failure, kill_processes, scrub_env
from .base import start_process
from .commands import horovodrun_local_args, mpirun_args
from .local import start_ranks
from .spmd_rank import write_atomic

LAUNCHERS = ("local", "horovodrun", "mpirun")
INITS = ("gloo", "nccl", "auto", "none")
POLL_S = 0.02


def run_spmd(target: str, world: int = 2, kwargs: dict | None = None, *, launcher: str = "local",
             init: str = "gloo", threads: int = 0, timeout: float = 120, run_dir: str | Path | None = None,
             env: dict | None = None) -> list:
    """Run `target` ("module:function") once on `world` fresh ranks; returns each rank's value, rank order.

    `timeout` covers everything, the ranks' start-up included."""
    with SpmdPool(world, launcher=launcher, init=init, threads=threads, run_dir=run_dir, env=env,
                  start_timeout=0) as pool:
        return pool.run(target, timeout=timeout, **(kwargs or {}))


class SpmdPool:
    """N rank processes that run `module:function` jobs one after another; start lazily, `close()` to end.

    `threads`: torch intra-op threads per rank (0: this machine's CPUs shared among the ranks). `env` is added
    to every rank's environment after the enclosing run's distributed variables are scrubbed (so e.g.
    HOROVOD_TIMELINE reaches the ranks). Rank r's output goes to `<run_dir>/rank-<r>.log`.
    """

    def __init__(self, world: int = 2, *, launcher: str = "local", init: str = "gloo", threads: int = 0,
                 run_dir: str | Path | None = None, env: dict | None = None, start_timeout: float = 120):
        """`start_timeout`: seconds the first job may take on top of its own timeout, for the ranks to start."""
        _check_args(world, launcher, init)
        self.world, self.launcher, self.init, self.env = world, launcher, init, dict(env or {})
        self.threads = threads or max(1, usable_cpus() // world)
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="scalelab-spmd-")).resolve()
        self.start_timeout = start_timeout
        self.procs: list = []
        self._jobs = 0
        self._generation = 0

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the ranks are up (started and none has exited)."""
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self) -> "SpmdPool":
        """Start the ranks (done by the first `run` anyway); returns self."""
        if self.alive:
            return self
        self.close()
        self._generation += 1
        self._jobs = 0
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        for pattern in ("job-*", "result-*", "error-*", "stop"):  # a reused folder must not replay old jobs
            for old in d.glob(pattern):
                old.unlink()
        (d / "pool.json").write_text(json.dumps({"init": self.init, "owner_pid": os.getpid()}))
        base = scrub_env()
        base.update(self.env)
        base["OMP_NUM_THREADS"] = str(self.threads)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), base.get("PYTHONPATH", "")) if p)
        self.procs = _start(self.launcher, self.world, d, base, self.threads, sorted(self.env))
        return self

    @property
    def dir(self) -> Path:
        """This generation's folder (a pool restarted after a failure gets a fresh one)."""
        return self.run_dir if self._generation <= 1 else self.run_dir / f"restart-{self._generation - 1}"

    def close(self) -> None:
        """Ask the ranks to leave, then end whatever is left of them."""
        if not self.procs:
            return
        (self.dir / "stop").touch()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)
        self._kill()

    def _kill(self) -> None:
        kill_processes(self.procs)
        for p in self.procs:
            p.wait()
        self.procs = []

    def _a_rank_may_still_show(self, job) -> bool:
        """Whether a rank that has not reported an error may yet show the root cause (it is still running)."""
        if self.launcher != "local":
            return True  # one launcher process: its ranks cannot be told apart
        return any(p.poll() is None and not (self.dir / f"error-{job}-{r}.json").exists()
                   for r, p in enumerate(self.procs))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- jobs -----------------------------------------------------------------------------------------
    def run(self, target: str, timeout: float = 120, **kwargs) -> list:
        """Run `target(**kwargs)` on every rank; returns the ranks' values, rank 0 first."""
        _check_target(target)
        if not self.alive:
            self.start()
        i, d = self._jobs, self.dir
        self._jobs += 1
        write_atomic(d / f"job-{i}.json", {"target": target, "kwargs": kwargs})
        deadline = time.monotonic() + timeout + (self.start_timeout if i == 0 else 0)
        peer_seen = None
        try:
            while True:
                failure = _first_failure(self.procs, self.world, d, i, per_rank=self.launcher == "local")
                if failure and failure[2]:  # only "my peer went away": the rank that died may not be reaped yet
                    peer_seen = peer_seen or time.monotonic()
                    if time.monotonic() - peer_seen < PEER_GRACE_S and self._a_rank_may_still_show(i):
                        failure = None
                if failure:
                    raise RunFailed(failure[1], rank=failure[0], run_dir=str(d))
                if all((d / f"result-{i}-{r}.json").exists() for r in range(self.world)):
                    return [json.loads((d / f"result-{i}-{r}.json").read_text()) for r in range(self.world)]
                if time.monotonic() > deadline:
                    raise RunTimeout(f"SPMD job {target} not done after {timeout:g} s; see the rank logs in {d}")
                time.sleep(POLL_S)
        except BaseException:
            self._kill()  # ranks may be stuck in a collective with a dead peer: the pool is spent
            raise


def _check_target(target):
    if not isinstance(target, str) or target.count(":") != 1:
        raise LaunchError(f"target {target!r} must be 'module:function', e.g. "
                          "'scalelab.experiments.collectives:allreduce_sweep'")


def _check_args(world, launcher, init):
    if launcher not in LAUNCHERS:
        raise LaunchError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if init not in INITS:
        raise LaunchError(f"init {init!r} must be one of {', '.join(INITS)}: the process group made ready for "
                          "the function ('none': the function makes its own)")
    if not isinstance(world, int) or world < 1:
        raise LaunchError(f"world {world!r} must be a positive number of ranks")


def _rank_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "scalelab.launch.spmd_rank", "--pool", str(run_dir)]


def _start(launcher, world, run_dir, base, threads, extra_vars):
    cmd = _rank_command(run_dir)
    if launcher == "local":  # a rendezvous of the pool's own: its port held for rank 0, and a secret
        return start_ranks(cmd, base, world, threads, lambda r: run_dir / f"launcher-rank-{r}.log")
    if launcher == "horovodrun":
        full = [*horovodrun_local_args(world), *cmd]
    else:  # ranks share cores here: waiting ranks must yield the CPU, not busy-poll (it slows a peer's imports 2-3x)
        full = [*mpirun_args(world, ("OMP_NUM_THREADS", "PATH", "PYTHONPATH", *extra_vars), interface="lo",
                             shared_cores=True), *cmd]
    return [start_process(full, base, run_dir / "launcher.log")]


def _first_failure(procs, world, run_dir, job, per_rank):
    """(rank, message, peer_only) of the root cause, or None: a rank's own error first, then a rank that died
    without reporting, and only then errors that ranks saw because a peer had died (peer_only True: a socket
    closes before its dying process can be waited for, so the caller gives the dead rank a moment to show)."""
    errors = []
    for r in range(world):
        path = run_dir / f"error-{job}-{r}.json"
        if path.exists():
            errors.append(json.loads(path.read_text()))  # written atomically
    for e in errors:
        e["peer_failure"] = e["peer_failure"] or is_peer_failure(e["message"])
    own = [e for e in errors if not e["peer_failure"]]
    if own:
        return (*_describe_error(min(own, key=lambda e: e["t"])), False)
    reported = {e["rank"] for e in errors}
    for i, p in enumerate(procs):
        code = p.poll()
        if code is not None and not (per_rank and i in reported):
            if not errors:
                time.sleep(0.2)  # its own error file may land just after the exit
                if any((run_dir / f"error-{job}-{r}.json").exists() for r in range(world)):
                    return _first_failure(procs, world, run_dir, job, per_rank)
            return (*_describe_exit(i, code, run_dir, per_rank), False)
    if errors:
        return (*_describe_error(min(errors, key=lambda e: e["t"])), True)
    return None


def _describe_error(e):
    tail = "\n".join(e["traceback"].rstrip().splitlines()[-6:])
    return e["rank"], f"rank {e['rank']} failed: {e['error']}: {e['message']}\n{tail}"


def _describe_exit(i, code, run_dir, per_rank):
    log = run_dir / (f"rank-{i}.log" if per_rank else "launcher.log")
    text = log.read_text(errors="replace") if log.exists() else ""
    tail = "\n".join(text.rstrip().splitlines()[-8:])
    who = f"rank {i}" if per_rank else "the launcher"
    return (i if per_rank else None), f"{who} ended with {describe_exit(code)} before returning; " \
                                      f"last lines of {log}:\n{tail}"
