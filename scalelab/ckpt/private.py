"""A run's private folder in a place other accounts can write (the node-local tier under /dev/shm): made safely.

/dev/shm and /tmp are writable by every account on a node. A folder there with a name another account can
compute, used as found, hands that account the run's files: it can plant a checkpoint the run resumes from, or a
symbolic link that sends the run's writes elsewhere. So a node-local folder is used only when

- it is a real directory (never a symbolic link), owned by this process's account, and private (mode 0700: a
  folder of ours that is open to others is closed);
- every folder above it is owned by root or by this account, and any of them that others may write is sticky
  (others cannot rename or replace what is ours inside it, as in /dev/shm and /tmp); a symbolic link on the way
  is owned by root or by this account.

Anything else is refused with a CheckpointError naming the folder and its owner: the run never reads what a
classmate made. (And checkpoints are loaded with `weights_only=True`, so even a file that got there could only
hold wrong numbers, never run code.)
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .manifest import CheckpointError


def _owner(st) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
    except (KeyError, ImportError):
        return f"uid {st.st_uid}"


def _check_above(path: Path, me: int) -> None:
    """Every folder above `path`, as written and as resolved, is ours or root's; others may write only sticky ones."""
    written = [path.parent, *path.parent.parents]
    resolved = Path(os.path.realpath(path.parent))
    for p, st in [(p, os.lstat(p)) for p in written] + [(p, os.stat(p)) for p in [resolved, *resolved.parents]]:
        if st.st_uid not in (0, me):
            raise CheckpointError(f"{p} (above the private folder {path}) belongs to {_owner(st)}: another "
                                  "account could replace what is inside it; choose a folder of your own (checkpoint.local_dir)")
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise CheckpointError(f"{p} (above the private folder {path}) is writable by other accounts and not "
                                  "sticky: they could replace what is inside it; choose a folder of your own (checkpoint.local_dir)")


def private_dir(path) -> Path:
    """Make (or check) `path` as a folder only this account can use; return it. Raises CheckpointError when it is
    a symbolic link, not a directory, another account's, or lies under a folder another account controls."""
    path = Path(os.path.abspath(path))
    me = os.geteuid()
    missing = [p for p in [path, *path.parents] if not os.path.lexists(p)]
    for p in reversed(missing):  # the missing ones, top down: each made 0700, each checked as it is made
        _check_above(p, me)
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # someone made it in between: checked below like any folder found
    _check_above(path, me)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path} is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a directory'} "
                              f"(owner {_owner(st)}): a node-local checkpoint folder must be a real directory of "
                              "your own; refusing to use it")
    if st.st_uid != me:
        raise CheckpointError(f"{path} belongs to {_owner(st)}, not to this account (uid {me}): another account "
                              "made it first, and what it holds is not yours to load; refusing it (set "
                              "checkpoint.local_dir to a folder of your own)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


__all__ = ["private_dir"]
