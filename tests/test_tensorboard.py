"""A run's event scalars exported for TensorBoard and read back with TensorBoard's own reader; the TensorBoard
server behind the Jupyter proxy: a real process on a private Unix socket, no TCP port, closed to other accounts.

The hub side (the proxy through a real hub, another student refused, the page in Chromium) is in
test_hub_browser.py, on that module's hub.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scalelab.errors import ScalelabError
from scalelab.experiments.tensorboard import STEP_TAGS, export_scalars
from scalelab.hub.tensorboard_proxy import check_private_dir, server_proxy_config
from scalelab.launch import launch

from helpers import tiny


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = launch(tiny(tmp_path_factory.mktemp("tb"), workers=2, steps=6))
    run.wait(timeout=120)
    return run.run_dir


def read_back(folder) -> EventAccumulator:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_exported_scalars_read_back_equal_the_runs_events(run_dir):
    from scalelab.run.events import EventReader
    reader = EventReader(run_dir)
    reader.poll()
    logdir = export_scalars(run_dir)
    assert logdir == run_dir / "tensorboard"
    for rank in (0, 1):
        acc = read_back(logdir / f"rank-{rank}")
        steps = [e for e in reader.all if e["type"] == "step" and e["rank"] == rank]
        assert len(steps) == 6
        for field, tag in STEP_TAGS.items():  # TensorBoard keeps float32: equal to ~7 digits
            got = [(s.step, s.value) for s in acc.Scalars(tag)]
            assert got == [(e["step"], pytest.approx(e[field], rel=1e-6)) for e in steps], tag
        [memory] = [e for e in reader.all if e["type"] == "memory" and e["rank"] == rank]
        [rss] = acc.Scalars("memory/rss_peak_bytes")
        assert (rss.step, rss.value) == (memory["step"], pytest.approx(memory["rss_peak_bytes"], rel=1e-6))
        [end] = [e for e in reader.all if e["type"] == "end" and e["rank"] == rank]
        assert acc.Scalars("end/final_loss")[0].value == pytest.approx(end["final_loss"], rel=1e-6)


def test_exporting_again_replaces_the_earlier_export(run_dir, tmp_path):
    export_scalars(run_dir, tmp_path / "tb")
    export_scalars(run_dir, tmp_path / "tb")
    assert len(list((tmp_path / "tb" / "rank-0").glob("events.out.tfevents.*"))) == 1
    assert len(read_back(tmp_path / "tb" / "rank-0").Scalars("loss")) == 6


def test_a_folder_without_events_is_refused_with_what_to_pass(tmp_path):
    with pytest.raises(ScalelabError, match=r"no event files .* pass the folder of a run"):
        export_scalars(tmp_path)


def test_the_proxy_entry_point_serves_tensorboard_on_a_unix_socket_only():
    """Looked up as a student's server does (cwd: the home; the checkout's stale *.egg-info, which shadows the
    installed metadata when the checkout is on sys.path, is not in the way there)."""
    code = ("import json; from importlib.metadata import entry_points; "
            "print(json.dumps([e.load()() for e in entry_points(group='jupyter_serverproxy_servers') "
            "if e.name == 'tensorboard']))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60,
                         check=True).stdout
    [cfg] = json.loads(out)
    assert cfg == server_proxy_config()
    assert cfg["unix_socket"] is True and "port" not in cfg and "{unix_socket}" in cfg["command"]


def test_a_socket_directory_others_may_enter_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(SystemExit, match="must be a directory owned by this account with mode 0700"):
        check_private_dir(str(shared / "socket"))
    os.chmod(shared, 0o700)
    check_private_dir(str(shared / "socket"))


def http_get(path: str, url: str = "/") -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(f"GET {url} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        return b"".join(iter(lambda: s.recv(65536), b""))


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another account needs root to switch to it")
def test_the_server_has_no_tcp_port_and_another_account_cannot_connect(run_dir):
    export_scalars(run_dir)
    sock_dir = tempfile.mkdtemp(prefix="tb-test-")  # what jupyter-server-proxy's unix_socket: True makes
    path = os.path.join(sock_dir, "socket")
    proc = subprocess.Popen([sys.executable, "-m", "scalelab.hub.tensorboard_proxy", "--socket", path,
                             "--logdir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.2)
        assert b"<title>TensorBoard</title>" in http_get(path) or b"tb-relative-root" in http_get(path)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert [c for p in tree for c in p.net_connections(kind="inet")] == []  # no TCP/UDP socket at all
        assert os.stat(sock_dir).st_mode & 0o777 == 0o700
        nobody = subprocess.run(
            ["runuser", "-u", "nobody", "--", sys.executable, "-c",
             f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({path!r})"],
            capture_output=True, text=True, timeout=60)
        assert nobody.returncode != 0 and "PermissionError" in nobody.stderr, nobody.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not os.path.exists(path)  # removed at SIGTERM
    os.rmdir(sock_dir)


def test_the_default_logdir_is_the_labs_folder_then_the_home_and_the_course_setting_wins(tmp_path, monkeypatch):
    from scalelab.hub.tensorboard_proxy import LOGDIR_ENV, default_logdir
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(LOGDIR_ENV, raising=False)
    assert default_logdir() == str(tmp_path)  # no labs handed out yet
    (tmp_path / "labs").mkdir()
    assert default_logdir() == str(tmp_path / "labs")  # not the whole home, which may hold big data sets
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path / "elsewhere"))
    assert default_logdir() == str(tmp_path / "elsewhere")
