"""A real hub for tests and benchmarks: started from a settings file on free ports, driven over HTTP, torn down.

    with HubRunner(tmp_path, mode="slurm", settings={...}) as hub:
        alice = hub.login("alice")
        alice.spawn(options={"profile": "cpu-2h"})
        alice.wait_ready()

Teardown leaves nothing behind: the hub is stopped, then every process whose environment points at this hub
(servers, the proxy, the culler) is killed, and every Slurm job of this hub's users is cancelled.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import psutil
import requests
import yaml

from ..errors import ScalelabError
from ..run.procs import free_port, kill_processes


class HubError(ScalelabError):
    """The test hub did not start, or an API call went wrong; the message has the hub log's tail."""


class HubUser:
    """A logged-in user: a browser-like session (cookies) and an API token."""

    def __init__(self, hub: "HubRunner", name: str, session: requests.Session, token: str):
        self.hub, self.name, self.session, self.token = hub, name, session, token

    def api(self, method: str, path: str, **kw) -> requests.Response:
        """Call the hub REST API (path after /hub/api) with this user's token."""
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.request(method, f"{self.hub.url}/hub/api{path}", headers=headers, timeout=30, **kw)

    def get(self, path: str, **kw) -> requests.Response:
        """GET any URL path on the proxy with this user's token (e.g. /user/alice/api/status)."""
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.get(f"{self.hub.url}{path}", headers=headers, timeout=30, allow_redirects=False, **kw)

    def server_path(self, server: str = "") -> str:
        """/users/NAME/server or /users/NAME/servers/SERVER."""
        return f"/users/{self.name}/servers/{server}" if server else f"/users/{self.name}/server"

    def spawn(self, server: str = "", options: dict | None = None) -> requests.Response:
        """POST a spawn request with `options` as the JSON body (the user options)."""
        return self.api("POST", self.server_path(server), json=options or {})

    def model(self) -> dict:
        """The user's model from the hub API."""
        r = self.api("GET", f"/users/{self.name}")
        r.raise_for_status()
        return r.json()

    def server_model(self, server: str = "") -> dict | None:
        """The server's model, or None when the hub lists no such server."""
        return self.model().get("servers", {}).get(server)

    def run_cell(self, code: str, server: str = "", timeout: float = 240, keep_kernel: bool = False) -> str:
        """Execute `code` in a new kernel of the user's server, as a notebook cell would (kernel REST API and its
        websocket, through the proxy); returns the cell's output streams; AssertionError with the traceback when
        the cell raises. The kernel is shut down afterwards, unless `keep_kernel` (a run the cell launched lives as
        long as its kernel)."""
        import uuid

        import websocket  # websocket-client, a dependency of jupyter_server
        base = f"/user/{self.name}/{server + '/' if server else ''}api/kernels"
        auth = {"Authorization": f"token {self.token}"}
        r = requests.post(f"{self.hub.url}{base}", headers=auth, json={}, timeout=60)
        r.raise_for_status()
        kernel = r.json()["id"]
        ws = websocket.create_connection(f"ws://127.0.0.1:{self.hub.port}{base}/{kernel}/channels",
                                         header=[f"Authorization: token {self.token}"], timeout=timeout)
        try:
            msg_id = uuid.uuid4().hex
            ws.send(json.dumps({
                "header": {"msg_id": msg_id, "username": self.name, "session": uuid.uuid4().hex,
                           "msg_type": "execute_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            # The reply comes on the shell channel and the output on iopub: the websocket merges them in no fixed
            # order, so a loaded machine can deliver the reply before the last output. The cell is done when both
            # the reply and iopub's "idle" for it have come (as nbclient waits).
            out, deadline, reply, idle = [], time.monotonic() + timeout, None, False
            while time.monotonic() < deadline and (reply is None or not idle):
                m = json.loads(ws.recv())
                if m.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                if m["msg_type"] == "stream":
                    out.append(m["content"]["text"])
                elif m["msg_type"] == "error":
                    raise AssertionError("the cell failed:\n" + "\n".join(m["content"]["traceback"])[-3000:])
                elif m["msg_type"] == "execute_reply":
                    reply = m["content"]
                elif m["msg_type"] == "status" and m["content"].get("execution_state") == "idle":
                    idle = True
            if reply is not None and idle:
                if reply.get("status") != "ok":
                    raise AssertionError(f"the cell ended {reply.get('status')}: {reply}; its output: "
                                         f"{''.join(out)[-2000:]}")
                return "".join(out)
            raise AssertionError(f"the cell did not finish in {timeout:g} s; its output: {''.join(out)[-2000:]}")
        finally:
            ws.close()
            if not keep_kernel:
                requests.delete(f"{self.hub.url}{base}/{kernel}", headers=auth, timeout=30)

    def wait_ready(self, server: str = "", timeout: float = 120) -> float:
        """Seconds until the server is ready, waited for as the browser's spawn page waits: on the hub's progress
        event stream (one long request), not by asking for the user model ten times a second, which, done by 30
        students at once, is 300 API requests a second that keep the hub's one core busy (bench_spawn measured the
        hub at 58 CPU-s in a 30-spawn rush that way, 3.6 with the stream). HubError if the spawn fails, the stream
        ends without a ready event (no spawn pending: the hub answers 400), or `timeout` passes."""
        t0, last = time.monotonic(), None
        for last in self.progress(server, timeout=timeout):
            if last.get("ready"):
                return time.monotonic() - t0
            if last.get("failed"):
                raise HubError(f"{self.name}'s spawn failed: {last.get('message')}\n{self.hub.log_tail()}")
            if time.monotonic() - t0 > timeout:
                break
        raise HubError(f"{self.name}'s server {server!r} not ready after {time.monotonic() - t0:.0f} s (last "
                       f"progress event: {last}; server model: {self.server_model(server)})\n{self.hub.log_tail()}")

    def wait_gone(self, server: str = "", timeout: float = 60) -> float:
        """Seconds until the hub lists the server no more."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.server_model(server) is None:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise HubError(f"{self.name}'s server {server!r} still listed after {timeout} s\n{self.hub.log_tail()}")

    def stop(self, server: str = "") -> requests.Response:
        """Ask the hub to stop the server."""
        return self.api("DELETE", self.server_path(server))

    def progress(self, server: str = "", timeout: float = 120) -> Iterator[dict]:
        """The server's progress events (server-sent events), until the stream ends."""
        path = f"/users/{self.name}/server/progress" if not server else \
            f"/users/{self.name}/servers/{server}/progress"
        with requests.get(f"{self.hub.url}/hub/api{path}", headers={"Authorization": f"token {self.token}"},
                          stream=True, timeout=timeout) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    yield json.loads(line[5:])

    def last_progress(self, server: str = "") -> str:
        try:
            events = list(self.progress(server, timeout=5))
            return events[-1].get("message", "") if events else ""
        except (requests.RequestException, ValueError):
            return ""


class HubRunner:
    """`scalelab hub --config <workdir>/course.yaml` on free ports, with a state dir and labs in `workdir`."""

    def __init__(self, workdir: str | os.PathLike, mode: str = "local", settings: dict | None = None,
                 env: dict | None = None, accounts: list[str] | None = None, admins: list[str] | None = None):
        """`admins`: short names of instructors (hub.admin_users; they sign in with the admin password).
        `accounts`: short names of students who get course accounts (servers run as their own Unix accounts;
        the hub must run as root). Without it servers run as the hub's account, and on a root test machine that
        is allowed explicitly (servers.allow_root_servers), as are one account for all (servers.shared_account) and
        signing in under any name (auth.any_name): the
        tests of other hub features need neither accounts nor a class list."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.mode = mode
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.password = "pw-" + secrets.token_hex(8)
        self.prefix = "u" + secrets.token_hex(3)  # user names of this hub: unique, so teardown finds their jobs
        base = {
            "mode": mode,
            "hub": {"port": self.port, "hub_port": self.hub_port, "proxy_api_port": self.api_port,
                    "state_dir": str(self.workdir / "state"), "config_d": ""},
            "auth": {"password": self.password},
            "kernels": {"install": False},
            "culler": {"enabled": False},
            "dashboard": {"port": free_port()},
            "labs": {"source": str(self.workdir / "labs")},
        }
        self.admins = [self.user(a) for a in admins or []]  # instructors: hub.admin_users, the admin password
        self.admin_password = "admin-" + secrets.token_hex(20) if self.admins else None
        if self.admins:
            base["hub"]["admin_users"] = list(self.admins)
            base["auth"]["admin_password"] = self.admin_password
        self.accounts = [self.user(a) for a in accounts or []]
        if self.accounts:
            base["servers"] = {"run_as": "student-accounts", "create_accounts": True}
            base["auth"]["allowed_users"] = list(self.accounts)
        else:
            base["servers"] = {"run_as": "hub-account", "allow_root_servers": os.geteuid() == 0, "shared_account": True}
            base["auth"]["any_name"] = True  # tests sign in whatever names they need
        from ..hub.settings import deep_merge
        self.settings = deep_merge(base, settings or {})
        self.config_path = self.workdir / "course.yaml"
        self.config_path.write_text(yaml.safe_dump(self.settings, sort_keys=False), encoding="utf-8")
        self.config_path.chmod(0o600)  # it holds the password (a readable one is refused)
        self.log_path = self.workdir / "hub.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """The public URL (the proxy)."""
        return f"http://127.0.0.1:{self.port}"

    def user(self, short: str) -> str:
        """This hub's full user name for `short` (prefixed, unique)."""
        return f"{self.prefix}-{short}"

    def start(self, timeout: float = 90, ignore_sigint: bool = False) -> "HubRunner":
        """Start the hub and wait until its API answers through the proxy.

        `ignore_sigint` starts it the way a shell starts a background job (`make hub &`): SIGINT ignored."""
        self._log = open(self.log_path, "ab")
        env = {**os.environ, **(self.env or {})}
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        self.proc = subprocess.Popen([sys.executable, "-m", "scalelab.cli", "hub", "--config", str(self.config_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=preexec)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise HubError(f"the hub exited with {self.proc.returncode} while starting\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/hub/api/", timeout=2).status_code == 200:
                    if not self.settings["auth"].get("password"):  # generated at the first start
                        self.password = (self.workdir / "state" / "password").read_text().strip()
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise HubError(f"the hub did not answer in {timeout} s\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        """The last lines of the hub's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no hub log)"

    def password_of(self, name: str) -> str:
        """The password `name` (full name) signs in with: a listed student's own (generated by the hub into its
        state dir), else the shared one (auth.any_name)."""
        from ..hub.auth import student_passwords_file
        if name in self.admins:
            return self.admin_password
        try:
            lines = student_passwords_file(self.settings).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return self.password
        own = dict(line.split(",", 1) for line in lines if "," in line)
        return own.get(name, self.password)

    def login(self, short: str) -> HubUser:
        """Log `short` in through the login form (their own password, else the shared one) and create an API token
        for them."""
        name = self.user(short)
        s = requests.Session()
        s.get(f"{self.url}/hub/login", timeout=30)
        r = s.post(f"{self.url}/hub/login", data={"username": name, "password": self.password_of(name),
                                                  "_xsrf": s.cookies.get("_xsrf", "")},
                   allow_redirects=False, timeout=30)
        if r.status_code != 302:
            raise HubError(f"login of {name} answered {r.status_code}\n{self.log_tail()}")
        xsrf = s.cookies.get("_xsrf", path="/hub/")
        r = s.post(f"{self.url}/hub/api/users/{name}/tokens", json={"note": "tests", "expires_in": 7200},
                   headers={"X-XSRFToken": xsrf}, timeout=30)
        if r.status_code != 201:
            raise HubError(f"token for {name}: {r.status_code} {r.text}\n{self.log_tail()}")
        return HubUser(self, name, s, r.json()["token"])

    def stop(self, timeout: float = 30) -> None:
        """Stop the hub process (SIGTERM, then SIGKILL); servers it leaves running are left running."""
        if self.proc is None:
            return
        children = []
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_processes([c for c in children if not self._is_server(c)], grace_s=5, tree=False)
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None

    def _is_server(self, proc: psutil.Process) -> bool:
        try:
            return "jupyterhub-singleuser" in " ".join(proc.cmdline())
        except psutil.Error:
            return False

    def _ours(self) -> list[psutil.Process]:
        """Every process whose environment talks to this hub (servers, culler) or that serves its ports."""
        mark = f":{self.hub_port}/hub/api"
        found = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():
                continue
            try:
                env = p.environ()
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if mark in env.get("JUPYTERHUB_API_URL", "") or f"--port {self.port} " in cmd + " ":
                found.append(p)
        return found

    def spawned(self, short: str, profile: str, timeout: float = 90) -> tuple["HubUser", dict]:
        """`short` logged in and their server started with spawn-form profile `profile` and ready (slurm mode):
        (the user, their server's job as `jobs` gives it)."""
        user = self.login(short)
        r = user.spawn(options={"profile": profile})
        assert r.status_code in (201, 202), r.text
        user.wait_ready(timeout=timeout)
        [job] = [j for j in self.jobs() if j["name"] == f"jupyter-{user.name}"]
        return user, job

    def jobs(self) -> list[dict]:
        """This hub's users' Slurm jobs still in squeue: [{'id','name','state','partition','reservation',...}]."""
        if self.mode != "slurm":
            return []
        out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%P|%v|%D|%C|%b|%l|%m|%u"], capture_output=True,
                             text=True, env=self.slurm_env(), timeout=30).stdout
        keys = ("id", "name", "state", "partition", "reservation", "nodes", "cpus", "gres", "timelimit", "memory",
                "user")
        rows = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]
        return [r for r in rows if r["name"].startswith(f"jupyter-{self.prefix}-")]

    def slurm_env(self) -> dict:
        """Environment for Slurm client commands against the hub's cluster."""
        conf = self.settings.get("slurm", {}).get("conf") or os.environ.get("SLURM_CONF", "")
        return {**os.environ, **({"SLURM_CONF": conf} if conf else {})}

    def cleanup(self) -> None:
        """Stop the hub, kill whatever of it is left, cancel this hub's jobs, remove the course accounts it made."""
        self.stop()
        kill_processes(self._ours(), grace_s=5, tree=False)
        for job in self.jobs():
            subprocess.run(["scancel", job["id"]], env=self.slurm_env(), capture_output=True, timeout=30)
        for name in self.accounts:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, timeout=30)
            subprocess.run(["userdel", "--remove", name], capture_output=True, timeout=60)

    def __enter__(self) -> "HubRunner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


@contextlib.contextmanager
def class_reservation_and_queue(cluster) -> Iterator[tuple[str, str]]:
    """(reservation, partition) on a LocalCluster: a one-core class reservation for root (other jobs keep the
    other cores) and a DOWN partition where jobs wait in the queue on purpose; both removed afterwards."""
    tag = secrets.token_hex(3)
    resv, down = f"hubtest-{tag}", f"hubdown-{tag}"
    node = cluster.status()["nodes"][0]["name"]
    cluster.run("scontrol", "create", "reservation", f"ReservationName={resv}", "Users=root", "StartTime=now",
                "Duration=120", f"Nodes={node}", "CoreCnt=1", "Flags=IGNORE_JOBS")
    try:
        cluster.run("scontrol", "create", f"PartitionName={down}", f"Nodes={node}", "State=DOWN")
        yield resv, down
    finally:
        cluster.run("scontrol", "delete", f"PartitionName={down}", check=False)
        # in use it cannot be deleted: wait for its last job to leave, then end what is left (left in place, it
        # would hold its core from every later job for two hours)
        cluster.drop_reservation(resv, wait_s=30, cancel_jobs=True)


def slurm_settings(cluster, reservation: str = "", profiles: list | None = None, **slurm) -> dict:
    """Hub settings for slurm mode on a LocalCluster: its SLURM_CONF, loopback addresses, gentle timeouts."""
    out = {"conf": cluster.env()["SLURM_CONF"], "server_ip": "127.0.0.1", "node_address": "127.0.0.1",
           "reservation": reservation, **slurm}
    if profiles is not None:
        out["profiles"] = profiles
        out.setdefault("default_profile", profiles[0]["name"])
    return {"servers": {"poll_interval": 3, "start_timeout": 120}, "slurm": out}
