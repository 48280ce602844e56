"""The local mode's spawner: each student's server is a process on this machine (what `make hub` runs)."""
from __future__ import annotations

import asyncio
import os

from jupyterhub.spawner import LocalProcessSpawner

from ..run.procs import kill_every_process_of
from .course_spawner import CourseSpawner


class CourseLocalSpawner(CourseSpawner, LocalProcessSpawner):
    """LocalProcessSpawner with the course's homes and labs; no Unix account needed with run_as hub-account."""

    def make_preexec_fn(self, name):
        """Switch to the student's account (student-accounts), else only start in the student's directory."""
        if self.run_as == "student-accounts":
            return super().make_preexec_fn(name)
        home = str(self.course_home())

        def preexec():
            os.chdir(home)

        return preexec

    async def start(self):
        """Prepare the student's directory and labs, then start the server process."""
        await self.prepare_home()
        return await super().start()

    async def stop(self, now=False):
        """Stop the server; then, with course accounts, end every process the student's account still has when this
        was their last server: what a terminal left behind (setsid, nohup, a double fork) does not outlive it."""
        await super().stop(now=now)
        if self.run_as != "student-accounts" or not self.create_accounts or os.geteuid() != 0:
            return  # only a course account exists for the course alone; a person's own account is never swept
        if any(s is not self and s.active for s in self.user.spawners.values()):
            return
        uid, gid = self.account_ids()
        left = await asyncio.to_thread(kill_every_process_of, uid, gid)
        if left:
            self.log.info("Ended %d process(es) of %s left behind by the stopped server", left, self.user.name)

