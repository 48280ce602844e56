"""Start a student's server inside a batch job: pick a port, report it to the hub, run jupyterhub-singleuser.

    python -m scalelab.hub.singleuser /venv/bin/jupyterhub-singleuser [ARGS...]
    python -m scalelab.hub.singleuser --no-report /venv/bin/jupyterhub-singleuser [ARGS...]   # local mode

What batchspawner-singleuser does, made lean, because every second here is a second the student waits:

- it imports only the standard library before the port is reported (batchspawner's wrapper imports
  `jupyterhub.services.auth` and `requests` first: ~1.8 s on a 2-core node);
- it reports exactly ``{"port": N}`` — all that scalelab's hub handler accepts;
- it stops jsonschema from importing `rfc3987_syntax`, which builds a Lark grammar at import time (~2 s here) and
  is only used for the optional "iri"/"iri-reference" formats, which no Jupyter event schema uses;
- it stops JupyterLab from running `node yarn.js config --json` while `jupyterlab.labapp` is imported (0.24 s and
  0.28 CPU-s of every server start, a quarter of its CPU: in a class rush on a node, the servers queue for the
  cores). JupyterLab asks only to learn yarn's npm registry, which it uses to install source extensions from npm;
  a course server installs none, so it gets yarn's default registry without asking.
"""
from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse, urlunparse


def pick_port() -> int:
    """A TCP port free on this node right now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def report_port(api_url: str, token: str, port: int, attempts: int = 5) -> None:
    """POST {"port": port} to the hub's /batchspawner API with the server's own token (retried briefly)."""
    req = urllib.request.Request(api_url.rstrip("/") + "/batchspawner", method="POST",
                                 data=json.dumps({"port": port}).encode(),
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=10):
                return
        except urllib.error.HTTPError as e:  # the hub answered: retrying will not change its mind
            raise SystemExit(f"scalelab singleuser: the hub refused port {port}: {e.code} {e.read()[:300]!r}")
        except OSError as e:
            if attempt == attempts - 1:
                raise SystemExit(f"scalelab singleuser: cannot reach the hub at {api_url}: {e}")
            time.sleep(1 + attempt)


def with_port(url: str, port: int) -> str:
    """`url` with its port replaced."""
    parts = urlparse(url)
    return urlunparse(parts._replace(netloc=f"{parts.hostname}:{port}"))


def skip_yarn_config() -> None:
    """JupyterLab learns the npm registry without starting node (see the module docstring); nothing without
    JupyterLab."""
    try:
        import jupyterlab.commands as commands  # imported by the server a moment later anyway
    except ImportError:
        return
    if hasattr(commands, "_yarn_config"):
        commands._yarn_config = lambda logger=None: {"yarn config": {}, "npm config": {}}


def main(argv: list[str] | None = None) -> None:
    """Report a port (unless --no-report), then run the server command in this process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    report = not (argv and argv[0] == "--no-report")  # local mode: the hub chose the port already
    argv = argv if report else argv[1:]
    if not argv:
        raise SystemExit("usage: python -m scalelab.hub.singleuser [--no-report] /path/to/jupyterhub-singleuser "
                         "[ARGS...]")
    if report:
        port = pick_port()
        report_port(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"], port)
        os.environ["JUPYTERHUB_SERVICE_URL"] = with_port(os.environ["JUPYTERHUB_SERVICE_URL"], port)
    sys.modules["rfc3987_syntax"] = None  # makes `import rfc3987_syntax` raise ImportError (see docstring)
    skip_yarn_config()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
