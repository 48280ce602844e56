"""The Slurm batch script of a student's server: a pure function from a resolved request to text.

The template is `hub_config/slurm_batch.sh.j2`. Only values from the course settings and the chosen profile go in,
and every one-line value is checked again here (a newline or an odd character would otherwise add an `#SBATCH`
line), so the script can be tested as text.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Iterable, Sequence

import jinja2

from .options import JobRequest
from ..paths import hub_config_dir

#: What a one-line value in the script may contain, per variable (anything else is refused).
_SAFE = {
    "token": re.compile(r"[A-Za-z0-9_.:+-]*"),
    "path": re.compile(r"[A-Za-z0-9_./%@+:=-]+"),
    "constraint": re.compile(r"[A-Za-z0-9_.&|,()\[\]*:!-]*"),
    "walltime": re.compile(r"(\d+-)?\d{1,3}:[0-5]\d:[0-5]\d"),
    "memory": re.compile(r"(\d+[KMGT]?)?"),
    "export": re.compile(r"[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*"),
}


def default_template_path() -> Path:
    """The batch script template shipped in hub_config/."""
    return hub_config_dir() / "slurm_batch.sh.j2"


def _check(kind: str, name: str, value: str) -> str:
    if not _SAFE[kind].fullmatch(value):
        raise ValueError(f"batch script value {name}={value!r} is not a plain {kind}; refusing to write it into "
                         "the script (check the course settings)")
    return value


def render_batch_script(request: JobRequest, *, username: str, job_name: str, log_path: str, workdir: str,
                        export_vars: Iterable[str], cmd: Sequence[str], prologue: str = "",
                        provision_cmd: Sequence[str] = (), template: str | None = None, signal_s: int = 0) -> str:
    """The batch script text for `request`, running `cmd` (argv) in `workdir` with `export_vars` passed on; with
    `signal_s`, Slurm sends the server SIGUSR1 that many seconds before the time limit (scalelab.hub.walltime)."""
    p = request.profile
    values = {
        "job_name": _check("token", "job_name", job_name),
        "log_path": _check("path", "log_path", log_path),
        "workdir": _check("path", "workdir", workdir),
        "export_vars": _check("export", "export_vars", ",".join(sorted(set(export_vars)))),
        "partition": _check("token", "partition", p.partition),
        "nodes": int(p.nodes),
        "tasks_per_node": int(p.tasks_per_node),
        "cpus_per_task": int(p.cpus_per_task),
        "walltime": _check("walltime", "walltime", request.walltime),
        "memory": _check("memory", "memory", p.memory),
        "gres": _check("token", "gres", p.gres),
        "account": _check("token", "account", p.account),
        "qos": _check("token", "qos", p.qos),
        "reservation": _check("token", "reservation", p.reservation),
        "constraint": _check("constraint", "constraint", p.constraint),
        "username": _check("token", "username", username),
        "profile": _check("token", "profile", p.name),
        "prologue": "\n".join(x for x in (prologue.strip(), p.prologue.strip()) if x),
        "cmd": shlex.join(cmd),
        "provision_cmd": shlex.join(provision_cmd) if provision_cmd else "",
        "signal": f"B:USR1@{int(signal_s)}" if int(signal_s) > 0 else "",
    }
    if not values["cmd"]:
        raise ValueError("the server command is empty")
    text = template if template is not None else default_template_path().read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(text).render(**values)
