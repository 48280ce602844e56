"""What every course spawner does, whatever runs the server: the student's directory, the labs, the environment.

Two ways to run a student's server (setting `servers.run_as`):

- ``hub-account`` (what ``run_as: auto`` picks on a hub that is not root): the server runs as the account running
  the hub; each student works in their own directory (`servers.home`, by default ``<state_dir>/homes/<name>``).
  Simple, needs no Unix accounts, no sudo, and works with a Python environment only that account can read. Students
  are kept apart only by the hub (a server only accepts its owner), not by Unix permissions: code in one server can
  read every other student's work and the hub's secrets, so it is refused for more than one person unless
  ``shared_account`` (a private try-out). When that account is root the server is started with ``--allow-root``.
- ``student-accounts``: each student is a Unix account (PAM login at a site) and the server runs as that account,
  in its home; the Python environment must be readable by every student (e.g. on the shared filesystem). With
  ``create_accounts`` (one machine, a root hub: what ``run_as: auto`` picks there) the hub creates a course account
  for each student at their first start, in group ``scalelab-students``, home 0700; it never runs a server as an
  account it did not create, nor as a system account.

A root hub refuses ``hub-account`` (students' code would run as root) unless ``allow_root_servers`` is set; see
`scalelab.hub.posture`. A link that starts a server (GET /hub/spawn?profile=...) is refused unless
``spawn_from_link``: only the form's POST, which carries the page's xsrf token, starts one.
"""
from __future__ import annotations

import asyncio
import grp
import os
import pwd
import shlex
import subprocess
import sys
from pathlib import Path

from tornado import web
from traitlets import Bool, Enum, List, Unicode, default
from traitlets.config import LoggingConfigurable

from ..errors import SpawnFailed
from ..run.inject import ENV_VAR as INJECT_ENV
from .api import install_body_limits
from .posture import COURSE_GROUP, system_account
from .provision import DEFAULT_EXCLUDE, provision_labs

install_body_limits()


class CourseSpawner(LoggingConfigurable):
    """Course behaviour put in front of a JupyterHub spawner class (`class X(CourseSpawner, LocalProcessSpawner)`):
    homes, labs hand-out, explicit environment, --allow-root. Its settings go in config section `CourseSpawner`."""

    run_as = Enum(["hub-account", "student-accounts"], "hub-account",
                  help="Which Unix account runs a student's server (see scalelab.hub.course_spawner).").tag(config=True)
    home_template = Unicode("", help="Student directory with run_as hub-account; {username} is filled in."
                            ).tag(config=True)
    labs_source = Unicode("", help="Folder of course labs to hand out ('' = none).").tag(config=True)
    labs_dest = Unicode("labs", help="Folder inside the student's home that receives the labs.").tag(config=True)
    labs_exclude = List(Unicode(), list(DEFAULT_EXCLUDE), help="Glob patterns of names never handed out."
                        ).tag(config=True)
    labs_where = Enum(["hub", "job"], "hub", help="hub: the hub copies the labs before the start; job: the "
                      "server's own process does, as the student (for root-squashed homes).").tag(config=True)
    python_bin = Unicode(help="Directory holding jupyterhub-singleuser and the course Python.").tag(config=True)
    create_accounts = Bool(False, help="With student-accounts: create a course account (group scalelab-students, "
                           "home 0700) at a student's first start; never use an account the hub did not create."
                           ).tag(config=True)
    inject_file = Unicode("", help="The capstone's spool file (capstone.inject_file): every server gets it as "
                          "SCALELAB_INJECT_FILE, so the runs started there poll it for an instructor's injected "
                          "failure ('' = none).").tag(config=True)
    spawn_from_link = Bool(False, help="Start a server from GET /hub/spawn with options in the query (a link on any "
                           "site could); False: only the form's POST starts one.").tag(config=True)

    @default("python_bin")
    def _python_bin_default(self):
        return os.path.dirname(sys.executable)

    @default("notebook_dir")
    def _notebook_dir_default(self):
        return str(self.course_home())

    def course_home(self) -> Path:
        """The student's directory: from servers.home (hub-account) or the Unix account's home."""
        if self.run_as == "student-accounts":
            return Path(pwd.getpwnam(self.user.name).pw_dir)
        return Path(self.home_template.format(username=self.user.name))

    def account_ids(self) -> tuple[int, int] | None:
        """(uid, gid) of the student's account with run_as student-accounts, else None."""
        if self.run_as != "student-accounts":
            return None
        pw = pwd.getpwnam(self.user.name)
        return pw.pw_uid, pw.pw_gid

    def runs_as_root(self) -> bool:
        """True when the server process will run as root (hub-account on a root hub)."""
        return self.run_as == "hub-account" and os.geteuid() == 0

    def options_from_query(self, query_data):
        """Options from a spawn link's query: refused unless spawn_from_link (the form POST is the way to start)."""
        if not self.spawn_from_link:
            raise web.HTTPError(400, "Starting a server from a link is turned off on this hub: choose your options "
                                     "in the form below and press Start.")
        return super().options_from_query(query_data)

    def ensure_account(self) -> None:
        """With create_accounts on a root hub: the student's course account, created at the first start. A system
        account, or an account the hub did not create (not in group scalelab-students), is refused."""
        if self.run_as != "student-accounts" or not self.create_accounts:
            return
        name = self.user.name
        if system_account(name):
            raise SpawnFailed(f"{name!r} is a system account's name: sign in under your own name")
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            pw = None
        if pw is not None:
            groups = {g.gr_name for g in grp.getgrall() if name in g.gr_mem}
            if COURSE_GROUP not in groups and grp.getgrgid(pw.pw_gid).gr_name != COURSE_GROUP:
                raise SpawnFailed(f"the name {name!r} belongs to an account on this machine that is not a course "
                                  "account; ask your instructor for another name")
            self._register_in_slurm(name)  # once per hub process: an account made before accounting was on
            return
        if os.geteuid() != 0:
            raise SpawnFailed("servers.create_accounts needs a hub running as root; ask your instructor")
        for argv in (["groupadd", "-f", "-r", COURSE_GROUP],
                     ["useradd", "--create-home", "--shell", "/bin/bash", "--groups", COURSE_GROUP,
                      "--comment", "scalelab course account", name]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if r.returncode:
                raise SpawnFailed(f"could not create the course account {name!r}: {r.stderr.strip()[:300]}")
        os.chmod(pwd.getpwnam(name).pw_dir, 0o700)  # classmates may not read each other's homes
        self.log.info("Created course account %s (group %s)", name, COURSE_GROUP)
        self._register_in_slurm(name)

    _registered: set = set()

    def _register_in_slurm(self, name: str) -> None:
        """The course account's association on the local cluster, with the per-student QOS (its jobs from a
        terminal are held to what one student may hold; scalelab.cluster.accounting). Without one, a cluster that
        enforces associations refuses every job of the account. A centre's Slurm: its administrators' to do."""
        if name in CourseSpawner._registered:
            return
        from ..cluster.accounting import register_user
        from ..errors import ClusterError
        conf = getattr(self, "slurm_conf", None)  # local mode: the local cluster, if there is one
        try:
            if register_user(name, conf or ("/etc/slurm/slurm.conf" if conf == "" else None), student=True):
                self.log.info("Course account %s: association with the student QOS in the local Slurm", name)
        except ClusterError as e:
            if conf is not None:  # slurm mode: its jobs would be refused; say why now
                raise SpawnFailed(f"could not give the course account {name!r} its Slurm association: {e}") from None
            # local mode: the server needs no Slurm; the cluster's next `up()` registers every course account
            self.log.warning("Course account %s has no association in the local Slurm (%s)", name, e)
            return
        CourseSpawner._registered.add(name)

    def user_env(self, env):
        """USER, HOME and SHELL of the student, without requiring a Unix account in hub-account mode."""
        env["USER"] = self.user.name
        env["HOME"] = str(self.course_home())
        env["SHELL"] = "/bin/bash"
        if self.inject_file:  # local and Slurm servers alike (batchspawner's get_env calls user_env too)
            env[INJECT_ENV] = self.inject_file  # the file every engine run polls
        return env

    def get_args(self):
        """The server's arguments: --allow-root when it runs as root (see module docstring)."""
        args = super().get_args()
        if self.runs_as_root() and "--allow-root" not in args:
            args.append("--allow-root")
        return args

    def provision_argv(self) -> list[str]:
        """The command that hands the labs out as the current user (used with labs_where job)."""
        argv = [os.path.join(self.python_bin, "python"), "-m", "scalelab.hub.provision", self.labs_source,
                str(self.course_home()), "--dest", self.labs_dest]
        for pat in self.labs_exclude:
            argv += ["--exclude", pat]
        return argv

    async def prepare_home(self, extra_dirs=()) -> None:
        """Create the student's directory (and `extra_dirs` in it) and hand the labs out when the hub does that."""
        await asyncio.to_thread(self.ensure_account)
        home = self.course_home()
        dirs = [str(d) for d in (home, *extra_dirs)]
        if self.account_ids() is None:
            for d in dirs:  # 0700: with hub-account, students' directories share one Unix account's files
                await asyncio.to_thread(os.makedirs, d, 0o700, True)
        else:
            await self._run_as_student(["/bin/mkdir", "-p", *dirs], "creating directories")
        if not self.labs_source or self.labs_where != "hub":
            return
        if self.account_ids() is None:
            report = await asyncio.to_thread(provision_labs, self.labs_source, home, self.labs_dest,
                                             self.labs_exclude)
            self.log.info("Labs for %s: copied %d, updated %d, beside edited %d, refused %d", self.user.name,
                          len(report.copied), len(report.updated), len(report.beside), len(report.refused))
        else:
            await self._run_as_student(self.provision_argv(), "handing out labs")

    async def _run_as_student(self, argv: list[str], what: str) -> None:
        """Run `argv` as the student's account: the hub never writes into a student's home as root.

        A root hub switches user itself; another hub account goes through its `exec_prefix` (sudo)."""
        from jupyterhub.spawner import set_user_setuid

        preexec = None
        if os.geteuid() == 0:
            preexec = set_user_setuid(self.user.name, chdir=False)
        elif getattr(self, "exec_prefix", ""):
            argv = [*shlex.split(self.exec_prefix.format(username=self.user.name)), *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, preexec_fn=preexec,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={"PATH": "/usr/bin:/bin"})
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
        if proc.returncode:
            self.log.error("%s for %s failed (exit %s): %s", what, self.user.name, proc.returncode,
                           out.decode(errors="replace")[-2000:])
