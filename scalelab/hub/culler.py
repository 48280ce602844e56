"""jupyterhub-idle-culler as the hub runs it: the same program, but it exits at once when the hub stops it.

    python -m scalelab.hub.culler --timeout=3600 --cull-every=300

Seen here: a culler started by a hub that was itself started in the background did not end on the hub's SIGINT,
and every hub stop then waited ~30 s for JupyterHub's SIGINT/SIGTERM/SIGKILL sequence (whose timeouts cannot be
configured for services). The culler keeps no state, so exiting on the signal loses nothing.
"""
from __future__ import annotations

import os
import signal
import sys


def _exit_now(signum, frame):  # noqa: ARG001  (signal handler signature)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Install the exit-at-once handlers, then run jupyterhub_idle_culler's own main with `argv`."""
    signal.signal(signal.SIGINT, _exit_now)
    signal.signal(signal.SIGTERM, _exit_now)
    from jupyterhub_idle_culler import main as culler_main

    sys.argv = ["jupyterhub-idle-culler", *(sys.argv[1:] if argv is None else argv)]
    culler_main()


if __name__ == "__main__":
    main()
