"""The local mode's spawner: each student's server is a process on this machine (what `make hub` runs)."""
from __future__ import annotations

import os

from jupyterhub.spawner import LocalProcessSpawner

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
