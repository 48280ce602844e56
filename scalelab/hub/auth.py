"""The shared passwords of the local default: taken from the settings, or generated once and kept in the state dir.

A generated password is written to ``<state_dir>/password`` (mode 0600) at the first start and re-used after, so a
hub restart does not lock students out; `scalelab hub` prints it at every start. Delete the file for a new one.
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
    """{'user': ..., 'admin': ... or None}: the settings' passwords, else generated ones kept in the state dir."""
    user_file, admin_file = password_files(cfg)
    auth = cfg["auth"]
    user = auth.get("password") or _read_or_create(user_file, 9)
    admin = None
    if cfg["hub"].get("admin_users"):
        admin = auth.get("admin_password") or _read_or_create(admin_file, 30)
    return {"user": user, "admin": admin}
