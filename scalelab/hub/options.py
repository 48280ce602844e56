"""Course profiles and the bounds on what a student may ask for when starting a server.

A student (through the spawn form or the REST API) may send only two user options:

- ``profile``: the name of one of the course's profiles (resources, partition, account, reservation fixed by it);
- ``walltime``: optionally *less* time than the profile allows (minutes, ``H:MM:SS`` or ``D-H:MM:SS``).

Anything else — another reservation, more GPUs, a longer walltime, extra ``#SBATCH`` text — is refused with a
message that says what is allowed. The batch script is then built from the resolved `JobRequest` only, never from
the raw user options.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import ScalelabError

#: The only user options a student may send.
ALLOWED_OPTIONS = ("profile", "walltime")

#: Walltimes offered in the spawn form besides "the profile's full time" (seconds).
FORM_WALLTIMES = (30 * 60, 3600, 2 * 3600, 4 * 3600, 8 * 3600)


class OptionError(ScalelabError, ValueError):
    """A user option is unknown or out of bounds; the message is safe to show to the student."""


@dataclass(frozen=True)
class Profile:
    """One choice in the spawn form: everything about the job except how long (up to `walltime`)."""

    name: str
    """Short id a REST caller passes as user option `profile`."""
    display_name: str
    """What the spawn form shows."""
    partition: str
    """Slurm partition (--partition)."""
    walltime: str
    """Longest time a student may ask for, H:MM:SS or D-HH:MM:SS (--time)."""
    description: str = ""
    """One line under the name in the form."""
    nodes: int = 1
    """Nodes in the job (--nodes)."""
    tasks_per_node: int = 1
    """Tasks per node (--ntasks-per-node)."""
    cpus_per_task: int = 1
    """CPUs per task (--cpus-per-task)."""
    gpus_per_node: int = 0
    """GPUs per node (--gres=gpu[:type]:N); 0 = none."""
    gpu_type: str = ""
    """GPU model in the gres request ("" = any)."""
    memory: str = ""
    """Memory per node (--mem); "" = the partition's default."""
    account: str = ""
    """--account ("" = the course's)."""
    qos: str = ""
    """--qos ("" = the course's)."""
    reservation: str = ""
    """--reservation ("" = the course's class reservation)."""
    constraint: str = ""
    """--constraint feature expression."""
    prologue: str = ""
    """Shell lines run before the server, after the course prologue."""

    @property
    def gres(self) -> str:
        """The --gres value for the GPUs, or ""."""
        if not self.gpus_per_node:
            return ""
        return f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else f"gpu:{self.gpus_per_node}"

    @property
    def cpus(self) -> int:
        """CPUs of the whole job."""
        return self.nodes * self.tasks_per_node * self.cpus_per_task

    @property
    def gpus(self) -> int:
        """GPUs of the whole job."""
        return self.nodes * self.gpus_per_node

    @property
    def max_seconds(self) -> int:
        """The profile's walltime in seconds."""
        return parse_walltime(self.walltime)


@dataclass(frozen=True)
class JobRequest:
    """What will be asked of Slurm: a profile and a walltime within it. Built only by `resolve_options`."""

    profile: Profile
    """The chosen profile."""
    seconds: int
    """Walltime in seconds, at most the profile's."""

    @property
    def walltime(self) -> str:
        """The walltime as Slurm writes it."""
        return format_walltime(self.seconds)

    def to_user_options(self) -> dict:
        """The canonical user options for this request (what the hub stores and re-uses)."""
        return {"profile": self.profile.name, "walltime": self.walltime}


def profiles_from_settings(slurm: Mapping[str, Any]) -> list[Profile]:
    """Profiles from the `slurm` settings section, course-wide account/qos/reservation filled in."""
    out = []
    for raw in slurm.get("profiles", []):
        p = dict(raw)
        for key in ("account", "qos", "reservation"):
            if not p.get(key):
                p[key] = slurm.get(key, "")
        out.append(Profile(**p))
    return out


def partition_gpus(sinfo: str) -> dict[str, list[dict[str, int]]]:
    """What `sinfo -h -o '%R|%G'` says each partition's nodes hold: partition -> one {gpu type ('' = untyped):
    count} per line (a group of alike nodes). A line without '|' (an older reply: the partition's name only) counts
    as a partition whose GPUs are unknown, and is read as holding none."""
    out: dict[str, list[dict[str, int]]] = {}
    for line in sinfo.splitlines():
        name, _, gres = line.strip().partition("|")
        if not name:
            continue
        gpus: dict[str, int] = {}
        for item in re.sub(r"\([^)]*\)", "", gres).split(","):  # gpu:a100:4(S:0,1) -> gpu:a100:4
            fields = item.strip().split(":")
            if len(fields) < 2 or fields[0] != "gpu" or not fields[-1].isdigit():
                continue
            kind = fields[1] if len(fields) > 2 else ""
            gpus[kind] = gpus.get(kind, 0) + int(fields[-1])
        out.setdefault(name, []).append(gpus)
    return out


def unavailable_reasons(profiles: Iterable[Profile], partitions: Mapping[str, list[dict[str, int]]]) -> dict[str, str]:
    """Why each profile this cluster cannot give would be refused by Slurm, said before anything is submitted:
    its partition does not exist, or no node of it holds the GPUs (of the type) the profile asks for per node."""
    out = {}
    for p in profiles:
        groups = partitions.get(p.partition)
        if groups is None:
            out[p.name] = f"its partition {p.partition!r} does not exist"
        elif p.gpus_per_node and not any(
                (g.get(p.gpu_type, 0) if p.gpu_type else sum(g.values())) >= p.gpus_per_node for g in groups):
            kind = f" {p.gpu_type}" if p.gpu_type else ""
            out[p.name] = (f"no node of partition {p.partition!r} has {p.gpus_per_node}{kind} GPU"
                           f"{'s' if p.gpus_per_node > 1 else ''}")
    return out


def _reason(unavailable: Iterable[str] | Mapping[str, str], profile: Profile) -> str:
    if isinstance(unavailable, Mapping) and unavailable.get(profile.name):
        return str(unavailable[profile.name])
    return f"its partition {profile.partition!r} does not exist"


MIN_WALLTIME_S = 60
MAX_WALLTIME_S = 31 * 24 * 3600  # no profile may ask more; Slurm reads 0 (and INFINITE) as no limit at all
_WALLTIME_FORMS = "give minutes (e.g. 90), H:MM:SS (e.g. 1:30:00) or D-HH:MM:SS"


def parse_walltime(value: Any) -> int:
    """Seconds in a walltime: whole minutes (int or digits), 'H:MM:SS' or 'D-H:MM:SS'; every form is held to the
    same bounds (at least a minute, at most 31 days), so no spelling of zero reaches Slurm as "no limit"."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OptionError(f"walltime {_show(value)} is not a duration; {_WALLTIME_FORMS}")
    text = str(value).strip()
    if re.fullmatch(r"[0-9]{1,9}", text):  # ASCII digits only: '²'.isdigit() is True, and int() refuses it
        seconds = int(text) * 60
    else:
        m = re.fullmatch(r"(?:([0-9]{1,3})-)?([0-9]{1,3}):([0-5][0-9]):([0-5][0-9])", text)
        if not m:
            raise OptionError(f"walltime {_show(value)} is not a duration; {_WALLTIME_FORMS}")
        days, hours, mins, secs = (int(g or 0) for g in m.groups())
        seconds = ((days * 24 + hours) * 60 + mins) * 60 + secs
    if seconds < MIN_WALLTIME_S:
        raise OptionError(f"walltime {_show(value)} must be at least 1 minute")
    if seconds > MAX_WALLTIME_S:
        raise OptionError(f"walltime {_show(value)} is longer than {MAX_WALLTIME_S // 86400} days; ask for less")
    return seconds


def format_walltime(seconds: int) -> str:
    """'H:MM:SS' (or 'D-HH:MM:SS' from a day up) for Slurm's --time."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    mins, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{mins:02d}:{secs:02d}"
    return f"{hours}:{mins:02d}:{secs:02d}"


MAX_OPTIONS_CHARS = 2048  # what a profile name and a walltime need, many times over


def _show(value: Any, limit: int = 60) -> str:
    """`value` as an error message quotes it: repr, cut to `limit` characters (a message never echoes a flood)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _single(value: Any) -> Any:
    # form data arrives as lists of strings; a REST caller may send anything
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def resolve_options(user_options: Mapping[str, Any] | None, profiles: Iterable[Profile], default_profile: str = "",
                    unavailable: Iterable[str] | Mapping[str, str] = ()) -> JobRequest:
    """The JobRequest for a student's user options, or OptionError saying what is not allowed. `unavailable`: the
    profiles this cluster cannot give, with why (`unavailable_reasons`) or as bare names (a missing partition)."""
    profiles = {p.name: p for p in profiles}
    unavailable = unavailable if isinstance(unavailable, Mapping) else set(unavailable)
    options = dict(user_options or {})
    if len(repr(options)) > MAX_OPTIONS_CHARS:
        raise OptionError(f"the options are {len(repr(options))} characters long; a server takes a 'profile' and "
                          "optionally a 'walltime', nothing more")
    unknown = sorted(str(k) for k in options if k not in ALLOWED_OPTIONS)
    if unknown:
        raise OptionError(f"option(s) {_show(unknown, 120)} cannot be set; a server takes only 'profile' (one of "
                          f"{sorted(profiles)}) and optionally a shorter 'walltime'. Partition, GPUs, memory, "
                          "account and reservation come with the profile.")
    name = _single(options.get("profile")) or default_profile or next(iter(profiles), "")
    if not isinstance(name, str) or name not in profiles:
        raise OptionError(f"profile {_show(name)} does not exist; choose one of {sorted(profiles)}")
    if name in unavailable:
        raise OptionError(f"profile {name!r} is not available on this cluster ({_reason(unavailable, profiles[name])})"
                          "; choose another")
    profile = profiles[name]
    walltime = _single(options.get("walltime"))
    seconds = profile.max_seconds if walltime in (None, "") else parse_walltime(walltime)
    if seconds > profile.max_seconds:
        raise OptionError(f"walltime {format_walltime(seconds)} is longer than profile {profile.display_name!r} "
                          f"allows ({profile.walltime}); ask for {profile.walltime} or less")
    return JobRequest(profile=profile, seconds=seconds)


def student_limits(profiles: Iterable[Profile], max_cpus: int = 0, max_gpus: int = 0) -> tuple[int, int]:
    """(CPUs, GPUs) one student may hold at once: `slurm.per_student`'s numbers, 0 = what the course's largest
    profile needs. The one source of the cap: the hub's check below and the local cluster's student QOS
    (MaxTRESPerUser, for jobs a student submits from a terminal; `LocalCluster.set_student_limits`)."""
    profiles = list(profiles)
    return (max_cpus or max((p.cpus for p in profiles), default=0),
            max_gpus or max((p.gpus for p in profiles), default=0))


def check_student_total(request: JobRequest, others: Iterable[str], profiles: Iterable[Profile],
                        max_cpus: int = 0, max_gpus: int = 0) -> None:
    """OptionError when `request` and the student's other live servers (`others`: their profile names) together
    ask for more CPUs or GPUs than one student may hold at once. 0 = what the course's largest profile needs (one
    server of any size, or several small ones): named servers do not multiply the profile limits. Slurm holds the
    same line for jobs a student submits itself with a QOS (MaxTRESPerUser): the local cluster's is this number."""
    profiles = {p.name: p for p in profiles}
    max_cpus, max_gpus = student_limits(profiles.values(), max_cpus, max_gpus)
    held = [profiles[name] for name in others if name in profiles]
    cpus = request.profile.cpus + sum(p.cpus for p in held)
    gpus = request.profile.gpus + sum(p.gpus for p in held)
    if cpus > max_cpus or gpus > max_gpus:
        raise OptionError(f"profile {request.profile.display_name!r} with your {len(held)} other running server(s) "
                          f"({', '.join(p.display_name for p in held)}) would hold {cpus} CPUs and {gpus} GPUs; a "
                          f"student may hold {max_cpus} CPUs and {max_gpus} GPUs at once. Stop a server first, or "
                          "choose a smaller profile")


def options_from_form(formdata: Mapping[str, list[str]]) -> dict:
    """Spawn-form data to user options: single values unpacked, an empty walltime and the page's own `_xsrf`
    field dropped (every other field still goes through `resolve_options`)."""
    if len(repr(dict(formdata))) > MAX_OPTIONS_CHARS + 200:  # the page's xsrf token comes along
        raise OptionError("the form sent more than a profile and a walltime; reload the page and try again")
    out = {key: _single(value) for key, value in formdata.items() if key != "_xsrf"}
    if out.get("walltime") in ("", None):
        out.pop("walltime", None)
    return out


def _queue_html(lines: Iterable[str]) -> str:
    lines = list(lines)
    if not lines:
        return ""
    return '<br><small class="scalelab-queue">' + "<br>".join(html.escape(str(line)) for line in lines) + "</small>"


def options_form_html(profiles: Iterable[Profile], default_profile: str = "",
                      unavailable: Iterable[str] | Mapping[str, str] = (),
                      queue: Mapping[str, list[str]] | None = None, queue_time: str = "") -> str:
    """The spawn form: one radio button per profile (one this cluster cannot give disabled, with why), and a
    walltime choice within the profile's limit. `queue`: profile name -> lines on what its partition and
    reservation have free now (`scalelab.hub.queue.profile_queue_lines`; counts only), shown under it, with
    `queue_time` (when Slurm was asked). Every text from the settings or from Slurm is escaped."""
    unavailable = unavailable if isinstance(unavailable, Mapping) else set(unavailable)
    queue = queue or {}
    profiles = list(profiles)
    default = default_profile or (profiles[0].name if profiles else "")
    rows = []
    for p in profiles:
        esc = html.escape
        off = p.name in unavailable
        checked = " checked" if p.name == default and not off else ""
        note = f" (not available on this cluster: {_reason(unavailable, p)})" if off else ""
        rows.append(
            f'<div class="radio"><label><input type="radio" name="profile" value="{esc(p.name)}"{checked}'
            f'{" disabled" if off else ""}> <strong>{esc(p.display_name)}</strong>{esc(note)}'
            f'<br><small>{esc(p.description)} — partition {esc(p.partition)}, up to {esc(p.walltime)}'
            f"</small>{_queue_html(queue.get(p.name, ()))}</label></div>")
    when = (f'<p class="scalelab-queue-time"><small>Free nodes, CPUs and GPUs as Slurm counted them at '
            f'{html.escape(queue_time)}; reload the page to count again.</small></p>') if queue and queue_time else ""
    times = "".join(f'<option value="{format_walltime(s)}">{format_walltime(s)}</option>' for s in FORM_WALLTIMES)
    return (
        '<div class="form-group"><p>Choose the resources for your JupyterLab session:</p>'
        + "".join(rows) + when
        + '</div><div class="form-group"><label for="scalelab-walltime">Time limit</label>'
        '<select class="form-control" name="walltime" id="scalelab-walltime">'
        '<option value="" selected>the profile\'s full time</option>' + times + "</select>"
        "<small>A shorter time starts sooner on a busy cluster; longer than the profile allows is refused."
        "</small></div>")
