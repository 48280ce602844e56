"""The slurm mode's spawner: batchspawner's SlurmSpawner with the course profiles and its known bugs fixed.

What differs from batchspawner 1.3.0 (each was seen to go wrong with JupyterHub 6.1.1, see STACK_FACTS):

- user options are bounded (`scalelab.hub.options`): only a course profile and a shorter walltime; the batch
  script is rendered from the resolved request (`scalelab.hub.batch`), never from raw user options;
- the port callback accepts only an integer port (`scalelab.hub.api`, installed when this module is imported);
- Slurm commands run without a shell, by absolute path, with SLURM_CONF handed over explicitly;
- squeue is asked every `poll_min` seconds at first, backing off to `poll_max` while the job waits in the queue;
  the port arrives as an event, so a running job costs no extra polling;
- a job that ends before its server listens fails the spawn at once, with the tail of the job's log;
- an squeue error that is not "no such job" keeps the server (the upstream drops it and orphans the job);
- a job cancelled from outside (`scancel`) is seen at the hub's next poll and the server is marked stopped;
- progress says where the job waits in the queue, and why;
- walltime (`scalelab.hub.walltime`): the job asks Slurm for its warning signal `walltime_signal_s` before its end
  (``--signal=B:USR1@N``, to the server, which passes it on to its runs), and the server learns the countdown's
  warning threshold and refresh from its environment.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import shlex
import time
from pathlib import Path

import batchspawner  # noqa: F401  (importing it adds its unsafe API handler: replaced just below)
from batchspawner import JobStatus, SlurmSpawner
from tornado import web
from traitlets import Dict, Float, Integer, List, Unicode, default

from ..cluster.slurm import job_phase
from ..errors import SpawnFailed
from ..paths import read_beneath
from .api import install_port_handler
from .batch import default_template_path, render_batch_script
from .course_spawner import CourseSpawner
from .options import (OptionError, check_student_total, options_form_html, options_from_form, partition_gpus,
                      profiles_from_settings, resolve_options, unavailable_reasons)
from .queue import QueueView, profile_queue_lines
from .walltime import GRACE_ENV, REFRESH_ENV, SIGNAL_ENV, WARN_ENV

install_port_handler()


class CourseSlurmSpawner(CourseSpawner, SlurmSpawner):
    """A student's server as a Slurm job, shaped by a course profile the student picks."""

    profiles = List(Dict(), help="Course profiles (dicts of scalelab.hub.options.Profile fields).").tag(config=True)
    default_profile = Unicode("", help="Profile used when the student names none.").tag(config=True)
    student_max_cpus = Integer(0, help="CPUs one student's servers may hold at once (0 = the largest profile's)."
                               ).tag(config=True)
    student_max_gpus = Integer(0, help="GPUs one student's servers may hold at once (0 = the largest profile's)."
                               ).tag(config=True)
    slurm_bin_dir = Unicode("/usr/bin", help="Absolute directory of sbatch, squeue, scancel, sinfo.").tag(config=True)
    slurm_conf = Unicode("", help="SLURM_CONF for every Slurm command and job ('' = Slurm's default)."
                         ).tag(config=True)
    course_prologue = Unicode("", help="Shell lines every job runs before the server.").tag(config=True)
    log_dir_template = Unicode("{home}/.scalelab/jobs", help="Job log folder; {home}, {username} filled in."
                               ).tag(config=True)
    bind_ip = Unicode("0.0.0.0", help="Address the server binds to on the compute node.").tag(config=True)
    node_address = Unicode("", help="Address the hub reaches the node by; {host} is the node name ('' = the "
                           "node's NodeAddr in Slurm, which is its name unless the site set an address).").tag(config=True)
    poll_min = Float(0.5, help="First interval between squeue calls while starting (s).").tag(config=True)
    poll_max = Float(5.0, help="Longest interval between squeue calls while starting (s).").tag(config=True)
    batch_template = Unicode(help="Path of the batch script template (jinja2).").tag(config=True)
    singleuser_wrapper = List(Unicode(), help="Command that reports the port, then runs the server "
                              "(scalelab.hub.singleuser).").tag(config=True)
    queue_cache_s = Float(5.0, help="Seconds the hub's one view of the queue (sinfo, reservations, pending jobs) "
                          "is reused by every spawn form and pending page before Slurm is asked again."
                          ).tag(config=True)
    walltime_warn_s = Integer(600, help="Seconds before the job's end at which JupyterLab warns the student."
                              ).tag(config=True)
    walltime_signal_s = Integer(120, help="Seconds before the job's end at which Slurm signals the server "
                                "(--signal=B:USR1@N), which asks its runs for an emergency checkpoint (0: none; "
                                "the final SIGTERM still is passed on).").tag(config=True)
    walltime_refresh_s = Float(30.0, help="Seconds between a server's squeue calls for its time left (the "
                               "countdown runs on the browser's clock in between).").tag(config=True)
    walltime_grace_s = Float(25.0, help="Seconds a server waits, on the job's final SIGTERM, for its runs to save "
                             "before it stops (Slurm's KillWait ends them all anyway).").tag(config=True)
    log_tail_lines = 25

    @default("exec_prefix")
    def _exec_prefix_default(self):
        return "sudo -E -u {username}" if self.run_as == "student-accounts" else ""

    @default("batch_template")
    def _batch_template_default(self):
        return str(default_template_path())

    @default("singleuser_wrapper")
    def _wrapper_default(self):
        return [os.path.join(self.python_bin, "python"), "-m", "scalelab.hub.singleuser"]

    @default("options_form")
    def _options_form_default(self):
        return CourseSlurmSpawner._render_form

    @default("options_from_form")
    def _options_from_form_default(self):
        return options_from_form

    @default("apply_user_options")
    def _apply_default(self):
        return CourseSlurmSpawner._apply_course_options

    @default("req_homedir")
    def _homedir_default(self):
        return str(self.course_home())

    # -- profiles and options -----------------------------------------------------------------------------------

    def course_profiles(self):
        """The profiles as scalelab.hub.options.Profile objects."""
        return profiles_from_settings({"profiles": self.profiles})

    def queue_view(self) -> QueueView:
        """The hub's one view of the queue (`scalelab.hub.queue`), shared by every student's spawner. Slurm is asked
        as the hub, not as the student: at a first start the course account does not exist yet (run as that account
        sinfo failed, so every profile looked available), and a student's own squeue may not show the other jobs
        whose count gives a place in the queue. Only counts and times leave it."""
        run = functools.partial(self._slurm, timeout=10, as_student=False)  # a form waits at most this for Slurm
        return QueueView.shared(run, self.slurm_bin_dir, self.slurm_conf, self.queue_cache_s)

    async def unavailable_profiles(self) -> dict[str, str]:
        """The profiles this cluster cannot give, each with why (`options.unavailable_reasons`): a partition it does
        not have, or no node there with the GPUs asked for; from the shared queue view (one sinfo per
        `queue_cache_s`). When sinfo itself fails (Slurm down), nothing is marked and sbatch's refusal says why."""
        snap = await self.queue_view().snapshot()
        if snap.partitions is None:
            self.log.warning("sinfo failed (%s); every profile is offered", snap.error)
            return {}
        if not snap.partitions:
            return {}
        return unavailable_reasons(self.course_profiles(), partition_gpus(snap.gres_lines()))

    @staticmethod
    async def _render_form(spawner):
        snap = await spawner.queue_view().snapshot()
        return options_form_html(spawner.course_profiles(), spawner.default_profile,
                                 await spawner.unavailable_profiles(),
                                 queue=profile_queue_lines(snap, spawner.course_profiles()),
                                 queue_time=time.strftime("%H:%M:%S", time.localtime(snap.taken)))

    @staticmethod
    async def _apply_course_options(spawner, user_options):
        try:
            request = resolve_options(user_options, spawner.course_profiles(), spawner.default_profile,
                                      await spawner.unavailable_profiles())
            check_student_total(request, spawner.other_servers_profiles(), spawner.course_profiles(),
                                spawner.student_max_cpus, spawner.student_max_gpus)
            spawner.job_request = request
        except OptionError as e:
            raise web.HTTPError(400, str(e)) from None

    def other_servers_profiles(self) -> list[str]:
        """The profile names of this student's other servers that are running or starting (named servers)."""
        names = []
        for spawner in getattr(self.user, "spawners", {}).values():
            if spawner is not self and (spawner.active or spawner.pending):
                names.append(str((spawner.user_options or {}).get("profile") or self.default_profile))
        return names

    # -- running Slurm commands: no shell, absolute paths, explicit environment ------------------------------------

    def _bin(self, name: str) -> str:
        return os.path.join(self.slurm_bin_dir, name)

    def _prefix(self) -> list[str]:
        return shlex.split(self.exec_prefix.format(username=self.user.name)) if self.exec_prefix else []

    def slurm_env(self) -> dict:
        """Environment of Slurm client commands: only what they need."""
        env = {"PATH": f"{self.slurm_bin_dir}:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    async def _slurm(self, argv, input=None, env=None, timeout=60.0, as_student=True):
        """Run a Slurm command (argv list) as the student (through `exec_prefix`), or with `as_student=False` as the
        hub (what the cluster offers, which no account's existence may change); return (returncode, stdout, stderr);
        never raises for exit codes."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *(self._prefix() if as_student else ()), *argv, env=env or self.slurm_env(), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            return 127, "", f"{argv[0]}: {e}"
        try:
            out, err = await asyncio.wait_for(proc.communicate(input.encode() if input else None), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return 124, "", f"{argv[0]} did not answer in {timeout:g} s"
        except asyncio.CancelledError:  # a cancelled spawn: do not leave the command behind
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            raise
        return proc.returncode, out.decode(errors="replace").strip(), err.decode(errors="replace").strip()

    async def run_command(self, cmd, input=None, env=None):
        """Upstream's shell runner is never used here (commands are argv lists)."""
        raise RuntimeError("CourseSlurmSpawner runs no shell commands")

    # -- submit, query, cancel --------------------------------------------------------------------------------------

    def get_env(self):
        """The server's environment, with SLURM_CONF so that `srun`/`sbatch` work from the notebook."""
        env = super().get_env()
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        env.setdefault("PATH", f"{self.python_bin}:{self.slurm_bin_dir}:/usr/local/bin:/usr/bin:/bin")
        env.update({WARN_ENV: str(self.walltime_warn_s), SIGNAL_ENV: str(self.walltime_signal_s),
                    REFRESH_ENV: f"{self.walltime_refresh_s:g}", GRACE_ENV: f"{self.walltime_grace_s:g}"})
        return env

    def log_dir(self) -> Path:
        """Where this student's job logs go."""
        return Path(self.log_dir_template.format(home=self.course_home(), username=self.user.name))

    def job_log(self) -> Path | None:
        """The log file of the current job, once it has an id."""
        return self.log_dir() / f"{self._job_stem()}-{self.job_id}.log" if self.job_id else None

    def _job_stem(self) -> str:
        return f"jupyter-{self.name}" if self.name else "jupyter"

    def batch_script(self, request) -> str:
        """The batch script for `request` (a resolved scalelab.hub.options.JobRequest)."""
        env = self.get_env()
        name = f"jupyter-{self.user.name}" + (f"-{self.name}" if self.name else "")
        cmd = [*self.singleuser_wrapper, *self.cmd, *self.get_args()]
        return render_batch_script(
            request, username=self.user.name, job_name=name,
            log_path=str(self.log_dir() / f"{self._job_stem()}-%j.log"), workdir=str(self.course_home()),
            export_vars=env.keys(), cmd=cmd, prologue=self.course_prologue,
            provision_cmd=self.provision_argv() if self.labs_source and self.labs_where == "job" else (),
            template=Path(self.batch_template).read_text(encoding="utf-8"), signal_s=self.walltime_signal_s)

    async def submit_batch_script(self):
        """sbatch the script; a spawn cancelled while sbatch runs still cancels the job it created."""
        request = getattr(self, "job_request", None)
        if request is None:  # apply_user_options did not run (direct start): resolve here, same bounds
            await self._apply_course_options(self, self.user_options)
            request = self.job_request
        script = self.batch_script(request)
        self.log.debug("Batch script for %s:\n%s", self._log_name, script)
        env = self.get_env()
        env.update({k: v for k, v in self.slurm_env().items() if k not in env})
        task = asyncio.ensure_future(self._slurm([self._bin("sbatch"), "--parsable"], input=script, env=env))
        try:
            rc, out, err = await asyncio.shield(task)
        except asyncio.CancelledError:
            rc, out, err = await task
            if rc == 0:
                self.job_id = out.splitlines()[-1].split(";")[0]
                await self.cancel_batch_job()
            raise
        if rc != 0:
            raise SpawnFailed(f"Slurm refused the job (sbatch exit {rc}): {err or out}")
        try:
            self.job_id = str(int(out.splitlines()[-1].split(";")[0]))
        except (ValueError, IndexError):
            raise SpawnFailed(f"could not read a job id from sbatch's answer {out!r}") from None
        self.log.info("Submitted job %s for %s (profile %s, %s)", self.job_id, self._log_name,
                      request.profile.name, request.walltime)
        return self.job_id

    async def query_job_status(self):
        """RUNNING / PENDING / UNKNOWN (still there, or squeue failed) / NOTFOUND (ended or unknown to Slurm)."""
        if not self.job_id:
            self.job_status = ""
            return JobStatus.NOTFOUND
        rc, out, err = await self._slurm([self._bin("squeue"), "-h", "-t", "all", "-j", self.job_id,
                                          "-o", "%T|%B|%r"], timeout=30)
        if rc != 0:
            if "invalid job id" in err.lower():
                self.job_status = "GONE||"
                return JobStatus.NOTFOUND
            self.log.warning("squeue failed for job %s (exit %s): %s; keeping the server", self.job_id, rc, err)
            return JobStatus.UNKNOWN
        self.job_status = out.splitlines()[-1] if out else "GONE||"
        host = self._field(1)
        if host and not self.node_address and host not in self._node_addrs():
            self._node_addrs()[host] = await self._node_addr(host)
        # A COMPLETING job's server is on its way out: for the hub it has ended, like every state past it.
        phase = job_phase(self.job_status.split("|")[0])
        return {"running": JobStatus.RUNNING, "pending": JobStatus.PENDING, "held": JobStatus.UNKNOWN}.get(
            phase, JobStatus.NOTFOUND)

    def _field(self, i: int) -> str:
        parts = (self.job_status or "").split("|")
        return parts[i] if len(parts) > i else ""

    def state_ispending(self):
        return job_phase(self._field(0)) == "pending"

    def state_isrunning(self):
        return job_phase(self._field(0)) == "running"

    def state_gethost(self):
        host = self._field(1)
        return self.node_address.format(host=host) if self.node_address else self._node_addrs().get(host, host)

    def _node_addrs(self) -> dict[str, str]:
        return self.__dict__.setdefault("_addr_of_node", {})

    async def _node_addr(self, host: str) -> str:
        """The node's NodeAddr (`scontrol show node`): the hub may not resolve node names (namespace nodes)."""
        rc, out, _ = await self._slurm([self._bin("scontrol"), "show", "node", "-o", host], timeout=30)
        m = re.search(r"\bNodeAddr=(\S+)", out) if rc == 0 else None
        return m.group(1) if m else host

    async def cancel_batch_job(self):
        """scancel the job (errors are logged: the job may already be gone)."""
        if not self.job_id:
            return
        rc, _, err = await self._slurm([self._bin("scancel"), self.job_id], timeout=30)
        self.log.info("Cancelled job %s of %s%s", self.job_id, self._log_name, f" ({err})" if rc else "")

    # -- the lifecycle ------------------------------------------------------------------------------------------------

    def report_port(self, port: int) -> None:
        """Called by scalelab.hub.api when the job's server reports its port."""
        self.port = int(port)
        event = getattr(self, "_port_event", None)
        if event is not None:
            event.set()

    def _job_failure(self, what: str) -> SpawnFailed:
        """The failure of a job that ended too early, with the tail of its log for the student."""
        state = self._field(0) or "gone"
        log = self.job_log()
        tail = ""
        if log is not None:
            tail = self._log_tail(log)
        self.clear_state()
        return SpawnFailed(f"Your job {self.job_id or ''} ended ({state}) {what}. Its log is {log}; "
                           f"last lines:\n{tail or '(empty)'}")

    def _log_tail(self, log: Path) -> str:
        """The last lines of a job log in the student's home, read as the hub (root, at a site) may: no symbolic
        link below the home is followed, no FIFO or device is opened, no file with other hard links is read, and
        never more than 64 KiB (a student can plant any of those at the predictable path of a future job)."""
        home = Path(self.course_home())
        base = home if log.is_relative_to(home) else log.parent  # a log folder outside homes is the site's own
        try:
            data = read_beneath(base, log.relative_to(base), 64 * 1024, tail=True, single_link=True)
        except (OSError, ValueError) as e:
            return f"(could not read the log: {e})"
        lines = data.decode("utf-8", errors="replace").splitlines()[-self.log_tail_lines:]
        return "\n".join(lines)[-3000:]

    async def start(self):
        """Submit the job, wait in the queue, then for the port and for the server to listen; (host, port)."""
        self.ip, self.port = self.bind_ip, 0
        if self.server:
            self.server.port = 0
        self._port_event = asyncio.Event()
        await asyncio.to_thread(self.ensure_account)  # the log folder is in the account's home
        await self.prepare_home(extra_dirs=[self.log_dir()])
        await self.submit_batch_script()
        interval = self.poll_min
        while True:
            reported_before = self._port_event.is_set()
            status = await self.query_job_status()
            if status == JobStatus.RUNNING:
                break
            if status == JobStatus.NOTFOUND:
                raise self._job_failure("before it started running")
            if status == JobStatus.PENDING:
                await self._refresh_place()
            if reported_before:  # reported before we asked, yet squeue does not say RUNNING: ask again later
                await asyncio.sleep(interval)
            elif not self._port_event.is_set():  # a port reported meanwhile means the job runs: ask at once
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._port_event.wait(), timeout=interval)
            # else: reported while squeue was answering, so its answer is already stale: ask again now
            interval = min(interval * 1.5, self.poll_max)
        host = self.state_gethost()
        interval = self.poll_min
        while not self._port_event.is_set():
            try:
                await asyncio.wait_for(self._port_event.wait(), timeout=interval)
            except asyncio.TimeoutError:
                if await self.query_job_status() == JobStatus.NOTFOUND:
                    raise self._job_failure("before its server reported a port")
                interval = min(interval * 1.5, self.poll_max)
        await self._wait_listening(host, self.port)
        self.log.info("Job %s of %s serves at %s:%s", self.job_id, self._log_name, host, self.port)
        return host, self.port

    async def _wait_listening(self, host: str, port: int) -> None:
        """Wait until host:port accepts connections; fail early if the job ends meanwhile."""
        deadline = time.monotonic() + self.http_timeout
        next_check = time.monotonic() + self.poll_min
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=2)
                writer.close()
                return
            except (OSError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SpawnFailed(f"the server of job {self.job_id} reported port {port} but did not listen on "
                                  f"{host}:{port} within {self.http_timeout} s; see {self.job_log()}")
            if time.monotonic() > next_check:
                next_check = time.monotonic() + self.poll_max
                if await self.query_job_status() == JobStatus.NOTFOUND:
                    raise self._job_failure("before its server answered")
            await asyncio.sleep(0.1)

    async def poll(self):
        """None while the job is there (or Slurm cannot say); 1 once it has ended, e.g. after an outside scancel."""
        status = await self.query_job_status()
        if status in (JobStatus.PENDING, JobStatus.RUNNING, JobStatus.UNKNOWN):
            return None
        self.log.warning("Job %s of %s has ended (%s): marking the server stopped", self.job_id, self._log_name,
                         self._field(0) or "gone")
        self.clear_state()
        return 1

    async def stop(self, now=False):
        """Cancel the job; unless `now`, wait (up to 10 s) until Slurm no longer runs it."""
        if not self.job_id:
            return
        await self.cancel_batch_job()
        if now:
            return
        for _ in range(20):
            if await self.query_job_status() not in (JobStatus.RUNNING, JobStatus.UNKNOWN, JobStatus.PENDING):
                return
            await asyncio.sleep(0.5)
        self.log.warning("Job %s of %s may not have ended after scancel", self.job_id, self._log_name)

    async def _refresh_place(self) -> None:
        """The pending job's place in its partition's queue and Slurm's expected start, for `progress` (from the
        hub's shared pending list: one squeue per `queue_cache_s` for every pending student). A failing squeue
        leaves the place unknown and the spawn going."""
        try:
            place = await self.queue_view().place(self.job_id)
        except Exception as e:  # the place is a courtesy: it never fails a spawn
            self.log.warning("queue place of job %s: %s", self.job_id, e)
            place = None
        self.__dict__["_queue_place"] = place.text() if place else ""

    async def progress(self):
        """Progress events: queued (with Slurm's reason, its place among the pending jobs of its partition and the
        expected start, refreshed as the job is polled), running, server starting."""
        last = None
        while True:
            if self.state_ispending():
                reason = self._field(2)
                msg = f"Job {self.job_id} is waiting in the queue" + (f" (reason: {reason})"
                                                                         if reason and reason != "None" else "")
                place = self.__dict__.get("_queue_place", "")
                if place:
                    msg += f"; {place}"
                progress = 20
            elif self.state_isrunning():
                msg = f"Job {self.job_id} is running on {self._field(1)}: starting JupyterLab"
                progress = 60
                if self.port:
                    msg, progress = f"JupyterLab is up on {self._field(1)}:{self.port}: connecting", 90
            elif self.job_id:
                msg, progress = f"Job {self.job_id} submitted", 10
            else:
                msg, progress = "Submitting the job to Slurm", 5
            if msg != last:
                yield {"progress": progress, "message": msg}
                last = msg
            await asyncio.sleep(0.5)

    def get_state(self):
        """Job id (upstream) plus the chosen profile, kept over hub restarts."""
        state = super().get_state()
        request = getattr(self, "job_request", None)
        if request is not None and self.job_id:
            state["profile"] = request.profile.name
        return state
