"""The one error hierarchy of scalelab: every message says what was wrong, with the value, and what to do."""
from __future__ import annotations


class ScalelabError(Exception):
    """Base of every error scalelab raises on purpose."""


class SpecError(ScalelabError, ValueError):
    """A RunSpec field has a bad value; `field` is its dotted name."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class LaunchError(ScalelabError):
    """A run could not be started (launcher missing, scheduler refused the job, ...)."""


class RunFailed(ScalelabError):
    """A run ended in failure; `rank` is the first rank known to have failed (or None)."""

    def __init__(self, message: str, rank: int | None = None, run_dir: str | None = None):
        self.rank = rank
        self.run_dir = run_dir
        super().__init__(message)


class RunTimeout(ScalelabError, TimeoutError):
    """`Run.wait(timeout)` ran out of time; the run itself is left as it was."""


class ClusterError(ScalelabError):
    """The local Slurm cluster could not be started, stopped or queried."""


class SetupError(ScalelabError):
    """Something the machine needs is missing; the message names the command that installs it."""


class UntrustedFileError(ScalelabError, OSError):
    """A file a graded run left could not be read safely: missing, a link, not a regular file, or too large."""


class SpawnFailed(ScalelabError, RuntimeError):
    """A student's server could not start, for a reason the student should read (JupyterHub shows
    `jupyterhub_message` on the spawn page; the hub log gets the same text)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.jupyterhub_message = message
