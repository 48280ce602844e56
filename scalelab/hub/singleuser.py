"""Start a student's server inside a batch job: hold a port, report it to the hub, run jupyterhub-singleuser on it.

    python -m scalelab.hub.singleuser /venv/bin/jupyterhub-singleuser [ARGS...]
    python -m scalelab.hub.singleuser --no-report /venv/bin/jupyterhub-singleuser [ARGS...]   # local mode

What batchspawner-singleuser does, made lean, because every second here is a second the student waits:

- it imports only the standard library before the port is reported (batchspawner's wrapper imports
  `jupyterhub.services.auth` and `requests` first: ~1.8 s on a 2-core node);
- it reports exactly ``{"port": N}`` — all that scalelab's hub handler accepts;
- the port is *held* from the pick to the server's start: a listening socket the wrapper binds before reporting
  and hands to the server (batchspawner picks a port, closes it and reports it: in between, a classmate on the
  node could bind it and receive the hub's requests with the student's cookies and tokens);
- it stops jsonschema from importing `rfc3987_syntax`, which builds a Lark grammar at import time (~2 s here) and
  is only used for the optional "iri"/"iri-reference" formats, which no Jupyter event schema uses;
- it loads scalelab's own server and JupyterLab extensions (`scalelab.hub.walltime`: the job's time left, the
  runs' emergency checkpoints at its end) by putting `jupyter_config/` and `jupyter_data/` first on
  JUPYTER_CONFIG_PATH and JUPYTER_PATH, and notes a SIGUSR1 (Slurm's walltime warning) that comes before the server
  has its own handlers, which would otherwise end the server (SIGUSR1's default action);
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
import signal
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse, urlunparse

HERE = os.path.dirname(os.path.abspath(__file__))
EARLY_SIGNAL_ENV = "SCALELAB_EARLY_SIGNAL"
"""Set to SIGUSR1 when Slurm's warning signal came before the server took over its signals (read by walltime)."""


def hold_port(host: str = "") -> socket.socket:
    """A listening socket on a port of `host` that the system picked, held from now until the server takes it over
    (see `hand_over`): there is no moment in which a classmate on the node could bind the port first and receive
    the hub's traffic (a port picked, closed and then reported left one)."""
    host = "" if host in ("", "0.0.0.0", "*") else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what tornado's own bind sets (no SO_REUSEPORT)
    sock.bind((host, 0))
    sock.setblocking(False)
    sock.listen(128)
    return sock


def hand_over(sock: socket.socket) -> None:
    """Make the server's bind of the held port return the held socket: jupyter_server binds through tornado's
    `TCPServer.listen` -> `tornado.netutil.bind_sockets`, which is swapped here for one that answers this port with
    a duplicate of `sock` (jupyter_server probes the port first and closes what the probe got; the held socket
    stays open here) and binds any other port as before. Called after the port is reported, before the server
    imports."""
    import tornado.netutil
    import tornado.tcpserver

    port, original = sock.getsockname()[1], tornado.netutil.bind_sockets

    def bind_sockets(want, address=None, *args, **kwargs):
        if want == port:  # a duplicate each time: jupyter_server probes the port first and closes what it got
            return [sock.dup()]
        return original(want, address, *args, **kwargs)

    tornado.netutil.bind_sockets = tornado.tcpserver.bind_sockets = bind_sockets


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


def note_early_signal() -> None:
    """Until the server's own handlers are in place (`scalelab.hub.walltime`), a SIGUSR1 is noted, not fatal."""
    signal.signal(signal.SIGUSR1, lambda *_: os.environ.setdefault(EARLY_SIGNAL_ENV, "SIGUSR1"))


def course_extensions() -> None:
    """Put scalelab's Jupyter config (enables the server extension scalelab.hub.walltime) and data (the JupyterLab
    extension scalelab-walltime) first on Jupyter's search paths, in this process and so in the server."""
    for var, sub in (("JUPYTER_CONFIG_PATH", "jupyter_config"), ("JUPYTER_PATH", "jupyter_data")):
        os.environ[var] = os.pathsep.join(x for x in (os.path.join(HERE, sub), os.environ.get(var, "")) if x)


def main(argv: list[str] | None = None) -> None:
    """Report a port (unless --no-report), then run the server command in this process."""
    note_early_signal()
    argv = sys.argv[1:] if argv is None else list(argv)
    report = not (argv and argv[0] == "--no-report")  # local mode: the hub chose the port already
    argv = argv if report else argv[1:]
    if not argv:
        raise SystemExit("usage: python -m scalelab.hub.singleuser [--no-report] /path/to/jupyterhub-singleuser "
                         "[ARGS...]")
    if report:
        held = hold_port(urlparse(os.environ["JUPYTERHUB_SERVICE_URL"]).hostname or "")
        port = held.getsockname()[1]
        report_port(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"], port)
        os.environ["JUPYTERHUB_SERVICE_URL"] = with_port(os.environ["JUPYTERHUB_SERVICE_URL"], port)
        hand_over(held)
    course_extensions()
    sys.modules["rfc3987_syntax"] = None  # makes `import rfc3987_syntax` raise ImportError (see docstring)
    skip_yarn_config()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
