"""Course settings applied to a JupyterHub traitlets config, one small `update_*(c, cfg)` function per concern.

`hub_config/jupyterhub_config.py` calls `apply_settings(c, cfg)` and then `load_config_d(c, cfg)`. Each
`update_*` function only sets traits (no files written, nothing started), so each is tested against a bare
`traitlets.config.Config()`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

from ..paths import find_tool
from .addresses import access_log
from .options import profiles_from_settings
from .posture import RESERVED_NAMES, problems, system_account
from .settings import SettingsError, read_roster
from .provision import resolve_source

LOCAL_SPAWNER = "scalelab.hub.local_spawner.CourseLocalSpawner"
SLURM_SPAWNER = "scalelab.hub.slurm_spawner.CourseSlurmSpawner"
AUTHENTICATOR = "scalelab.hub.authenticator.CourseSharedPasswordAuthenticator"
#: Login names allowed: they become directory names, Slurm job names and (with PAM) Unix accounts.
USERNAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]
DASHBOARD_SCOPES = ["list:users", "read:users", "read:servers"]  # scalelab.hub.dashboard: reads, and warms (below)
BOARD_SCOPE = "access:services!service=dashboard"  # what a student needs to see the public capstone board



def python_bin(cfg: Mapping) -> str:
    """Directory of the course environment's executables (jupyterhub-singleuser, python)."""
    return cfg["servers"].get("python_bin") or os.path.dirname(sys.executable)


def find_proxy(cfg: Mapping) -> str | None:
    """configurable-http-proxy: beside the course Python first (where `make hub` links it), then on PATH."""
    candidate = Path(python_bin(cfg)) / "configurable-http-proxy"
    if candidate.exists():
        return str(candidate)
    return find_tool("configurable-http-proxy")


def update_hub(c, cfg: Mapping) -> None:
    """Addresses, database, secrets and pid files under the state dir, proxy, named servers, restart behaviour."""
    hub, state = cfg["hub"], Path(cfg["hub"]["state_dir"])
    c.JupyterHub.ip = hub["ip"]
    c.JupyterHub.port = hub["port"]
    c.JupyterHub.hub_ip = hub["hub_ip"]
    c.JupyterHub.hub_port = hub["hub_port"]
    if hub.get("connect_ip"):
        c.JupyterHub.hub_connect_ip = hub["connect_ip"]
    c.JupyterHub.base_url = hub["base_url"]
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{hub['proxy_api_port']}"
    proxy = find_proxy(cfg)
    if proxy:
        c.ConfigurableHTTPProxy.command = [proxy]
    c.JupyterHub.cleanup_servers = not hub["keep_servers_on_restart"]
    # the request log names the connection's address (or a trusted proxy's word for it), never a client's header
    c.JupyterHub.tornado_settings.update({"log_function": access_log(hub["trusted_proxies"])})
    if hub.get("subdomain_host"):  # each server its own origin; cookies bound to the host (__Host- prefix)
        c.JupyterHub.subdomain_host = hub["subdomain_host"]
        c.JupyterHub.cookie_host_prefix_enabled = hub["subdomain_host"].startswith("https://")
    # One origin for the hub and every server (no subdomain_host): a page a student serves must not act as whoever
    # opens it. jupyter_server serves a server's files, views and exports under a CSP sandbox (a unique origin: its
    # scripts cannot read the hub or any server with the viewer's cookies); a student's own ~/.jupyter config (or
    # data folder's extensions) could switch that off in their server, so it never loads there.
    c.Spawner.disable_user_config = True
    c.JupyterHub.allow_named_servers = hub["named_servers"] > 0
    c.JupyterHub.named_server_limit_per_user = hub["named_servers"]
    c.JupyterHub.template_vars = {"announcement": cfg["course"]["name"]}
    # local servers being stopped: SIGINT, then SIGTERM, then SIGKILL 3 s apart (JupyterHub: 10 + 5 + 5 s)
    c.LocalProcessSpawner.interrupt_timeout = 3
    c.LocalProcessSpawner.term_timeout = 3
    c.LocalProcessSpawner.kill_timeout = 3


def update_auth(c, cfg: Mapping, passwords: Mapping) -> None:
    """Shared-password login (the local default) or PAM; admins; who may log in; safe user names."""
    auth = cfg["auth"]
    c.Authenticator.admin_users = set(cfg["hub"]["admin_users"])
    c.Authenticator.username_pattern = USERNAME_PATTERN
    # never a system account's name, whatever the list says (a course account is created from the login name)
    c.Authenticator.blocked_users = system_account_names()
    if auth["allowed_users"]:
        c.Authenticator.allowed_users = set(auth["allowed_users"])
        # the list is the whole gate: users in the hub's database but not on it (added by an admin, dropped from the
        # list, left from a try-out) do not sign in (JupyterHub's default adds them all to allowed_users)
        c.Authenticator.allow_existing_users = False
        c.CourseSharedPasswordAuthenticator.class_list = {*auth["allowed_users"], *cfg["hub"]["admin_users"]}
    else:
        c.Authenticator.allow_all = True
    if auth["type"] == "pam":
        c.JupyterHub.authenticator_class = "pam"
        return
    c.JupyterHub.authenticator_class = AUTHENTICATOR
    throttle = auth["throttle"]
    c.CourseSharedPasswordAuthenticator.max_failures = throttle["failures_per_name"]
    c.CourseSharedPasswordAuthenticator.max_address_failures = throttle["failures_per_address"]
    c.CourseSharedPasswordAuthenticator.window_s = float(throttle["window_s"])
    c.CourseSharedPasswordAuthenticator.lockout_s = float(throttle["lockout_s"])
    c.CourseSharedPasswordAuthenticator.trusted_proxies = list(cfg["hub"]["trusted_proxies"])
    own = {name: pw for name, pw in read_roster(auth["roster"]).items() if pw} if auth["roster"] else {}
    own.update(passwords.get("students") or {})  # every listed student's own (roster or generated)
    if own:
        c.CourseSharedPasswordAuthenticator.roster_passwords = own
    c.SharedPasswordAuthenticator.user_password = passwords["user"]
    if passwords.get("admin"):
        c.SharedPasswordAuthenticator.admin_password = passwords["admin"]


def update_servers(c, cfg: Mapping) -> None:
    """The single-user server: absolute command, timeouts, polling, an explicit environment, homes."""
    servers = cfg["servers"]
    bindir = python_bin(cfg)
    c.Spawner.cmd = [os.path.join(bindir, "jupyterhub-singleuser")]
    c.Spawner.default_url = servers["default_url"]
    c.Spawner.start_timeout = servers["start_timeout"]
    c.Spawner.http_timeout = servers["http_timeout"]
    c.Spawner.poll_interval = servers["poll_interval"]
    # JupyterHub >= 5.2 keeps almost nothing of its own environment: say exactly what a server gets.
    c.Spawner.env_keep = []
    path = [bindir, "/usr/local/bin", "/usr/bin", "/bin"]
    if cfg["mode"] == "slurm":
        path.insert(1, cfg["slurm"]["bin_dir"])
    c.Spawner.environment = {"PATH": ":".join(dict.fromkeys(path)), "LANG": "C.UTF-8",
                             **servers["environment"]}
    sect = c.CourseSpawner  # shared by both course spawner classes
    sect.run_as = servers["run_as"]
    sect.create_accounts = servers["create_accounts"]
    sect.spawn_from_link = servers["spawn_from_link"]
    sect.home_template = servers["home"].replace("{state_dir}", cfg["hub"]["state_dir"])
    sect.python_bin = bindir
    sect.inject_file = cfg["capstone"]["inject_file"]  # every server's runs poll it (scalelab.run.inject)


def update_local_spawner(c, cfg: Mapping) -> None:
    """local mode: each server a process on this machine, reachable on the loopback only."""
    c.JupyterHub.spawner_class = LOCAL_SPAWNER
    c.CourseLocalSpawner.ip = "127.0.0.1"
    # through scalelab.hub.singleuser for its faster start (no port to report: the hub chose it)
    bindir = python_bin(cfg)
    c.CourseLocalSpawner.cmd = [os.path.join(bindir, "python"), "-m", "scalelab.hub.singleuser", "--no-report",
                                os.path.join(bindir, "jupyterhub-singleuser")]


def exec_prefix(cfg: Mapping) -> str:
    """Prefix of Slurm commands: the setting, else sudo to the student with student-accounts, else none."""
    if cfg["slurm"]["exec_prefix"]:
        return cfg["slurm"]["exec_prefix"]
    return "sudo -E -u {username}" if cfg["servers"]["run_as"] == "student-accounts" else ""


def update_slurm_spawner(c, cfg: Mapping) -> None:
    """slurm mode: batch jobs shaped by the course profiles, polled gently, with absolute paths."""
    slurm = cfg["slurm"]
    c.JupyterHub.spawner_class = SLURM_SPAWNER
    s = c.CourseSlurmSpawner
    s.profiles = [asdict(p) for p in profiles_from_settings(slurm)]
    s.default_profile = slurm["default_profile"]
    s.student_max_cpus = int(slurm["per_student"]["cpus"])
    s.student_max_gpus = int(slurm["per_student"]["gpus"])
    s.slurm_bin_dir = slurm["bin_dir"]
    s.slurm_conf = slurm["conf"]
    s.exec_prefix = exec_prefix(cfg)
    s.course_prologue = slurm["prologue"]
    s.log_dir_template = slurm["log_dir"]
    s.bind_ip = slurm["server_ip"]
    s.node_address = slurm["node_address"]
    s.poll_min = float(slurm["poll_min"])
    s.poll_max = float(slurm["poll_max"])
    s.queue_cache_s = float(slurm["queue_cache_s"])
    wall = slurm["walltime"]  # scalelab.hub.walltime: the countdown's warning, the runs' emergency checkpoints
    s.walltime_warn_s, s.walltime_signal_s = int(wall["warn_s"]), int(wall["signal_s"])
    s.walltime_refresh_s, s.walltime_grace_s = float(wall["refresh_s"]), float(wall["stop_grace_s"])
    s.singleuser_wrapper = [os.path.join(python_bin(cfg), "python"), "-m", "scalelab.hub.singleuser"]


def update_labs(c, cfg: Mapping) -> None:
    """Which labs are handed out, where in the home, and by whom (hub, or the job in slurm mode)."""
    labs, sect = cfg["labs"], c.CourseSpawner
    source = resolve_source(labs["source"])
    sect.labs_source = str(source) if source else ""
    sect.labs_dest = labs["dest"]
    sect.labs_exclude = list(labs["exclude"])
    if cfg["mode"] == "slurm":
        c.CourseSlurmSpawner.labs_where = labs["where"]


def update_culler(c, cfg: Mapping) -> None:
    """jupyterhub-idle-culler (via scalelab.hub.culler) as a hub-managed service with only the scopes it needs."""
    culler = cfg["culler"]
    if not culler["enabled"]:
        return
    cmd = [sys.executable, "-m", "scalelab.hub.culler", f"--timeout={culler['timeout']}",
           f"--cull-every={culler['every']}"]
    if culler["max_age"]:
        cmd.append(f"--max-age={culler['max_age']}")
    services = [s for s in (c.JupyterHub.get("services") or []) if s.get("name") != "idle-culler"]
    c.JupyterHub.services = services + [{"name": "idle-culler", "command": cmd}]
    roles = [r for r in (c.JupyterHub.get("load_roles") or []) if r.get("name") != "idle-culler"]
    c.JupyterHub.load_roles = roles + [{"name": "idle-culler", "scopes": CULLER_SCOPES, "services": ["idle-culler"]}]


def apply_settings(c, cfg: Mapping, passwords: Mapping | None = None) -> None:
    """Refuse an unsafe posture, make the state dir private, then every update_* in order; passwords default to
    ensure_passwords(cfg)."""
    refuse_unsafe(cfg)
    private_state_dir(cfg["hub"]["state_dir"])
    if passwords is None:
        from .auth import ensure_passwords
        passwords = ensure_passwords(cfg)
    update_hub(c, cfg)
    update_auth(c, cfg, passwords)
    update_servers(c, cfg)
    if cfg["mode"] == "slurm":
        update_slurm_spawner(c, cfg)
    else:
        update_local_spawner(c, cfg)
    update_labs(c, cfg)
    update_culler(c, cfg)
    update_dashboard(c, cfg)


def update_dashboard(c, cfg: Mapping) -> None:
    """The class dashboard (scalelab.hub.dashboard) as a hub-managed service: its token may read users and servers
    and start the course's students' servers (`warm_scopes`: warming the class); hub admins, dashboard.instructors
    and dashboard.tas may open it (access:services!service=dashboard), and with capstone.public the students too
    (`board_role`: the service shows them the pseudonymised leaderboard only); nobody else (what a TA sees and may do
    there: scalelab.hub.dashboard)."""
    from .settings import ENV_OVERRIDES, ENV_SETTINGS
    dash = cfg["dashboard"]
    services = [s for s in (c.JupyterHub.get("services") or []) if s.get("name") != "dashboard"]
    roles = [r for r in (c.JupyterHub.get("load_roles") or [])
             if r.get("name") not in ("dashboard", "course-instructors", "course-tas", "capstone-board")]
    extra = set(c.JupyterHub.get("extra_user_scopes") or ()) - {BOARD_SCOPE}
    if dash["enabled"]:
        env = {k: os.environ[k] for k in (ENV_SETTINGS, ENV_OVERRIDES, "PATH", "LANG") if k in os.environ}
        services.append({"name": "dashboard", "url": f"http://{cfg['hub']['hub_ip']}:{dash['port']}",
                         "command": [sys.executable, "-m", "scalelab.hub.dashboard"], "environment": env,
                         "display": True, "oauth_no_confirm": True})
        roles.append({"name": "dashboard", "scopes": DASHBOARD_SCOPES + warm_scopes(cfg), "services": ["dashboard"]})
        if dash["instructors"]:
            roles.append({"name": "course-instructors", "scopes": ["access:services!service=dashboard"],
                          "users": list(dash["instructors"])})
        if dash["tas"]:  # the same door; the service itself keeps them to the students and to reading
            roles.append({"name": "course-tas", "scopes": ["access:services!service=dashboard"],
                          "users": list(dash["tas"])})
        board = board_role(cfg)
        if board:
            roles.append(board)
        elif cfg["capstone"]["public"] and not cfg["auth"]["allowed_users"] and cfg["auth"].get("any_name"):
            extra.add(BOARD_SCOPE)
    c.JupyterHub.services = services
    c.JupyterHub.load_roles = roles
    if extra or "extra_user_scopes" in c.JupyterHub:
        c.JupyterHub.extra_user_scopes = extra


def board_role(cfg: Mapping) -> dict | None:
    """With capstone.public, the role that lets the course's students (the class list less the staff) through the
    hub to the dashboard, where the service shows them the pseudonymised leaderboard and nothing else
    (scalelab.hub.capstone). None when the board is not public (the hub answers students 403), or when there is no
    class list (a try-out hub, auth.any_name: every user gets BOARD_SCOPE through extra_user_scopes instead)."""
    if not cfg["capstone"]["public"]:
        return None
    staff = {*cfg["hub"]["admin_users"], *cfg["dashboard"]["instructors"], *cfg["dashboard"]["tas"]}
    students = sorted(set(cfg["auth"]["allowed_users"]) - staff)
    return {"name": "capstone-board", "scopes": [BOARD_SCOPE], "users": students} if students else None


def warm_scopes(cfg: Mapping) -> list[str]:
    """What the dashboard's token needs to warm the class (scalelab.hub.warm): start (never stop) the servers of the
    course's students, each named (the class list less the staff), so it cannot start a staff member's; a try-out
    hub with no class list (auth.any_name) gives it start:servers on everyone, and warm itself keeps to students."""
    dash, auth = cfg["dashboard"], cfg["auth"]
    staff = {*cfg["hub"]["admin_users"], *dash["instructors"], *dash["tas"]}
    students = sorted(set(auth["allowed_users"]) - staff)
    if students:
        return [f"start:servers!user={name}" for name in students]
    return ["start:servers"] if not auth["allowed_users"] and auth.get("any_name") else []


def refuse_unsafe(cfg: Mapping) -> None:
    """SettingsError listing every unsafe combination in `cfg` (`posture.problems`), each with its fix."""
    unsafe = problems(cfg)
    if unsafe:
        raise SettingsError("unsafe course settings; the hub does not start (`scalelab hub --check` shows the "
                            "posture):\n" + "\n".join(f"  - {p}" for p in unsafe))


def private_state_dir(state_dir: str) -> None:
    """The state dir (database, cookie secret, passwords, proxy token) exists and only the hub's account may enter
    it, and a database left by an earlier start is 0600 (`scalelab hub` runs JupyterHub with umask 077, so what it
    creates is private from the start)."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    os.chmod(state_dir, 0o700)
    for name in ("jupyterhub.sqlite", "jupyterhub_cookie_secret"):
        path = Path(state_dir) / name
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o600)


def system_account_names() -> set[str]:
    """Every name that must never sign in: the reserved ones and this machine's system accounts."""
    import pwd
    return set(RESERVED_NAMES) | {p.pw_name for p in pwd.getpwall() if system_account(p.pw_name)}


def load_config_d(c, cfg: Mapping) -> list[str]:
    """Exec every *.py in hub.config_d (sorted) with `c` and `cfg` in scope: the escape hatch. Returns the files."""
    folder = cfg["hub"].get("config_d")
    if not folder or not os.path.isdir(folder):
        return []
    files = sorted(str(p) for p in Path(folder).glob("*.py"))
    for path in files:
        code = compile(Path(path).read_text(encoding="utf-8"), path, "exec")
        exec(code, {"c": c, "cfg": cfg, "__file__": path, "__name__": "jupyterhub_config_d"})
    return files
