"""Where things are: the checkout this package runs from, its parts, and the course's command-line tools.

Everything is computed on call (never at import), so a test or a site that moves a folder sees the move.

    checkout_root()        the folder holding scalelab/, labs/, hub_config/, kernels/, site/
    labs_dir()             the reference labs (with solutions: never handed to students as they are)
    student_labs_dir()     where `scalelab labs release` writes student copies (build/student/labs)
    find_tool("mpirun")    an executable, looked up beside this Python first (the venv's bin), then on PATH
    require_tool("mpirun") the same, or a SetupError naming the command that installs it
    read_beneath(base, rel, max_bytes)   a file someone else controls, read without following any link below base
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

from .errors import ScalelabError, SetupError, UntrustedFileError


def checkout_root() -> Path:
    """The checkout this package runs from (labs/, hub_config/, kernels/, site/ and build/ live there)."""
    return Path(__file__).resolve().parents[1]


def labs_dir() -> Path:
    """The reference labs of the checkout."""
    return checkout_root() / "labs"


def student_labs_dir() -> Path:
    """Where released student copies of the labs go by default."""
    return checkout_root() / "build" / "student" / "labs"


def hub_config_dir() -> Path:
    """The shipped hub configuration (jupyterhub_config.py, course settings, batch templates)."""
    return checkout_root() / "hub_config"


def kernels_dir() -> Path:
    """The course kernel specs shipped in the checkout."""
    return checkout_root() / "kernels"


def cluster_state_dir() -> Path:
    """The local Slurm's state folder: $SCALELAB_CLUSTER_DIR; else /var/lib/scalelab/cluster as root,
    ~/.cache/scalelab/cluster otherwise (`scalelab.cluster.local` runs the daemons there)."""
    env = os.environ.get("SCALELAB_CLUSTER_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    if os.geteuid() == 0:
        return Path("/var/lib/scalelab/cluster")
    return Path.home() / ".cache" / "scalelab" / "cluster"


#: Where Slurm and munge keep what lets a process submit jobs or get credentials (sockets, keys, configuration).
SCHEDULER_PATHS = ("/run/munge", "/var/run/munge", "/etc/munge", "/var/lib/munge", "/etc/slurm", "/run/slurm",
                   "/var/spool/slurmd", "/var/lib/slurm")


def scheduler_paths() -> list[Path]:
    """The scheduler's paths on this machine (the local cluster's state folder, munge's and Slurm's own), which a
    graded run must not reach: munge's socket hands out credentials across network namespaces."""
    found = [cluster_state_dir(), *map(Path, SCHEDULER_PATHS)]
    conf = os.environ.get("SLURM_CONF", "").strip()
    if conf:
        found.append(Path(conf).parent)
    return [p for p in found if os.path.lexists(p)]


def venv_bin() -> Path:
    """The bin directory of the running interpreter's environment (the venv's when run from it)."""
    return Path(sys.prefix) / "bin"


# The command that installs each tool the kit runs: doctor, launchers, the cluster and the hub name the same fix.
_APT_SLURM = "apt-get install -y slurm-wlm munge"
INSTALL_HINTS = {
    "horovodrun": "bash tools/ensure_horovod.sh   (builds the wheel once, ~7 min on 2 cores)",
    "mpirun": "apt-get install -y openmpi-bin libopenmpi-dev",
    **{name: _APT_SLURM for name in ("sbatch", "squeue", "scontrol", "scancel", "srun", "slurmctld", "slurmd",
                                     "munged")},
    "configurable-http-proxy": "bash tools/ensure_chp.sh   (npm installs it into .venv/node, linked as "
                               ".venv/bin/configurable-http-proxy)",
    "chromium": "apt-get install -y chromium chromium-driver",
}
_SYSTEM_BINS = ("/usr/sbin", "/sbin")


def find_tool(name: str) -> str | None:
    """Absolute path of `name`: beside this Python first (the venv's bin, where `make setup` puts horovodrun and
    configurable-http-proxy), then on PATH, then in the system sbin folders (slurmd, munged); None if nowhere."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    search = os.pathsep.join([os.environ.get("PATH", ""), str(venv_bin()), *_SYSTEM_BINS])
    return shutil.which(name, path=search)


def require_tool(name: str, error: type[ScalelabError] = SetupError) -> str:
    """`find_tool(name)`, or `error` (SetupError; launchers pass LaunchError) saying where it looked and the command
    that installs it."""
    found = find_tool(name)
    if not found:
        raise error(f"{name} not found (looked beside {sys.executable} and on PATH); "
                         f"install it: {INSTALL_HINTS.get(name, 'see scalelab doctor')}")
    return found


def read_beneath(base: str | Path, relpath: str | Path, max_bytes: int, *, tail: bool = False,
                 single_link: bool = False) -> bytes:
    """Bytes of `base`/`relpath` where whoever owns the folders below `base` may be hostile (a graded run, a
    student's home read by a root hub): no symbolic link below `base` is followed, only a regular file is read,
    never more than `max_bytes`. A bigger file is refused, or with `tail` its last `max_bytes` are read;
    `single_link` refuses a file with other hard links (a link to a file elsewhere). UntrustedFileError otherwise."""
    parts = Path(relpath).parts
    if not parts or any(p in ("..", "/") for p in parts):
        raise UntrustedFileError(f"bad relative path {relpath!r}")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:  # a link (ENOTDIR/ELOOP), or missing
                raise UntrustedFileError(f"{relpath}: {part}: {e.strerror}") from None
            os.close(fd)
            fd = nxt
        try:  # O_NONBLOCK: a FIFO planted in the file's place must not hang the reader
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as e:
            raise UntrustedFileError(f"{relpath}: {e.strerror}") from None
        with os.fdopen(ffd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UntrustedFileError(f"{relpath}: not a regular file")
            if single_link and info.st_nlink > 1:
                raise UntrustedFileError(f"{relpath}: has {info.st_nlink} hard links; not read")
            if info.st_size > max_bytes:
                if not tail:
                    raise UntrustedFileError(f"{relpath}: {info.st_size / 2**20:.1f} MiB, over the limit of "
                                             f"{max_bytes / 2**20:.1f} MiB")
                f.seek(info.st_size - max_bytes)
            return f.read(max_bytes + 1)[:max_bytes]
    finally:
        os.close(fd)


def json_lines(text: str | bytes) -> list[dict]:
    """The JSON objects of a JSON-lines text, in order. Tolerant, as logs that a killed process or a student may have
    written need: a line that is not a JSON object (cut short by a kill, junk, nested too deep) is skipped and the
    rest still counts."""
    import json
    out = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


__all__ = ["read_beneath", "json_lines", "checkout_root", "labs_dir", "student_labs_dir", "hub_config_dir", "kernels_dir", "venv_bin",
           "find_tool", "require_tool", "INSTALL_HINTS"]
