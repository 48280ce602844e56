"""The job-side wrapper: reports exactly {"port": N} with the server's token, then runs the server command."""
from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from scalelab.hub import singleuser


class _Hub(BaseHTTPRequestHandler):
    seen: list = []
    status = 201

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hub.seen.append((self.path, self.headers["Authorization"], json.loads(body)))
        self.send_response(_Hub.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub():
    _Hub.seen, _Hub.status = [], 201
    server = HTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hub/api", _Hub
    server.shutdown()


def test_reports_only_the_port_with_the_servers_token(fake_hub):
    url, hub = fake_hub
    singleuser.report_port(url, "tok", 4321)
    assert hub.seen == [("/hub/api/batchspawner", "token tok", {"port": 4321})]


def test_a_refusal_ends_the_job_with_the_reason(fake_hub):
    url, hub = fake_hub
    hub.status = 400
    with pytest.raises(SystemExit, match="refused port 4321: 400"):
        singleuser.report_port(url, "tok", 4321)


def test_runs_the_server_with_the_reported_port(fake_hub, tmp_path, monkeypatch):
    url, hub = fake_hub
    server = tmp_path / "fake-singleuser"
    server.write_text("import os, sys, json\n"
                      "json.dump({'argv': sys.argv, 'url': os.environ['JUPYTERHUB_SERVICE_URL'],"
                      " 'rfc': 'rfc3987_syntax' in sys.modules and sys.modules['rfc3987_syntax'] is None},"
                      " open(os.environ['OUT'], 'w'))\n")
    out = tmp_path / "out.json"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("JUPYTERHUB_API_URL", url)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "tok")
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", "http://0.0.0.0:0/user/a/")
    monkeypatch.setattr("sys.argv", ["x"])
    before = sys.modules.pop("rfc3987_syntax", "absent")
    try:
        singleuser.main([str(server), "--allow-root"])
    finally:
        sys.modules.pop("rfc3987_syntax", None)
        if before != "absent":
            sys.modules["rfc3987_syntax"] = before
    got = json.loads(out.read_text())
    port = hub.seen[0][2]["port"]
    assert got["argv"] == [str(server), "--allow-root"]
    assert got["url"] == f"http://0.0.0.0:{port}/user/a/"
    assert got["rfc"] is True, "the slow optional import is switched off in the server process"


RACED_SERVER = """
import os, socket, sys, json
from urllib.parse import urlparse
import tornado.ioloop, tornado.web
url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])

class Mine(tornado.web.RequestHandler):
    def get(self):
        self.write("the student's server")
        tornado.ioloop.IOLoop.current().add_callback(tornado.ioloop.IOLoop.current().stop)

app = tornado.web.Application([(r"/.*", Mine)])
from tornado.netutil import bind_sockets
for probe in bind_sockets(url.port, url.hostname):   # jupyter_server probes the port first, and closes the probe
    probe.close()
app.listen(url.port, url.hostname)   # what jupyter_server does: HTTPServer.listen(port, ip)
tornado.ioloop.IOLoop.current().start()
"""


def test_a_classmate_cannot_take_the_reported_port_before_the_server_binds_it(fake_hub, tmp_path):
    # The attack: a classmate on the node watches for the port (ss, /proc/net/tcp) and binds it the moment it is
    # reported. The wrapper holds a listening socket from the pick to the server's start, so every bind fails and
    # the hub's requests reach the student's own server (positive control: a GET through the reported port).
    import socket
    import subprocess
    import time
    import urllib.request

    url, hub = fake_hub
    taken = []

    class Classmate(_Hub):
        def do_POST(self):
            super().do_POST()
            port = _Hub.seen[-1][2]["port"]
            for host in ("127.0.0.1", "0.0.0.0"):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                    s.listen(1)
                    taken.append((host, s))  # kept open: the port stays the classmate's
                except OSError:
                    s.close()

    server = HTTPServer(("127.0.0.1", 0), Classmate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = tmp_path / "raced-singleuser"
    script.write_text(RACED_SERVER)
    env = dict(os.environ, JUPYTERHUB_API_URL=f"http://127.0.0.1:{server.server_port}/hub/api",
               JUPYTERHUB_API_TOKEN="tok", JUPYTERHUB_SERVICE_URL="http://127.0.0.1:0/user/a/")
    proc = subprocess.Popen([sys.executable, "-m", "scalelab.hub.singleuser", str(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _Hub.seen and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _Hub.seen, f"no port was reported: {proc.communicate(timeout=5)[0][-2000:]}"
        port = _Hub.seen[-1][2]["port"]
        assert taken == [], f"a classmate bound the reported port {port} at {[h for h, _ in taken]}"
        body = None
        while body is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/user/a/", timeout=5).read().decode()
            except OSError:
                time.sleep(0.1)
        assert body == "the student's server", proc.communicate(timeout=5)[0][-2000:] if proc.poll() else body
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        server.shutdown()
        for _, s in taken:
            s.close()


def test_no_report_mode_leaves_the_port_to_the_hub(tmp_path, monkeypatch):
    server = tmp_path / "s"
    server.write_text("import os\nopen(os.environ['OUT'], 'w').write(os.environ['JUPYTERHUB_SERVICE_URL'])\n")
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:5555/user/a/")
    monkeypatch.setattr("sys.argv", ["x"])
    singleuser.main(["--no-report", str(server)])
    assert (tmp_path / "o").read_text() == "http://127.0.0.1:5555/user/a/"


def test_the_port_handler_replaces_batchspawners():
    from jupyterhub import apihandlers

    import scalelab.hub.slurm_spawner  # noqa: F401  (imports batchspawner, which adds its own handler)
    from scalelab.hub.api import ROUTE, PortReportHandler

    routes = [h for h in apihandlers.default_handlers if h[0] == ROUTE]
    assert routes == [(ROUTE, PortReportHandler)]


def test_the_server_imports_jupyterlab_without_starting_node(tmp_path):
    # JupyterLab runs `node yarn.js config` when labapp is imported (a quarter of a server start's CPU); through the
    # wrapper it must not, and the registry it gets is yarn's default. Audited in a fresh process, as in a job.
    import subprocess
    server = tmp_path / "fake-singleuser"
    server.write_text(
        "import sys, json\n"
        "started = []\n"
        "sys.addaudithook(lambda ev, args: started.append(str(args[0])) if ev == 'subprocess.Popen' else None)\n"
        "import jupyterlab.labapp\n"
        "from jupyterlab.commands import AppOptions, YARN_DEFAULT_REGISTRY\n"
        "print(json.dumps({'started': started, 'registry': AppOptions().registry, 'default': YARN_DEFAULT_REGISTRY}))\n")
    out = subprocess.run([sys.executable, "-m", "scalelab.hub.singleuser", "--no-report", str(server)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [c for c in got["started"] if "node" in c], got["started"]
    assert got["registry"] == got["default"]
    # without the wrapper the same import does start node: the test sees what it claims to remove
    plain = subprocess.run([sys.executable, str(server)], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert [c for c in json.loads(plain.stdout.strip().splitlines()[-1])["started"] if "node" in c]
