"""Warm the class: start every listed student's server before the lecture (issue 36, item 2).

    scalelab course warm                       # now: every student on the class list
    scalelab course warm --at 08:50            # waits here until 08:50 (today), then warms
    scalelab course warm --users ann,ben       # some students only
    dashboard: the button "Start every student's server" (instructors only)

Both go through the class dashboard's `POST <hub>/services/dashboard/api/warm`, which only instructors (hub admins,
`dashboard.instructors`) pass: a TA gets 403 from the dashboard's read-only gate, a student from the hub's OAuth and
the page's role check. The dashboard then asks the hub's REST API, with the dashboard service's own token, to start
each student's default server, exactly as the student's own Start button would: the same spawner, so in Slurm mode
the job is submitted as the student's account (`servers.run_as`), with the course's default profile
(`slurm.default_profile`: what the spawn form preselects for every student) and therefore in the class reservation
(`slurm.reservation`) the profile carries. What warm sends is fixed here (`warm_options`); a request naming a profile,
options, or anyone who is not one of the course's students is refused before anything starts. The service token may
start the listed students' servers only (`start:servers!user=<student>`, `hub.config.update_dashboard`): not stop
them, not start a staff member's.

A student whose server already runs (or is starting) is left alone; one student's failure (Slurm refused the job,
an account that is not a course account) is reported for that student and the others go on. A student who signs in
afterwards finds the server running: the hub's home page sends them to it.

What a warmed server no one opens costs: it holds its profile's CPUs (and GPUs) in the reservation from the moment
it starts, and the idle culler (`culler.timeout`, default 3600 s) stops it once it has seen no activity for that
long: a warmed server counts as active from its start, so one that is never opened is stopped `culler.timeout`
seconds after warm (at most `culler.every` later). Warm shortly before the lecture, not hours before.

`--at` waits in the command (it does not schedule inside the hub): nothing is kept in the hub that a restart could
lose silently, the waiting command is visible and ends with Ctrl-C, and `at`, cron or a tmux pane can run it. The
instructor's token and the class list are checked at once (a dry run) so a mistake shows before the wait, not at
the lecture.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Callable, Iterable, Mapping

from ..errors import ScalelabError

#: Keys a warm request may carry; anything else (a profile, user options) is refused.
REQUEST_KEYS = ("users", "dry_run")
#: Starts sent to the hub at once: each waits up to the hub's slow_spawn_timeout (10 s) for a quick start.
MAX_PARALLEL = 32


class WarmError(ScalelabError):
    """A warm request that cannot be carried out as asked; the message says what to change."""


@dataclass
class WarmResult:
    """What happened to one student's server."""

    name: str
    """The student's hub name."""
    outcome: str
    """started (ready), starting (the hub is still starting it), already running, already starting, or failed."""
    detail: str = ""
    """The hub's answer when it failed, else empty."""


def warm_options(cfg: Mapping) -> dict:
    """The only user options warm sends: the course's default profile in Slurm mode (the spawner checks it as it
    checks a student's own choice), none in local mode (there are no profiles)."""
    if cfg["mode"] == "slurm":
        return {"profile": cfg["slurm"]["default_profile"]}
    return {}


def check_request(body: object) -> tuple[list[str] | None, bool]:
    """(users asked for or None = the whole class, dry_run) from a warm request body; WarmError for anything else."""
    if body is None:
        return None, False
    if not isinstance(body, dict):
        raise WarmError(f"a warm request is a JSON object {{\"users\": [...]}}, got {type(body).__name__}")
    extra = sorted(str(k)[:40] for k in body if k not in REQUEST_KEYS)
    if extra:
        raise WarmError(f"a warm request takes only 'users' (and 'dry_run'), not {extra}: each student's server "
                        "starts with the course's default profile, which no request can change")
    users = body.get("users")
    if users is not None and (not isinstance(users, list) or not all(isinstance(u, str) for u in users)):
        raise WarmError("'users' must be a list of names, e.g. {\"users\": [\"ann\", \"ben\"]}")
    if users is not None and len(users) > 10_000:
        raise WarmError(f"'users' lists {len(users)} names; a class has fewer")
    dry = body.get("dry_run", False)
    if not isinstance(dry, bool):
        raise WarmError("'dry_run' must be true or false")
    return (list(dict.fromkeys(users)) if users is not None else None), dry


def plan(students: Iterable[Mapping], asked: list[str] | None) -> tuple[list[str], list[WarmResult]]:
    """(names to start, results for those left alone) from the course's students' hub models (`course_students`)
    and the names asked for (None: all of them). WarmError naming anyone asked for who is not a course student."""
    by_name = {s["name"]: s for s in students}
    if asked is not None:
        strangers = [n for n in asked if n not in by_name]
        if strangers:
            shown = ", ".join(repr(n[:40]) for n in strangers[:10]) + (" ..." if len(strangers) > 10 else "")
            raise WarmError(f"not students of this course (on the class list and not staff): {shown}; warm starts "
                            "course students' servers only")
    names = asked if asked is not None else sorted(by_name)
    start, left = [], []
    for name in names:
        server = (by_name[name].get("servers") or {}).get("")
        if server and server.get("ready"):
            left.append(WarmResult(name, "already running"))
        elif server and server.get("pending"):
            left.append(WarmResult(name, "already starting", str(server.get("pending"))))
        else:
            start.append(name)
    return start, left


def start_one(api_url: str, token: str, name: str, options: Mapping, timeout: float = 60) -> WarmResult:
    """Ask the hub (REST API at `api_url`, with `token`) to start `name`'s default server with `options`."""
    import requests
    from urllib.parse import quote
    try:
        r = requests.post(f"{api_url.rstrip('/')}/users/{quote(name)}/server", json=dict(options),
                          headers={"Authorization": f"token {token}"}, timeout=timeout)
    except requests.RequestException as e:
        return WarmResult(name, "failed", f"the hub did not answer: {e}"[:500])
    if r.status_code == 201:
        return WarmResult(name, "started")
    if r.status_code == 202:
        return WarmResult(name, "starting")
    message = _message(r)
    if r.status_code == 400 and "already running" in message:
        return WarmResult(name, "already running")
    if r.status_code == 400 and "is pending" in message:
        return WarmResult(name, "already starting", message)
    return WarmResult(name, "failed", f"{r.status_code}: {message}"[:1000])


def _message(r) -> str:
    try:
        return str(r.json().get("message") or r.text)
    except ValueError:
        return r.text.strip()


def start_servers(api_url: str, token: str, names: list[str], options: Mapping,
                  parallel: int = MAX_PARALLEL) -> list[WarmResult]:
    """Start each of `names`' servers, several at once; a failure is that student's result, never the others'."""
    if not names:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(names)))) as pool:
        return list(pool.map(lambda n: start_one(api_url, token, n, options), names))


def warm(cfg: Mapping, students: list[Mapping], api_url: str, token: str, body: object) -> dict:
    """The dashboard's warm action: check the request, plan, start (unless a dry run); JSON-ready results."""
    asked, dry = check_request(body)
    names, left = plan(students, asked)
    options = warm_options(cfg)
    results = [WarmResult(n, "would start") for n in names] if dry else start_servers(api_url, token, names, options)
    results = sorted([*results, *left], key=lambda r: r.name)
    return {"options": options, "dry_run": dry, "results": [asdict(r) for r in results],
            "failed": sum(r.outcome == "failed" for r in results)}


# -- the command's side: wait for --at, call the dashboard -----------------------------------------------------------

def parse_at(text: str, now: datetime | None = None) -> datetime:
    """When to warm: 'HH:MM' (today, local time) or an ISO 8601 date and time; WarmError if it is not one, or past."""
    now = now or datetime.now().astimezone()
    try:
        if len(text) <= 5 and ":" in text:
            hours, minutes = (int(x) for x in text.split(":"))
            when = now.replace(hour=hours, minute=minutes, second=0, microsecond=0)
        else:
            when = datetime.fromisoformat(text)
            when = when if when.tzinfo else when.astimezone()
    except ValueError:
        raise WarmError(f"--at {text!r} is not a time: give HH:MM (today) or e.g. 2026-12-01T08:50") from None
    if when < now - timedelta(seconds=1):
        raise WarmError(f"--at {text!r} is {when:%Y-%m-%d %H:%M}, already past; give a later time, or leave --at "
                        "out to warm now")
    return when


def wait_until(when: datetime, sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], datetime] | None = None, say: Callable[[str], None] = print) -> None:
    """Sleep until `when`, saying so once (Ctrl-C ends the wait; nothing was started yet)."""
    clock = clock or (lambda: datetime.now().astimezone())
    left = (when - clock()).total_seconds()
    if left > 0:
        say(f"waiting until {when:%Y-%m-%d %H:%M:%S} ({left / 60:.0f} min) to warm the class; Ctrl-C cancels")
    while (left := (when - clock()).total_seconds()) > 0:
        sleep(min(left, 60))


def dashboard_url(cfg: Mapping) -> str:
    """The dashboard's address through the hub's proxy, from the settings."""
    hub = cfg["hub"]
    host = "127.0.0.1" if hub["ip"] in ("0.0.0.0", "") else hub["ip"]
    return f"http://{host}:{hub['port']}{hub['base_url'].rstrip('/')}/services/dashboard/"


def request_warm(url: str, token: str, users: list[str] | None, dry_run: bool = False, timeout: float = 600) -> dict:
    """POST the warm request to the dashboard at `url` with an instructor's `token`; its JSON answer, or WarmError
    saying why it was refused."""
    import requests
    body: dict = {"dry_run": dry_run}
    if users is not None:
        body["users"] = users
    try:
        r = requests.post(url.rstrip("/") + "/api/warm", json=body, headers={"Authorization": f"token {token}"},
                          timeout=timeout, allow_redirects=False)
    except requests.RequestException as e:
        raise WarmError(f"the dashboard at {url} did not answer ({e}); is the hub running (scalelab hub)?") from None
    if r.status_code == 200:
        return r.json()
    why = {403: "the token's owner is not one of the course's instructors (hub.admin_users, dashboard.instructors)",
           302: "the token was not accepted: create one on the hub's Token page (/hub/token) as an instructor"}
    raise WarmError(f"the dashboard refused the warm request ({r.status_code} {r.reason}): "
                    f"{why.get(r.status_code, _message(r)[:500])}")


def follow(url: str, token: str, answer: dict, timeout: float, every: float = 3.0,
           sleep: Callable[[float], None] = time.sleep) -> dict:
    """Wait (up to `timeout` s) for the servers warm left starting, reading the dashboard's `api/class`; each one's
    result becomes "ready", or "failed" when its server stopped before it was ready (its job ended, e.g.), or stays
    "starting". Returns `answer` updated."""
    import requests
    waiting = {r["name"]: r for r in answer["results"] if r["outcome"] in ("starting", "started")}
    deadline = time.monotonic() + timeout
    while waiting:
        r = requests.get(url.rstrip("/") + "/api/class", headers={"Authorization": f"token {token}"}, timeout=60)
        r.raise_for_status()
        states = {s["name"]: s["server"] for s in r.json()["students"]}
        for name in list(waiting):
            if states.get(name) == "ready":
                waiting.pop(name)["outcome"] = "ready"
            elif states.get(name, "stopped") == "stopped":
                result = waiting.pop(name)
                result.update(outcome="failed", detail="the server stopped before it was ready: the student's "
                                                       "spawn page and the hub's log say why")
        if not waiting or time.monotonic() > deadline:
            break
        sleep(every)
    answer["failed"] = sum(r["outcome"] == "failed" for r in answer["results"])
    return answer


def format_results(answer: Mapping) -> str:
    """One line per student, then a count."""
    lines = [f"{r['name']:<24} {r['outcome']}{': ' + r['detail'] if r.get('detail') else ''}"
             for r in answer["results"]]
    opts = json.dumps(answer.get("options", {}))
    lines.append(f"{len(answer['results'])} students, {answer.get('failed', 0)} failed (options {opts})")
    return "\n".join(lines)
