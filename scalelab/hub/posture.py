"""The security posture of a course's settings: who students' code runs as, who may sign in, and what is unsafe.

`scalelab hub` refuses to start on an unsafe posture and `scalelab hub --check` prints the table below, so an
instructor sees before the first student does what a security review would ask:

    mode              slurm
    servers run as    each student's own Unix account (course accounts the hub creates)
    sign-in           shared password, 30 names on the list
    admins            instructor
    spawn from a link off (form POST only)
    state dir         /srv/hub (0700, only the hub's account)

Unsafe combinations (each with the setting that fixes it) come from `problems()`; `resolve_run_as()` turns
`servers.run_as: auto` into what this hub will really do.
"""
from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Mapping

from ..cluster.job_end import COURSE_GROUP  # the group's one name: the cluster's Epilog reads it too
from ..paths import checkout_root

#: Login names that are never a student, whatever the roster says (system and service accounts).
RESERVED_NAMES = frozenset({"root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp",
                            "proxy", "www-data", "backup", "list", "irc", "gnats", "nobody", "systemd-network",
                            "systemd-resolve", "messagebus", "sshd", "slurm", "munge", "admin", "jupyter",
                            "jupyterhub", "postgres", "mysql", "ubuntu", "debian"})
#: Unix accounts below this uid are system accounts (Debian's FIRST_UID).
FIRST_UID = 1000


#: Folders of the checkout that students must not read, though their servers use its environment (the venv, the
#: scalelab package): the reference labs (solutions and hidden checks), a solved lab among the test fixtures, the
#: history of both, and what instructors make from them (executed references, their own runs, collected work,
#: grades).
INSTRUCTOR_ONLY = ("labs", "tests/fixtures/legacy", ".git", "build/executed", "build/runs", "build/collected",
                   "build/grades")


def seal_instructor_files(root: str | Path | None = None) -> list[Path]:
    """Close `root`'s (the checkout's) INSTRUCTOR_ONLY folders to other accounts; returns those it changed.

    For a hub whose servers run as the students' own accounts: they traverse the checkout to reach its venv and
    the scalelab package, so what else it holds must not be open to them. Each folder loses its bits for others,
    and for its group too when that is the course group; the checkout's own group (instructors who grade without
    root) keeps its access. A folder made later by `scalelab course collect` or `scalelab grade` is made private
    by those commands."""
    import grp
    root = checkout_root() if root is None else Path(root)
    try:
        course_gid = grp.getgrnam(COURSE_GROUP).gr_gid
    except KeyError:
        course_gid = None
    changed = []
    for rel in INSTRUCTOR_ONLY:
        path = root / rel
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        closed = mode & (0o700 if st.st_gid == course_gid else 0o770)
        if closed != mode:
            os.chmod(path, closed)
            changed.append(path)
    return changed


def resolve_run_as(cfg: dict, euid: int | None = None) -> dict:
    """`cfg` with servers.run_as 'auto' made concrete: student-accounts with course accounts when the hub runs as
    root (so no student code runs as root), hub-account otherwise. Changes `cfg` in place and returns it."""
    euid = os.geteuid() if euid is None else euid
    servers = cfg["servers"]
    if servers.get("run_as") == "auto":
        if euid == 0:
            servers["run_as"], servers["create_accounts"] = "student-accounts", True
        else:
            servers["run_as"] = "hub-account"
    return cfg


def system_account(name: str) -> bool:
    """True for a name that is reserved or belongs to an existing system account (uid < 1000, or nobody's)."""
    if name in RESERVED_NAMES:
        return True
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return False
    return uid < FIRST_UID or uid >= 65534


def problems(cfg: Mapping, euid: int | None = None) -> list[str]:
    """What is unsafe in these (resolved) settings, each with the setting that fixes it; [] when none."""
    euid = os.geteuid() if euid is None else euid
    servers, auth = cfg["servers"], cfg["auth"]
    out = []
    if servers["run_as"] == "hub-account" and euid == 0 and not servers.get("allow_root_servers"):
        out.append("servers.run_as: hub-account on a hub running as root runs every student's code as root: it could "
                   "read the hub's secrets and database and every other student's files and tokens. Use run_as: "
                   "student-accounts (with servers.create_accounts: true on a single machine), or run the hub as an "
                   "unprivileged account; allow_root_servers: true only on a throwaway test machine")
    if servers["run_as"] == "hub-account" and euid != 0 and not servers.get("shared_account") \
            and not single_person(cfg):
        out.append("servers.run_as: hub-account runs every student's server as the hub's own account: each student "
                   "could read the others' work and tokens and the hub's secrets (its state dir). For a class, run "
                   "the hub as root (servers.run_as: student-accounts, with servers.create_accounts: true on a single "
                   "machine); servers.shared_account: true only for a private try-out, or list one name in "
                   "auth.allowed_users")
    if servers["run_as"] == "student-accounts" and auth["type"] == "shared-password" \
            and not servers.get("create_accounts"):
        out.append("auth.type: shared-password with servers.run_as: student-accounts would let anyone with the "
                   "password sign in as any existing Unix account; use auth.type: pam, or servers.create_accounts: "
                   "true (course accounts that exist only for the course)")
    if servers["run_as"] == "student-accounts" and servers.get("create_accounts") and not auth["allowed_users"]:
        out.append("auth.allowed_users: empty with servers.create_accounts: true would create a Unix account for "
                   "any name anyone signs in with; list the students (auth.allowed_users)")
    if auth["type"] == "shared-password" and not auth["allowed_users"] and not auth.get("any_name"):
        out.append("auth.allowed_users: empty, so anyone with the shared password could sign in under any name; "
                   "list the students (auth.allowed_users, or auth.roster for a CSV with per-student passwords), or "
                   "set auth.any_name: true for a private try-out")
    names = [*auth["allowed_users"], *cfg["hub"]["admin_users"]]
    bad = sorted({n for n in names if system_account(n)})
    if bad:
        out.append(f"auth.allowed_users / hub.admin_users: {bad} are system account names; students and instructors "
                   "sign in under names of their own")
    return out


def single_person(cfg: Mapping) -> bool:
    """Whether at most one name can sign in: one listed name (admins included), no PAM, no any_name."""
    auth = cfg["auth"]
    return auth["type"] != "pam" and not auth.get("any_name") and \
        len({*auth["allowed_users"], *cfg["hub"]["admin_users"]}) <= 1


def warnings(cfg: Mapping) -> list[str]:
    """Weak but allowed choices, said at start and by --check."""
    out = []
    if cfg["auth"]["type"] == "shared-password" and not cfg["auth"]["allowed_users"]:
        out.append("auth.any_name: anyone with the shared password can sign in under any (non-system) name; list "
                   "the students for a real class")
    roster = cfg["auth"].get("roster")
    if roster and os.path.exists(roster) and os.stat(roster).st_mode & 0o077:
        out.append(f"auth.roster: {roster} holds passwords and other users can read it: chmod 600 it")
    if cfg["servers"].get("allow_root_servers") and cfg["servers"]["run_as"] == "hub-account":
        out.append("servers.allow_root_servers: students' servers may run as root (test machine only)")
    if cfg["servers"].get("shared_account") and cfg["servers"]["run_as"] == "hub-account" and not single_person(cfg):
        out.append("servers.shared_account: every student's server runs as one account, so students can read each "
                   "other's work and tokens and the hub's secrets (a private try-out only)")
    hub = cfg["hub"]
    if not hub.get("subdomain_host") and hub["ip"] not in ("127.0.0.1", "localhost", "::1") and not single_person(cfg):
        out.append("hub.subdomain_host: empty, so every student's server shares the hub's address. Held here: "
                   "files a server serves run sandboxed (a unique origin) and a student's own server config, which "
                   "could switch that off, is ignored. Subdomains add what one address cannot: each server its own "
                   "origin and cookies, so nothing a student's server sends (a notebook's trusted output, a "
                   "JupyterLab extension in the course environment) can act on the hub or another server as whoever "
                   "opens it, an instructor included (JupyterHub's advice for untrusted users); set it, with "
                   "wildcard DNS and a certificate")
    auth = cfg["auth"]
    if auth["type"] == "shared-password" and not auth.get("per_student_passwords", True) and \
            len([n for n in auth["allowed_users"] if n not in set(cfg["hub"]["admin_users"])]) > 1:
        out.append("auth.per_student_passwords: false: every listed student signs in with the one shared password, "
                   "so any student can sign in as any classmate (their files, server and tokens); a try-out only")
    if cfg["servers"].get("spawn_from_link"):
        out.append("servers.spawn_from_link: a link on any site can start a server (and a Slurm job) for a "
                   "signed-in student")
    return out


def who_runs_servers(cfg: Mapping, euid: int | None = None) -> str:
    """The 'servers run as' line of the posture table."""
    euid = os.geteuid() if euid is None else euid
    if cfg["servers"]["run_as"] == "student-accounts":
        made = " (course accounts the hub creates, group " + COURSE_GROUP + ")" if cfg["servers"].get(
            "create_accounts") else ""
        return "each student's own Unix account" + made
    who = "root" if euid == 0 else pwd.getpwuid(euid).pw_name
    shared = "" if single_person(cfg) else ", shared by every student (not separated from each other)"
    return f"the hub's account ({who}), each student in a directory of their own{shared}"


def posture(cfg: Mapping, euid: int | None = None) -> list[tuple[str, str]]:
    """(what, setting) rows for `scalelab hub --check`."""
    auth = cfg["auth"]
    if auth["type"] == "pam":
        sign_in = "PAM (Unix accounts)"
    else:
        listed = auth["allowed_users"]
        sign_in = ("per-student passwords from the roster" if auth.get("roster") else "shared password") + ", " + (
            f"{len(listed)} names on the list" if listed else "any name (no list)")
    state = cfg["hub"]["state_dir"]
    try:
        mode = f"{os.stat(state).st_mode & 0o777:04o}"
    except OSError:
        mode = "made 0700 at start"
    return [
        ("mode", cfg["mode"]),
        ("servers run as", who_runs_servers(cfg, euid)),
        ("sign-in", sign_in + ", throttled after failures"),
        ("sign-in address", "the connection's; X-Forwarded-For believed only from " +
         ", ".join("the hub's own proxy" if t == "own-proxy" else t for t in cfg["hub"].get("trusted_proxies", []))
         if cfg["hub"].get("trusted_proxies") else "the connection's (no forwarding header believed)"),
        ("admins", ", ".join(cfg["hub"]["admin_users"]) or "none"),
        ("spawn from a link", "on" if cfg["servers"].get("spawn_from_link") else "off (form POST only)"),
        ("state dir", f"{state} ({mode})"),
        ("a student's own jobs", own_jobs(cfg)),
        ("instructor files", "labs, tests/fixtures/legacy, .git, build/{executed,runs,collected,grades}: closed to "
                             "students at start" if cfg["servers"]["run_as"] == "student-accounts" else
                             "labs, .git, build/...: readable by the servers' account (the hub's own)"),
    ]


def own_jobs(cfg: Mapping) -> str:
    """What bounds the jobs a student submits from a terminal (sbatch, srun past the spawn form)."""
    if cfg["mode"] != "slurm":
        return "no Slurm: servers are processes on this machine, each held to its profile"
    from .options import profiles_from_settings, student_limits
    per = cfg["slurm"].get("per_student") or {}
    try:
        cpus, gpus = student_limits(profiles_from_settings(cfg["slurm"]), int(per.get("cpus", 0)),
                                    int(per.get("gpus", 0)))
    except Exception as e:  # noqa: BLE001 - the settings' own check names the problem; the table says it is unknown
        return f"unknown ({type(e).__name__}: the slurm settings do not load)"
    return (f"{cpus} CPUs, {gpus} GPUs per student with their servers (slurm.per_student): held by the local cluster's "
            "QOS course-student (scalelab hub sets it); at a centre, by the QOS its Slurm administrators set (README)")


def format_posture(cfg: Mapping, euid: int | None = None) -> str:
    """The posture table, then problems and warnings, as text."""
    rows = posture(cfg, euid)
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    lines += [f"  UNSAFE: {p}" for p in problems(cfg, euid)]
    lines += [f"  warning: {w}" for w in warnings(cfg)]
    return "\n".join(lines)


__all__ = ["resolve_run_as", "problems", "warnings", "posture", "format_posture", "system_account",
           "RESERVED_NAMES", "COURSE_GROUP"]
