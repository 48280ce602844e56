"""What every course spawner does, whatever runs the server: the student's directory, the labs, the environment.

Two ways to run a student's server (setting `servers.run_as`):

- ``hub-account`` (the default, and what `make hub` uses): the server runs as the account running the hub; each
  student works in their own directory (`servers.home`, by default ``<state_dir>/homes/<name>``). Simple, needs no
  Unix accounts, no sudo, and works with a Python environment only that account can read. Students are kept
  apart by the hub (a server only accepts its owner), not by Unix permissions: right for a laptop, a demo, or a
  dedicated course VM. When that account is root the server is started with ``--allow-root``.
- ``student-accounts``: each student is a Unix account (PAM login at a site) and the server runs as that account,
  in its home; the Python environment must be readable by every student (e.g. on the shared filesystem).
"""
from __future__ import annotations

import asyncio
import os
import pwd
import shlex
import sys
from pathlib import Path

from traitlets import Enum, List, Unicode, default
from traitlets.config import LoggingConfigurable

from .provision import DEFAULT_EXCLUDE, provision_labs


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

    def user_env(self, env):
        """USER, HOME and SHELL of the student, without requiring a Unix account in hub-account mode."""
        env["USER"] = self.user.name
        env["HOME"] = str(self.course_home())
        env["SHELL"] = "/bin/bash"
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
        home = self.course_home()
        dirs = [str(d) for d in (home, *extra_dirs)]
        if self.account_ids() is None:
            for d in dirs:
                await asyncio.to_thread(os.makedirs, d, 0o755, True)
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
