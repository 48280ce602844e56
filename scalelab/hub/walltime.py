"""Walltime inside a student's server: the time left of its Slurm job, a warning before the end, and the runs the
server started saving an emergency checkpoint when the job is told to end.

A student's server is a batch job (`scalelab.hub.slurm_spawner`) with a time limit. This module is a Jupyter server
extension, loaded by every course server (`scalelab.hub.singleuser` puts `jupyter_config/` on JUPYTER_CONFIG_PATH):

- ``GET <server>/scalelab/walltime`` answers JSON: the job's id, the seconds left (Slurm's own answer, `squeue -o
  %L`, asked at most once per `refresh_s` and counted down in between), the warning threshold (course setting
  ``slurm.walltime.warn_s``, T-10 min by default), whether the end signal came, and how many of the server's runs
  will save themselves. The JupyterLab extension in `jupyter_data/labextensions/scalelab-walltime` (source:
  `walltime_lab/`) shows it in the status bar and raises one JupyterLab notification at the threshold.
- The job is submitted with ``--signal=B:USR1@<slurm.walltime.signal_s>``: Slurm signals the batch shell, which
  is this server (the script `exec`s it). On SIGUSR1, and on the SIGTERM that ends the job, the server passes
  SIGUSR1 on to the ranks of every run it started (its descendant processes whose command runs
  `scalelab.train.worker`: the ranks of a local or torchrun run, and for a run on job steps the `srun` or `mpirun`
  that started them, which forward SIGUSR1 to their tasks on every node) whose spec sets ``checkpoint.on_signal``:
  they agree on a step, save an emergency checkpoint and exit 0 (`scalelab.train.preempt`).
  Each such run is noted in ``~/.scalelab/interrupted.jsonl`` and in ``<run dir>/walltime.json``, which is where
  the resume offer (`scalelab.train.preempt.interrupted_runs`, widget `ResumeOffer`) finds it next time. On SIGTERM
  the server waits (up to `stop_grace_s`) for those ranks to exit before it stops: when the batch shell exits,
  Slurm kills whatever is left of the job at once.

Threat model. The endpoint is a handler of the student's own server, behind its normal authentication (the hub's
OAuth: only the server's owner, or an admin the hub lets in; another student gets 403, nobody signed in is sent to
the login page). It only reads (GET); nothing a request carries reaches Slurm or a signal. Signals go only to
processes that descend from this server, i.e. the student's own; with ``servers.run_as: student-accounts`` the
kernel forbids signalling a classmate's processes anyway, and Slurm refuses a `scancel --signal` to a job that is
not one's own. Not protected: with ``run_as: hub-account`` every server runs as one Unix account, so one student's
code can signal another's ranks directly (that mode keeps students apart by the hub only). Runs without
``checkpoint.on_signal`` are not signalled (SIGUSR1 would kill them): they end with the job, keeping only their
periodic checkpoints; the endpoint counts them so the warning can say so.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from ..run.spec import load as load_spec

WARN_ENV = "SCALELAB_WALLTIME_WARN_S"
"""Seconds before the end at which the countdown warns (the course's slurm.walltime.warn_s)."""
SIGNAL_ENV = "SCALELAB_WALLTIME_SIGNAL_S"
"""Seconds before the end at which Slurm signals the server (slurm.walltime.signal_s; 0: only the final SIGTERM)."""
REFRESH_ENV = "SCALELAB_WALLTIME_REFRESH_S"
"""Seconds between two squeue calls of one server (slurm.walltime.refresh_s)."""
GRACE_ENV = "SCALELAB_WALLTIME_GRACE_S"
"""Seconds the server waits, on SIGTERM, for its signalled runs to exit before it stops."""
EARLY_SIGNAL_ENV = "SCALELAB_EARLY_SIGNAL"
"""Set by scalelab.hub.singleuser when SIGUSR1 came before this extension took the server's signals over."""
LAB_NAME = "scalelab-walltime"
HERE = Path(__file__).resolve().parent
LAB_SOURCE = HERE / "walltime_lab"
"""The JupyterLab extension's source (src/index.js, package.json, package-lock.json, build.sh)."""
LAB_BUNDLE = HERE / "jupyter_data" / "labextensions" / LAB_NAME
"""The built extension JupyterLab loads (committed; rebuilt by walltime_lab/build.sh)."""
WORKER_MODULES = ("scalelab.train.worker", "scalelab.worker")
FORWARDERS = ("srun", "mpirun")
"""Launchers whose process passes SIGUSR1 on to the ranks it started (on every node of the job)."""
REGISTRY = Path(".scalelab") / "interrupted.jsonl"
"""Below the home: one line per run the end of a server job interrupted."""


def env_float(name: str, default: float) -> float:
    """A number from the environment; a missing or malformed value is `default` (the server must start anyway)."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def parse_time_left(text: str) -> int | None:
    """Seconds in squeue's %L ('1-02:03:04', '2:03:04', '3:04', '4'); None for UNLIMITED, NOT_SET, INVALID or
    anything else that is not a time."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(?:(\d+):)?(\d+):)?(\d+)", text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class JobClock:
    """The time left of this server's job: Slurm's answer, at most once per `refresh_s`, counted down between."""

    def __init__(self, job_id: str | None, refresh_s: float = 30.0, squeue: str | None = None):
        self.job_id = job_id if job_id and job_id.isdigit() else None
        self.refresh_s = max(refresh_s, 1.0)
        self.squeue = squeue or shutil.which("squeue")
        self._asked = -1e9  # monotonic time of the last answer
        self._left: int | None = None
        self.error = ""
        self._lock = threading.Lock()

    def left_s(self) -> int | None:
        """Seconds left (None: no job, no limit, or Slurm could not say)."""
        with self._lock:
            now = time.monotonic()
            if now - self._asked >= self.refresh_s:
                self._left, self.error = self._ask()
                self._asked = now
            if self._left is None:
                return None
            return max(0, int(round(self._left - (now - self._asked))))

    def _ask(self) -> tuple[int | None, str]:
        if self.job_id is None:
            return None, "not a Slurm job"
        if not self.squeue:
            return None, "squeue not found on PATH"
        try:
            r = subprocess.run([self.squeue, "-h", "-j", self.job_id, "-o", "%L"], capture_output=True, text=True,
                               timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"squeue: {e}"
        if r.returncode != 0:
            return None, f"squeue exit {r.returncode}: {r.stderr.strip()[:200]}"
        return parse_time_left(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""), ""


# -- the runs this server started -----------------------------------------------------------------------------------

def worker_spec_path(cmdline: list[str]) -> Path | None:
    """The spec.json a process serves, if it is a rank (`python -m scalelab.train.worker --spec PATH ...`) or an
    `srun` / `mpirun` that started ranks (both forward SIGUSR1 to their tasks); else None. A launcher that does not
    pass SIGUSR1 on (torchrun's agent: the signal would end it) is not one, even with the worker in its arguments."""
    if len(cmdline) < 3 or "--spec" not in cmdline[:-1]:
        return None
    rank = cmdline[1] == "-m" and cmdline[2] in WORKER_MODULES
    forwarder = os.path.basename(cmdline[0]) in FORWARDERS and any(m in cmdline for m in WORKER_MODULES)
    return Path(cmdline[cmdline.index("--spec") + 1]) if rank or forwarder else None


def server_runs(root_pid: int | None = None) -> dict[Path, dict]:
    """The runs whose ranks descend from this server: {run dir: {"pids": [...], "on_signal": bool}}. A spec that
    cannot be read counts as not protected."""
    import psutil
    runs: dict[Path, dict] = {}
    try:
        children = psutil.Process(root_pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return runs
    for proc in children:
        try:
            spec_path = worker_spec_path(proc.cmdline())
        except psutil.Error:
            continue
        if spec_path is None:
            continue
        run = runs.get(spec_path.parent)
        if run is None:
            try:
                on_signal = bool(load_spec(spec_path).checkpoint.on_signal)
            except Exception:  # a broken or vanished spec: this run cannot be saved by a signal
                on_signal = False
            run = runs[spec_path.parent] = {"pids": [], "on_signal": on_signal}
        run["pids"].append(proc.pid)
    return runs


def note_interrupted(run_dir: Path, job_id: str | None, signal_name: str, home: Path | None = None) -> None:
    """Mark `run_dir` as interrupted by its server job's end (walltime.json in it, a line in the registry)."""
    record = {"run_dir": str(run_dir), "job_id": job_id, "signal": signal_name, "time": time.time()}
    try:
        (run_dir / "walltime.json").write_text(json.dumps(record) + "\n", encoding="utf-8")
    except OSError:
        pass
    registry = (home or Path.home()) / REGISTRY
    try:
        registry.parent.mkdir(parents=True, exist_ok=True)
        with open(registry, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


class EndSignals:
    """Pass the job's end signal on to the server's protected runs, then let the server stop."""

    def __init__(self, log, job_id: str | None, grace_s: float = 25.0, home: Path | None = None):
        self.log, self.job_id, self.grace_s, self.home = log, job_id, grace_s, home
        self.received: str | None = None
        self.signalled: dict[Path, list[int]] = {}

    def forward(self, signal_name: str) -> dict[Path, list[int]]:
        """SIGUSR1 to every rank of every protected run (once per rank); returns {run dir: pids} signalled now."""
        self.received = self.received or signal_name
        now: dict[Path, list[int]] = {}
        runs = server_runs()
        self.log.warning("walltime: %s received (job %s): %d run(s) of this server", signal_name, self.job_id,
                         len(runs))
        for run_dir, run in runs.items():
            if not run["on_signal"]:
                self.log.warning("walltime: run %s has no checkpoint.on_signal: it ends with the job, unsaved",
                                 run_dir)
                continue
            fresh = [p for p in run["pids"] if p not in self.signalled.get(run_dir, [])]
            for pid in fresh:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    continue
            if fresh:
                if run_dir not in self.signalled:
                    note_interrupted(run_dir, self.job_id, signal_name, self.home)
                self.signalled.setdefault(run_dir, []).extend(fresh)
                now[run_dir] = fresh
                self.log.warning("walltime: %s: asked run %s (ranks %s) for an emergency checkpoint", signal_name,
                                 run_dir, fresh)
        return now

    def wait_signalled(self, timeout: float) -> bool:
        """Wait until every signalled rank has exited; False when `timeout` passed first."""
        import psutil
        deadline = time.monotonic() + timeout
        pids = [p for pids in self.signalled.values() for p in pids]
        def alive(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.Error:  # gone (or not ours to ask about): not waited for
                return False

        while time.monotonic() < deadline:
            if not [p for p in pids if alive(p)]:
                return True
            time.sleep(0.2)
        return False

    def install(self, on_term) -> None:
        """SIGUSR1: forward. SIGTERM: forward, wait for the ranks (in a thread), then `on_term(signum, frame)`."""
        def usr1(signum, _frame):
            threading.Thread(target=self.forward, args=("SIGUSR1",), name="walltime-usr1", daemon=True).start()

        def term(signum, frame):
            def then_stop():
                try:
                    self.forward("SIGTERM")
                    if self.signalled and not self.wait_signalled(self.grace_s):
                        self.log.warning("walltime: runs still saving after %.0f s; stopping anyway", self.grace_s)
                except Exception:  # the server must stop whatever went wrong here
                    self.log.exception("walltime: passing SIGTERM on failed; stopping")
                finally:
                    on_term(signum, frame)
            threading.Thread(target=then_stop, name="walltime-term", daemon=True).start()

        signal.signal(signal.SIGUSR1, usr1)
        signal.signal(signal.SIGTERM, term)


# -- the Jupyter server extension -------------------------------------------------------------------------------------

def walltime_info(clock: JobClock, ends: EndSignals, warn_s: float, signal_s: float) -> dict:
    """The endpoint's answer."""
    left = clock.left_s()
    runs = server_runs()
    protected = sum(1 for r in runs.values() if r["on_signal"])
    unprotected = len(runs) - protected
    warning = ""
    if left is not None:
        warning = (f"This server's Slurm job {clock.job_id} ends in about {max(round(left / 60), 1)} min: save "
                   "your notebooks.")
        if protected:
            warning += f" {protected} run(s) with checkpoint.on_signal will save an emergency checkpoint."
        if unprotected:
            warning += f" {unprotected} run(s) without checkpoint.on_signal will stop without one."
    return {"job_id": clock.job_id, "limited": clock.job_id is not None, "left_s": left,
            "warn_s": warn_s, "warn": left is not None and 0 < warn_s and left <= warn_s, "signal_s": signal_s,
            "signal": ends.received, "runs_protected": protected, "runs_unprotected": unprotected,
            "refresh_s": clock.refresh_s, "warning": warning, "error": clock.error}


def _handler_class():
    from jupyter_server.base.handlers import APIHandler
    from tornado import web

    class WalltimeHandler(APIHandler):
        """GET: the time left of this server's job (see the module docstring)."""

        auth_resource = "scalelab_walltime"

        @web.authenticated
        async def get(self):
            import asyncio
            s = self.settings["scalelab_walltime"]
            info = await asyncio.to_thread(walltime_info, s["clock"], s["ends"], s["warn_s"], s["signal_s"])
            self.set_header("Cache-Control", "no-store")
            self.finish(json.dumps(info))

    return WalltimeHandler


def _jupyter_server_extension_points():
    """Where jupyter_server finds this extension (enabled by jupyter_config/jupyter_server_config.d)."""
    return [{"module": "scalelab.hub.walltime"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Add the endpoint; take over SIGUSR1 and SIGTERM once the server has set its own handlers."""
    from jupyter_server.utils import url_path_join
    job_id = os.environ.get("SLURM_JOB_ID")
    clock = JobClock(job_id, env_float(REFRESH_ENV, 30.0))
    ends = EndSignals(serverapp.log, clock.job_id, env_float(GRACE_ENV, 25.0))
    serverapp.web_app.settings["scalelab_walltime"] = {
        "clock": clock, "ends": ends, "warn_s": env_float(WARN_ENV, 600.0), "signal_s": env_float(SIGNAL_ENV, 0.0)}
    route = url_path_join(serverapp.web_app.settings["base_url"], "scalelab", "walltime")
    serverapp.web_app.add_handlers(".*$", [(route, _handler_class())])
    # ServerApp sets its own handlers (init_signal) before it loads extensions: ours go over them now; should a
    # later jupyter_server set them after, the wrapper puts ours back
    ends.install(serverapp._signal_stop)
    original_init_signal = serverapp.init_signal

    def init_signal():
        original_init_signal()
        ends.install(serverapp._signal_stop)

    serverapp.init_signal = init_signal
    early = os.environ.pop(EARLY_SIGNAL_ENV, "")  # one that came before the server's handlers (singleuser)
    if early:
        threading.Thread(target=ends.forward, args=(early,), name="walltime-early", daemon=True).start()
    serverapp.log.info("scalelab walltime: job %s, warning at %.0f s left", clock.job_id or "(none)",
                       env_float(WARN_ENV, 600.0))


# -- the JupyterLab extension's bundle ---------------------------------------------------------------------------------

def lab_source_digest(source: Path = LAB_SOURCE) -> str:
    """SHA-256 over the extension's source files (src/*.js, package.json, package-lock.json)."""
    h = hashlib.sha256()
    for path in sorted([*source.glob("src/*.js"), source / "package.json", source / "package-lock.json"]):
        h.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def stamp_bundle(bundle: Path = LAB_BUNDLE, source: Path = LAB_SOURCE) -> None:
    """Write the source's digest into the built bundle's package.json (build.sh calls this after building)."""
    meta = json.loads((bundle / "package.json").read_text(encoding="utf-8"))
    meta["scalelab_source_sha256"] = lab_source_digest(source)
    (bundle / "package.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def bundle_is_current(bundle: Path = LAB_BUNDLE, source: Path = LAB_SOURCE) -> bool:
    """True when the committed bundle was built from the committed source."""
    meta = json.loads((bundle / "package.json").read_text(encoding="utf-8"))
    return meta.get("scalelab_source_sha256") == lab_source_digest(source)


__all__ = ["JobClock", "EndSignals", "parse_time_left", "server_runs", "note_interrupted", "walltime_info",
           "lab_source_digest", "stamp_bundle", "bundle_is_current", "WARN_ENV", "SIGNAL_ENV", "REFRESH_ENV",
           "GRACE_ENV"]
