"""The class dashboard: a JupyterHub service page for instructors.

    <hub>/services/dashboard/            every student: server (state, node, job), each lab's self-check progress,
                                         grades once collected and graded
    <hub>/services/dashboard/api/class   the same, as JSON
    <hub>/services/dashboard/api/warm    POST, instructors only: start every (or each listed) student's server with
                                         the course's default profile (`scalelab.hub.warm`; the page's button)
    <hub>/services/dashboard/leaderboard the capstone's board, api/leaderboard, api/inject: `scalelab.hub.capstone`

The hub starts it (`python -m scalelab.hub.dashboard`, settings `dashboard:`) and signs people in through OAuth. Only
hub admins and the names in `dashboard.instructors` and `dashboard.tas` hold the scope
`access:services!service=dashboard`; a student gets 403 from the hub before the page runs any code for them, and the
page checks again (with capstone.public students hold the scope too, and the page lets them read the board only).
The service's own token may list users and read their servers, nothing else (`hub.config.DASHBOARD_SCOPES`).

Teaching assistants (`dashboard.tas`) see the course's students (`course_students`: the class list less the staff)
and nothing else: no admin, instructor or other TA, no hub user outside the class list, no admin flag. They may look,
never act: every request of theirs but GET and HEAD gets 403 here, whatever handler it is for (an action added to
this service later included), and the hub itself gives them no scope on other users (they are plain users there).
A name listed both as a TA and as an instructor or admin is treated as the latter.

In Slurm mode each student's row also shows the GPUs their server job holds, their utilisation and memory, and an
idle flag (`scalelab.hub.gpu_usage`: Slurm's own numbers, or "stand-in GPU, not measured", never a made-up one).

Progress is what SelfCheck would show the student: the lab's *public* checks run on the records saved in the
student's copy of the lab (`<home>/<labs.dest>/<lab>/lab.ipynb`) and the evidence of the runs beside it. Homes are
read as untrusted data (no symbolic link followed anywhere below the home, regular files only, size limits), and
results are cached by file size and time, so a page load re-reads only what changed. What one student's home may
cost the page is bounded: a notebook over MAX_NOTEBOOK_BYTES is not read, and one of more than MAX_NOTEBOOK_ITEMS
JSON values (counted in its bytes before parsing: a few MiB of `[[],[],...]` parse into gigabytes of objects) is
not parsed; either shows as "too large" for that student and lab, and every other cell of the page is filled in.
"""
from __future__ import annotations

import asyncio
import html
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from ..course.lab import NOTEBOOK, find_labs
from ..paths import read_beneath
from .capstone import handlers as capstone_handlers
from .gpu_usage import describe as describe_gpu
from .gpu_usage import gpu_rows, start_sampler
from .provision import resolve_source
from .settings import load_settings_from_env, student_home
from .warm import WarmError, warm

SERVICE = "dashboard"
MAX_NOTEBOOK_BYTES = 16 * 2**20
"""Largest saved notebook the dashboard reads (the course's executed labs are under 0.5 MiB with their plots)."""
MAX_NOTEBOOK_ITEMS = 1_000_000
"""Most JSON values ('[', '{', ',' and ':' counted in the bytes, strings' contents included: an over-count) a notebook
may have to be parsed; the labs' hold a few thousand, and a printed list of 100 000 numbers 100 000."""
TOO_LARGE = "too large"
_CACHE: dict[tuple, dict] = {}


# -- what the page shows (plain functions, tested without a hub) -------------------------------------------------

def lab_progress(home: Path, labs_dest: str, lab_dir: Path) -> dict:
    """{"state": "not started"|"in progress"|"done"|"unreadable", "passed", "failed", "missing", "total"} for one
    student's copy of one lab, from its saved records and run evidence (public checks only)."""
    from ..grade.checks import lab_checks, run_checks
    from ..grade.evidence import run_evidence, strip_grader_records
    from ..grade.untrusted import UntrustedFileError, tolerant_records
    rel = Path(labs_dest) / lab_dir.name
    try:
        info = _lstat_beneath(home, rel / NOTEBOOK)
    except OSError:
        return {"state": "not started", "passed": 0, "failed": 0, "missing": 0, "total": 0}
    key = (str(home), str(rel), info.st_size, info.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    checks = lab_checks(lab_dir, include_hidden=False)
    too_large = {"state": TOO_LARGE, "passed": 0, "failed": 0, "missing": 0, "total": len(checks),
                 "bytes": info.st_size}
    if info.st_size > MAX_NOTEBOOK_BYTES:
        _CACHE[key] = too_large
        return too_large
    try:
        data = read_beneath(home, rel / NOTEBOOK, MAX_NOTEBOOK_BYTES)
        if sum(data.count(c) for c in (b"[", b"{", b",", b":")) > MAX_NOTEBOOK_ITEMS:
            _CACHE[key] = too_large
            return too_large
        nb = json.loads(data)
        del data
        records, _ = tolerant_records(nb)
    except (UntrustedFileError, ValueError, RecursionError, TypeError, AttributeError):
        return {"state": "unreadable", "passed": 0, "failed": 0, "missing": 0, "total": len(checks)}
    records, _ = strip_grader_records(records)
    try:
        records.update(run_evidence(home / rel))
    except Exception:  # noqa: BLE001 - a student's event files never break the page
        pass
    results = run_checks(checks, records)
    count = {o: sum(r.outcome == o for r in results) for o in ("pass", "fail", "missing")}
    count["fail"] += sum(r.outcome in ("partial", "error") for r in results)
    state = ("done" if count["pass"] == len(results) else
             "not started" if count["missing"] == len(results) else "in progress")
    out = {"state": state, "passed": count["pass"], "failed": count["fail"], "missing": count["missing"],
           "total": len(results)}
    _CACHE[key] = out
    return out


def _lstat_beneath(home: Path, rel: Path) -> os.stat_result:
    """lstat of home/rel, never through a symbolic link on the way (each folder opened with O_NOFOLLOW from the one
    before, so a link swapped in meanwhile is not followed either); a student's link leads nowhere here."""
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in rel.parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        info = os.stat(rel.parts[-1], dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)
    return info  # a FIFO or folder in the notebook's place: read_beneath refuses it (unreadable)


def grades_for(grades_root: str, labs: list[str], name: str) -> dict[str, Any]:
    """{lab: percent} from `<grades_root>/<lab>/results/<file_key(name)>.json`, for the labs graded so far."""
    if not grades_root:
        return {}
    from ..grade.report import file_key
    found = {}
    for lab in labs:
        path = Path(grades_root) / lab / "results" / f"{file_key(name)}.json"
        try:
            found[lab] = json.loads(path.read_text(encoding="utf-8")).get("percent")
        except (OSError, ValueError, AttributeError):
            continue
    return found


def slurm_jobs(cfg: dict) -> dict[str, dict]:
    """{user name: {"job", "state", "nodes"}} of the hub's single-user jobs in the queue (slurm mode)."""
    if cfg["mode"] != "slurm":
        return {}
    env = {**os.environ, **({"SLURM_CONF": cfg["slurm"]["conf"]} if cfg["slurm"].get("conf") else {})}
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%N|%u"], capture_output=True, text=True, env=env,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    import pwd
    hub_account = pwd.getpwuid(os.geteuid()).pw_name
    own_accounts = cfg["servers"]["run_as"] == "student-accounts"
    jobs = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) != 5 or not parts[1].startswith("jupyter-"):
            continue
        name = parts[1][len("jupyter-"):]
        # a job counts as a student's server only when its owner is who submits servers: the student's own
        # account, or the hub's; anyone may name a job jupyter-<classmate> (`sbatch -J`)
        if parts[4] == (name if own_accounts else hub_account):
            jobs[name] = {"job": parts[0], "state": parts[2].lower(), "nodes": parts[3]}
    return jobs


def viewer_role(cfg: dict, user: dict) -> str | None:
    """"instructor" (a hub admin or in dashboard.instructors), "ta" (in dashboard.tas), or None: not for them."""
    name = user.get("name")
    if user.get("admin") or name in cfg["hub"]["admin_users"] or name in cfg["dashboard"]["instructors"]:
        return "instructor"
    return "ta" if name in cfg["dashboard"]["tas"] else None


def course_students(cfg: dict, users: list[dict]) -> list[dict]:
    """The hub users who are the course's students: on the class list (auth.allowed_users and the roster; anyone
    when the hub lets any name sign in and lists none) and not staff (admin, instructor, TA)."""
    staff = {*cfg["hub"]["admin_users"], *cfg["dashboard"]["instructors"], *cfg["dashboard"]["tas"]}
    listed = set(cfg["auth"]["allowed_users"])
    open_class = not listed and bool(cfg["auth"].get("any_name"))
    return [u for u in users if not u.get("admin") and u.get("name") not in staff
            and (u.get("name") in listed or open_class)]


def class_snapshot(cfg: dict, users: list[dict], role: str = "instructor") -> dict:
    """Everything the page shows, from the settings and the hub's user models (`GET /hub/api/users`); for a TA
    (`role` "ta") the course's students only (`course_students`), without admin flags."""
    if role == "ta":
        users = [{**u, "admin": False} for u in course_students(cfg, users)]
    source = resolve_source(cfg["labs"]["source"])
    labs = find_labs(source) if source else []
    jobs = slurm_jobs(cfg)
    gpus = gpu_rows(cfg, jobs)  # every server job, so a TA's narrower view does not reset the others' idle times
    rows = []
    for user in sorted(users, key=lambda u: u.get("name", "")):
        name = user.get("name", "")
        server = (user.get("servers") or {}).get("") or {}
        where = ""
        if server.get("url"):  # a server's url is a path on today's hubs: the node is then its job's
            from urllib.parse import urlparse
            where = urlparse(server["url"]).hostname or ""
        where = where or (jobs.get(name, {}).get("nodes", "") if server else "")
        state = "ready" if server.get("ready") else (server.get("pending") or "stopped") if server else "stopped"
        home = student_home(cfg, name)
        progress = {lab.name: lab_progress(home, cfg["labs"]["dest"], lab) for lab in labs} if home else {}
        rows.append({"name": name, "admin": bool(user.get("admin")), "server": state, "node": where,
                     "job": jobs.get(name, {}).get("job", ""), "last_activity": user.get("last_activity"),
                     "gpu": gpus.get(name),
                     "progress": progress, "grades": grades_for(cfg["dashboard"]["grades"], [x.name for x in labs],
                                                                 name)})
    return {"course": cfg["course"]["name"], "labs": [lab.name for lab in labs], "students": rows,
            "generated_at": time.strftime("%Y-%m-%d %H:%M:%S"), "view": role}


_STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#222}table{border-collapse:collapse}
td,th{border-bottom:1px solid #ddd;padding:.3rem .5rem;text-align:left}.done{color:#176b2c;font-weight:600}
.in.progress,.in-progress{color:#8a5a00}.not-started{color:#888}.unreadable,.too-large{color:#a11}
.ready{color:#176b2c}"""


def render_page(snap: dict, warm_form: str = "") -> str:
    """The dashboard as one HTML page (every value escaped: names and states come from users). `warm_form`: the
    page's own XSRF field, given for instructors only: the warm button is drawn with it."""
    e = html.escape
    head = "".join(f"<th>{e(lab)}</th>" for lab in snap["labs"])
    rows = []
    for s in snap["students"]:
        cells = []
        for lab in snap["labs"]:
            p = s["progress"].get(lab, {})
            grade = s["grades"].get(lab)
            text = (f"{p.get('passed', 0)}/{p.get('total', 0)} checks" if p.get("total") and
                    p.get("state") not in (TOO_LARGE, "unreadable") else e(p.get("state", "")))
            if p.get("state") == TOO_LARGE:
                text += f" ({p.get('bytes', 0) / 2**20:.0f} MiB: not read)"
            if grade is not None:
                text += f" · graded {grade:g} %"
            cls = p.get("state", "").replace(" ", "-")
            cells.append(f'<td class="{e(cls)}" title="{e(p.get("state", ""))}">{text}</td>')
        server = e(s["server"]) + (f" on {e(s['node'])}" if s["node"] else "") + (f", job {e(s['job'])}"
                                                                                  if s["job"] else "")
        gpu = s.get("gpu")
        idle = " idle-gpu" if gpu and gpu.get("idle") else ""
        rows.append(f'<tr><td>{e(s["name"])}{" (admin)" if s["admin"] else ""}</td>'
                    f'<td class="{e(s["server"])}">{server}</td><td class="gpu{idle}">{e(describe_gpu(gpu))}</td>'
                    f'{"".join(cells)}</tr>')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Class dashboard: {e(snap['course'])}</title>"
            f"<style>{_STYLE}</style></head><body><h1>Class dashboard</h1><p>{e(snap['course'])}: "
            f"{len(snap['students'])} students, as of {e(snap['generated_at'])}. Progress is the lab's public "
            "self-checks on each student's saved notebook.</p>"
            + ("<p id='view'>Teaching assistant's view: the course's students only, read-only.</p>"
               if snap.get("view") == "ta" else "") + "<p><a href='leaderboard'>The capstone's leaderboard</a></p>"
            + _warm_button(warm_form) +
            f"<table id='class'><thead><tr><th>student</th><th>server</th><th>GPUs</th>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></body></html>")


def _warm_button(xsrf_field: str) -> str:
    if not xsrf_field:
        return ""
    return ("<form id='warm' method='post' action='api/warm'>" + xsrf_field +
            "<button type='submit'>Start every student's server</button> <small>with the course's default profile"
            ", in the class reservation; running servers are left alone. Unopened servers are stopped by the idle "
            "culler.</small></form>")


def render_warm(answer: dict) -> str:
    """The page an instructor sees after pressing the warm button: one line per student."""
    e = html.escape
    rows = "".join(f"<tr><td>{e(r['name'])}</td><td class='{e(r['outcome'].replace(' ', '-'))}'>{e(r['outcome'])}"
                   f"</td><td>{e(r.get('detail', ''))}</td></tr>" for r in answer["results"])
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Warm the class</title>"
            f"<style>{_STYLE}</style></head><body><h1>Warm the class</h1><p>{len(answer['results'])} students, "
            f"{answer['failed']} failed.</p><table id='warm-results'><thead><tr><th>student</th><th>server</th>"
            f"<th>why</th></tr></thead><tbody>{rows}</tbody></table><p><a href='../'>Back to the dashboard</a></p>"
            "</body></html>")


# -- the service -----------------------------------------------------------------------------------------------

def make_app(cfg: dict):
    """The tornado application: the page, its JSON, and the OAuth callback, under JUPYTERHUB_SERVICE_PREFIX."""
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
    from jupyterhub.utils import url_path_join
    from tornado import web
    from tornado.httpclient import AsyncHTTPClient

    class Base(HubOAuthenticated, web.RequestHandler):
        role: str | None = None
        for_students = False  # a handler a course student may read (the public capstone board); no other
        _asked = False

        def check_xsrf_cookie(self):
            # tornado checks XSRF before prepare(); learn who asks first, so that a request carrying a hub token
            # (no cookie, so no cross-site forgery) reaches the role gate instead of failing on a missing form field
            if not self._asked:
                self._asked = True
                self.current_user  # noqa: B018 - sets the hub's token-authenticated flag
            return super().check_xsrf_cookie()

        async def users(self) -> list[dict]:
            api = os.environ["JUPYTERHUB_API_URL"].rstrip("/")
            token = os.environ["JUPYTERHUB_API_TOKEN"]
            r = await AsyncHTTPClient().fetch(f"{api}/users", headers={"Authorization": f"token {token}"})
            return json.loads(r.body)

        async def snapshot(self) -> dict:
            return await asyncio.to_thread(class_snapshot, cfg, await self.users(), self.role or "instructor")

        async def prepare(self):
            user = self.current_user
            if user is None and self.request.method in ("GET", "HEAD"):
                return  # @web.authenticated sends them to the hub's sign-in (403 for a signed-in student)
            if user is None:  # an action by someone not signed in, or not allowed in (a student's token)
                raise web.HTTPError(403, "the class dashboard is for the course's instructors")
            self.role = viewer_role(cfg, user)
            if self.role is None and self.for_students and course_students(cfg, [user]):
                self.role = "student"  # the public capstone board, read-only (below), and nothing else
            if self.role is None:
                raise web.HTTPError(403, "the class dashboard is for the course's instructors")
            if self.role in ("ta", "student") and self.request.method not in ("GET", "HEAD"):
                # checked here, before any handler runs: an action added later is closed to TAs and students too
                raise web.HTTPError(403, f"{user.get('name')} is a {self.role}: the dashboard is read-only for them",
                                    reason=f"Forbidden: {'teaching assistants' if self.role == 'ta' else 'students'}"
                                           " may look, not act")

    class Page(Base):
        @web.authenticated
        async def get(self):
            self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
            form = self.xsrf_form_html() if self.role == "instructor" else ""
            self.finish(render_page(await self.snapshot(), form))

    class Api(Base):
        @web.authenticated
        async def get(self):
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(await self.snapshot()))

    class Warm(Base):
        """POST api/warm: an instructor starts the class's servers (JSON {"users": [...]} or the page's button)."""

        @web.authenticated
        async def post(self):
            if self.role != "instructor":  # prepare() already stopped TAs and students; never reached by them
                raise web.HTTPError(403, "warming the class is for the course's instructors")
            button = not self.request.headers.get("Content-Type", "").startswith("application/json")
            try:
                body = None if button else json.loads(self.request.body or b"null")
            except ValueError:
                raise web.HTTPError(400, "the body must be JSON: {\"users\": [\"ann\", ...]} or nothing")
            students = course_students(cfg, await self.users())
            api, token = os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"]
            try:
                answer = await asyncio.to_thread(warm, cfg, students, api, token, body)
            except WarmError as e:
                raise web.HTTPError(400, str(e), reason="Bad warm request") from None
            print(f"dashboard: {self.current_user.get('name')} warmed the class: "
                  f"{[(r['name'], r['outcome']) for r in answer['results']]}", flush=True)
            if button:
                self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
                self.finish(render_warm(answer))
            else:
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps(answer))

        def write_error(self, status_code, **kwargs):
            exc = kwargs.get("exc_info", (None, None))[1]
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"status": status_code, "message": getattr(exc, "log_message", None)
                                    or self._reason}))

    class Missing(Base):
        """Any other path under the service: 404 to readers, and a TA's action there meets the gate (403) first."""

        @web.authenticated
        async def get(self):
            raise web.HTTPError(404)

    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE}/")
    return web.Application([
        (prefix, Page), (url_path_join(prefix, "api/class"), Api), (url_path_join(prefix, "api/warm"), Warm),
        *((url_path_join(prefix, path), handler) for path, handler in capstone_handlers(Base, cfg, course_students)),
        (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
        (url_path_join(prefix, ".*"), Missing),  # last: the routes above win
    ], cookie_secret=os.urandom(32), xsrf_cookies=True)


def main() -> None:
    """Run the service where the hub says (JUPYTERHUB_SERVICE_URL); exits at once on SIGTERM/SIGINT."""
    import signal
    from urllib.parse import urlparse
    from tornado.ioloop import IOLoop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    cfg = load_settings_from_env()
    app = make_app(cfg)
    if cfg["mode"] == "slurm":  # the idle flags rest on a reading every minute, whether anyone looks or not
        start_sampler(cfg, lambda: slurm_jobs(cfg))
    app.listen(url.port, url.hostname)
    IOLoop.current().start()


if __name__ == "__main__":
    main()
