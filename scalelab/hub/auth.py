"""The passwords of the shared-password sign-in: taken from the settings, or generated once and kept in the state dir.

A generated password is written to ``<state_dir>/password`` (mode 0600) at the first start and re-used after, so a
hub restart does not lock students out; `scalelab hub` prints it at every start. Delete the file for a new one.

Each listed student signs in with a password of their own (`auth.per_student_passwords`, on by default): the
roster's, else one generated into ``<state_dir>/student_passwords.csv`` (mode 0600, "name,password" lines, kept
across restarts). With one password for a whole class, any student could sign in as any classmate; the shared
password is left for `auth.any_name` try-outs.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Mapping


def _read_or_create(path: Path, nbytes: int) -> str:
    try:
        value = path.read_text(encoding="utf-8").strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    return value


def password_files(cfg: Mapping) -> tuple[Path, Path]:
    """Where generated passwords are kept: (<state_dir>/password, <state_dir>/admin_password)."""
    state = Path(cfg["hub"]["state_dir"])
    return state / "password", state / "admin_password"


def ensure_passwords(cfg: Mapping) -> dict:
    """{'user': ..., 'admin': ... or None, 'students': {name: password}}: the settings' passwords, else generated
    ones kept in the state dir; 'students' holds every listed student's own password (`student_passwords`)."""
    user_file, admin_file = password_files(cfg)
    auth = cfg["auth"]
    user = auth.get("password") or _read_or_create(user_file, 9)
    admin = None
    if cfg["hub"].get("admin_users"):
        admin = auth.get("admin_password") or _read_or_create(admin_file, 30)
    return {"user": user, "admin": admin, "students": student_passwords(cfg)}


def student_passwords_file(cfg: Mapping) -> Path:
    """Where generated per-student passwords are kept."""
    return Path(cfg["hub"]["state_dir"]) / "student_passwords.csv"


def student_passwords(cfg: Mapping) -> dict[str, str]:
    """{name: password} for every listed student (admins sign in with the admin password): the roster's own
    password, else one generated at the first start and kept in `student_passwords_file` (0600). {} when
    auth.per_student_passwords is false, with PAM, or when no student is listed (auth.any_name)."""
    from .settings import read_roster
    auth = cfg["auth"]
    if auth["type"] != "shared-password" or not auth.get("per_student_passwords", True):
        return {}
    roster = {n: pw for n, pw in read_roster(auth["roster"]).items() if pw} if auth.get("roster") else {}
    admins = set(cfg["hub"].get("admin_users") or ())
    names = [n for n in dict.fromkeys(auth["allowed_users"]) if n not in admins]
    path = student_passwords_file(cfg)
    kept: dict[str, str] = {}
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            name, _, pw = line.partition(",")
            if name.strip() and pw.strip():
                kept[name.strip()] = pw.strip()
    except FileNotFoundError:
        pass
    missing = [n for n in names if n not in roster and n not in kept]
    if missing:
        kept.update({n: secrets.token_urlsafe(9) for n in missing})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(f"{n},{pw}\n" for n, pw in kept.items()))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    return {n: roster.get(n) or kept[n] for n in names}
