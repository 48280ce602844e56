"""TensorBoard inside a student's JupyterLab, reachable only through the student's own Jupyter server.

jupyter-server-proxy finds `server_proxy_config` through the `jupyter_serverproxy_servers` entry point (declared
in pyproject.toml): JupyterLab's launcher gets a TensorBoard tile, and the first request to
``/user/<name>/tensorboard/`` starts

    python -m scalelab.hub.tensorboard_proxy --socket <private dir>/socket --logdir <home>

which serves TensorBoard's WSGI app on that Unix socket (TensorBoard itself only binds TCP ports).

Threat model. TensorBoard has no authentication: whoever can connect to it reads every run under its logdir.
On a shared node (a Slurm GPU node holds several students' servers) a TCP port, even on 127.0.0.1, is open to
every account on that node. So:

- TensorBoard listens on no TCP port: only a Unix socket, in a fresh directory jupyter-server-proxy made with
  `mkdtemp` (mode 0700, owned by the server's account); `serve` refuses a socket whose directory is not private
  to it. Another account on the node cannot enter the directory, so cannot connect.
- TensorBoard's Rust data server is off (``load_fast=false``): it would listen on a localhost gRPC port.
- Every browser request reaches the socket through the student's Jupyter server, which accepts only its owner
  (the hub's OAuth; another student gets 403, nobody signed in is sent to the login page).

What it does not protect: with ``servers.run_as: hub-account`` every student's server runs as one Unix account,
so students' code can reach each other's sockets and files alike (that mode keeps students apart by the hub
only: see `scalelab.hub.course_spawner`). Root on the node reads everything. The student's own code can of
course read and change what their TensorBoard shows.

The logdir is ~/labs, where the handed-out labs write their runs (~/labs/<lab>/runs), or the home when there is
no ~/labs, or ``SCALELAB_TENSORBOARD_LOGDIR`` when the course sets it (`servers.environment` in the course
settings).
"""
from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading

LOGDIR_ENV = "SCALELAB_TENSORBOARD_LOGDIR"
#: seconds between TensorBoard's rescans of the logdir (a home can hold many files: not too often)
RELOAD_S = 15


def server_proxy_config() -> dict:
    """jupyter-server-proxy's settings for TensorBoard: a Unix socket in a private temporary directory, a launcher
    tile, a generous start timeout (TensorBoard imports in several seconds on a busy node)."""
    return {
        "command": [sys.executable, "-m", "scalelab.hub.tensorboard_proxy", "--socket", "{unix_socket}",
                    "--logdir", default_logdir()],
        "unix_socket": True,
        "timeout": 60,
        "absolute_url": False,
        "new_browser_tab": True,
        "launcher_entry": {"title": "TensorBoard", "category": "Other"},
    }


def default_logdir() -> str:
    """SCALELAB_TENSORBOARD_LOGDIR if set, else ~/labs (where the handed-out labs write their runs) when it exists,
    else the home: TensorBoard rescans its whole logdir every RELOAD_S seconds, and a home may hold big data sets."""
    if os.environ.get(LOGDIR_ENV):
        return os.environ[LOGDIR_ENV]
    labs = os.path.expanduser("~/labs")
    return labs if os.path.isdir(labs) else os.path.expanduser("~")


def check_private_dir(socket_path: str) -> None:
    """SystemExit unless the socket's directory exists, is a real directory owned by this account and open to no
    one else (mode 0700 or stricter): a socket in a shared directory could be reached by other accounts."""
    folder = os.path.dirname(os.path.abspath(socket_path))
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise SystemExit(f"tensorboard_proxy: socket directory {folder}: {e.strerror}")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SystemExit(f"tensorboard_proxy: refusing to serve in {folder} (mode {stat.S_IMODE(st.st_mode):o}, "
                         f"owner uid {st.st_uid}): the socket's directory must be a directory owned by this account "
                         "with mode 0700, e.g. one made by tempfile.mkdtemp (jupyter-server-proxy's unix_socket: True)")


def unix_server_class(socket_path: str):
    """A TensorBoard server class (`tensorboard.program.TensorBoard(server_class=...)`) that serves the WSGI app
    on `socket_path` with Werkzeug's threaded server, and on no TCP port."""
    from tensorboard.program import TensorBoardServer
    from werkzeug.serving import ThreadedWSGIServer

    class UnixSocketServer(ThreadedWSGIServer, TensorBoardServer):
        """TensorBoard's WSGI app on a Unix socket."""

        daemon_threads = True

        def __init__(self, wsgi_app, flags):
            ThreadedWSGIServer.__init__(self, "unix://" + socket_path, 0, wsgi_app)

        def get_url(self):
            """No TCP URL: the socket's path, as a unix:// address."""
            return "unix://" + socket_path

        def print_serving_message(self):
            """One line to stderr (Werkzeug's development-server banner is not for this use)."""
            print(f"TensorBoard on {socket_path}", file=sys.stderr, flush=True)

    return UnixSocketServer


def serve(socket_path: str, logdir: str) -> None:
    """Serve TensorBoard for `logdir` on the Unix socket `socket_path` until SIGTERM/SIGINT."""
    check_private_dir(socket_path)
    os.umask(0o077)  # the socket file itself: this account only (the directory already keeps others out)
    from tensorboard import program

    tb = program.TensorBoard(server_class=unix_server_class(socket_path))
    tb.configure(logdir=os.path.abspath(logdir), load_fast="false", reload_interval=RELOAD_S)
    tb.launch()  # the server runs in a daemon thread; this thread waits for the signal that ends it
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if os.path.exists(socket_path):
        os.unlink(socket_path)


def main(argv: list[str] | None = None) -> None:
    """`python -m scalelab.hub.tensorboard_proxy --socket PATH [--logdir DIR]`."""
    parser = argparse.ArgumentParser(prog="python -m scalelab.hub.tensorboard_proxy", description=main.__doc__)
    parser.add_argument("--socket", required=True, help="Unix socket to serve on (its directory must be 0700)")
    parser.add_argument("--logdir", default=None,
                        help=f"runs to show (default: ${LOGDIR_ENV}, else ~/labs, else the home)")
    args = parser.parse_args(argv)
    logdir = args.logdir or default_logdir()
    if not os.path.isdir(logdir):
        raise SystemExit(f"tensorboard_proxy: logdir {logdir} is not a directory; pass an existing one with "
                         f"--logdir or set {LOGDIR_ENV}")
    serve(args.socket, logdir)


if __name__ == "__main__":
    main()
