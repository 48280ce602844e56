"""The capstone's class challenge on the dashboard: its leaderboard, and the instructors' injected failures.

    <hub>/services/dashboard/leaderboard       the board of <dashboard.grades>/<capstone.lab> (grade.leaderboard)
    <hub>/services/dashboard/api/leaderboard   the same, as JSON
    <hub>/services/dashboard/api/inject        POST, instructors only: a kill or a preemption for every student's
                                               running capstone runs (`scalelab.run.inject.issue` on
                                               capstone.inject_file; the board's form, or JSON {"kind": "kill"})

Who sees what. Instructors see every graded row under real names; TAs the course's students' rows (`course_students`,
as on the rest of the dashboard). With `capstone.public` a signed-in course student sees the course's rows too, each
under a pseudonym (`grade.leaderboard.pseudonym`: an HMAC of the name with the course's secret), their own marked
"you"; the reason a row is unranked is shown on their own row only (it may describe a classmate's submission), and
no grading time. They reach nothing else of the service: the dashboard's gate lets a student through to a handler
only where the handler says so (`for_students`), and only to read. Without `capstone.public` the hub gives students
no scope on the service at all (`hub.config.board_role`), so they meet the hub's 403.

The secret (capstone.pseudonym_key_file, else <hub.state_dir>/capstone_pseudonym_key) is created 0600 at first use
and refused when others may read it or it is a link: whoever can read it can name every pseudonym. What this does not
protect: a pseudonym is stable for the course (the site's board after the deadline uses the same one), so a student
who learns a classmate's result (a time told in the corridor) can find that classmate's row and follow it.

Every value on the pages is escaped: student names, choices and reasons come from students' submissions.
"""
from __future__ import annotations

import html
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Mapping

from ..course.site import leaderboard_table
from ..grade.leaderboard import pseudonym, standings
from .settings import SettingsError

KEY_FILE = "capstone_pseudonym_key"
"""The secret's file in hub.state_dir when capstone.pseudonym_key_file is ""."""
KEY_BYTES = 32


def key_path(cfg: Mapping) -> Path:
    """Where the pseudonyms' secret is: capstone.pseudonym_key_file, else <hub.state_dir>/capstone_pseudonym_key."""
    return Path(cfg["capstone"]["pseudonym_key_file"] or Path(cfg["hub"]["state_dir"]) / KEY_FILE)


def pseudonym_key(path: str | os.PathLike) -> bytes:
    """The secret in `path`, created (random, mode 0600, never through a link) when missing. SettingsError for a link,
    a file that is not a regular one, one others may read, or an empty one: each says the fix."""
    path = Path(path)
    if not os.path.lexists(path):  # written whole beside it, then linked in: a reader meanwhile never sees half
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")  # 0600
        except OSError as e:
            raise SettingsError(f"capstone.pseudonym_key_file: cannot create {path} ({e.strerror}); give an "
                                "existing key file, or a folder the hub's account may write") from None
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(os.urandom(KEY_BYTES).hex() + "\n")
            os.link(tmp, path)
        except FileExistsError:
            pass  # another request made it first: theirs is the key
        finally:
            os.unlink(tmp)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise SettingsError(f"capstone.pseudonym_key_file: cannot open {path} ({e.strerror}; a link is refused): give "
                            "a regular file of the hub's account, mode 0600") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SettingsError(f"capstone.pseudonym_key_file: {path} is not a regular file; give one, mode 0600")
        if info.st_mode & 0o077:
            raise SettingsError(f"capstone.pseudonym_key_file: {path} has mode {info.st_mode & 0o777:o}: whoever can "
                                f"read it can name every pseudonym on the board; chmod 600 {path}")
        key = f.read(4096).strip()
    if len(key) < 16:
        raise SettingsError(f"capstone.pseudonym_key_file: {path} holds {len(key)} bytes; a secret needs 16 or more "
                            f"(delete the file and a new one is made)")
    return key


def public_rows(rows: list[dict], key: bytes, viewer: str = "") -> list[dict]:
    """Board rows as students may see them: pseudonyms for names, `viewer`'s own row marked "you" (with its reason
    when unranked: others' reasons are theirs), no grading time."""
    out = []
    for r in rows:
        own = bool(viewer) and r["student"] == viewer
        why = r["why"] if own else ""
        out.append({**{k: v for k, v in r.items() if k not in ("graded_at", "why")},
                    "student": pseudonym(r["student"], key),
                    "you": own, "why": why or ("" if r["ranked"] else "not ranked")})
    return out


def leaderboard(cfg: Mapping, role: str, viewer: str = "", students: set[str] | None = None,
                key: bytes | None = None) -> dict:
    """The board `viewer` may see: `role` "instructor" (every row), "ta" (the rows of `students`) or "student" (the
    rows of `students`, pseudonymised with `key`)."""
    grades, lab = cfg["dashboard"]["grades"], cfg["capstone"]["lab"]
    folder = Path(grades) / lab if grades else None
    rows = standings(folder) if folder and (folder / "results").is_dir() else []
    if role != "instructor":
        rows = [r for r in rows if r["student"] in (students or set())]
    if role == "student":
        rows = public_rows(rows, key or b"", viewer)
    note = ("No grades folder is set (dashboard.grades): nothing is graded yet." if folder is None else
            f"No graded results of {lab} yet." if not rows else "")
    return {"lab": lab, "view": role, "rows": rows, "note": note, "public": bool(cfg["capstone"]["public"]),
            "generated_at": time.strftime("%Y-%m-%d %H:%M:%S")}


_STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#222}table{border-collapse:collapse}
td,th{border-bottom:1px solid #ddd;padding:.3rem .5rem;text-align:left}tr.you{background:#fff6d8}
tr.unranked{color:#777}form{margin:1rem 0;padding:.6rem;border:1px solid #e0b4b4;border-radius:6px}"""


def render_board(board: dict, inject_form: str = "") -> str:
    """The leaderboard page; `inject_form`: the page's XSRF field, given for instructors only (the inject form)."""
    e = html.escape
    who = {"student": "Names are pseudonyms; your own row is marked <strong>you</strong>.",
           "ta": "Teaching assistant's view: the course's students only, read-only."}.get(board["view"], "")
    back = "" if board["view"] == "student" else "<p><a href='./'>Back to the dashboard</a></p>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Leaderboard: {e(board['lab'])}</title>"
            f"<style>{_STYLE}</style></head><body><h1>Leaderboard: {e(board['lab'])}</h1>"
            f"<p>Time to the target accuracy on the held-out set, as the grader measured it, within the rank-seconds "
            f"budget. As of {e(board['generated_at'])}. {who}</p>"
            + (f"<p id='note'>{e(board['note'])}</p>" if board["note"] else "")
            + _inject_form(inject_form) + leaderboard_table(board["rows"]) + back + "</body></html>")


def _inject_form(xsrf_field: str) -> str:
    if not xsrf_field:
        return ""
    return ("<form id='inject' method='post' action='api/inject'>" + xsrf_field +
            "<strong>Inject a failure</strong> into every student's running capstone runs: "
            "<label><input type='radio' name='kind' value='kill' checked> kill one rank</label> "
            "<label><input type='radio' name='kind' value='preempt'> preempt (every rank checkpoints, stops)</label> "
            "<button type='submit'>Inject</button> <small>Runs started after this, or more than 10 minutes later, "
            "are not touched; recovery time counts on the board.</small></form>")


def render_issued(record: dict, path: str) -> str:
    """The page an instructor sees after injecting: what was written, where, and until when."""
    e = html.escape
    until = time.strftime("%H:%M:%S", time.localtime(record["expires_at"]))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Failure injected</title>"
            f"<style>{_STYLE}</style></head><body><h1>Failure injected</h1><p id='issued'>{e(record['kind'])} "
            f"(id {e(record['id'])}) for the runs of {e(record['lab'] or 'every lab')}, by {e(record['by'])}, in "
            f"force until {until}, written to {e(path)}.</p><p><a href='../leaderboard'>Back to the leaderboard</a>"
            "</p></body></html>")


def handlers(Base, cfg: Mapping, course_students) -> list[tuple[str, type]]:
    """The board's routes (relative to the service prefix) on the dashboard's `Base` handler (its role gate, its
    `users()`); `course_students(cfg, users)` is the dashboard's class filter."""
    import asyncio
    import json

    from tornado import web

    from ..errors import SpecError
    from ..run.inject import issue

    public = bool(cfg["capstone"]["public"])

    class Board(Base):
        for_students = public  # the one page (and its JSON) a student may reach, and only when public

        async def board(self) -> dict:
            name = self.current_user.get("name", "")
            students = None
            if self.role != "instructor":
                students = {u.get("name") for u in course_students(cfg, await self.users())}
            key = await asyncio.to_thread(pseudonym_key, key_path(cfg)) if self.role == "student" else None
            return await asyncio.to_thread(leaderboard, cfg, self.role, name, students, key)

    class Page(Board):
        @web.authenticated
        async def get(self):
            self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
            form = self.xsrf_form_html() if self.role == "instructor" else ""
            self.finish(render_board(await self.board(), form))

    class Api(Board):
        @web.authenticated
        async def get(self):
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(await self.board()))

    class Inject(Base):
        """POST api/inject: an instructor injects a failure (the board's form, or JSON {"kind": ...})."""

        @web.authenticated
        async def post(self):
            if self.role != "instructor":  # the gate already stopped TAs and students; never reached by them
                raise web.HTTPError(403, "injecting a failure is for the course's instructors")
            form = not self.request.headers.get("Content-Type", "").startswith("application/json")
            try:
                kind = self.get_body_argument("kind", "") if form else json.loads(self.request.body or b"{}")["kind"]
            except (ValueError, KeyError, TypeError):
                raise web.HTTPError(400, 'the body must be JSON {"kind": "kill"} or {"kind": "preempt"}') from None
            path, by = cfg["capstone"]["inject_file"], self.current_user.get("name", "")
            try:
                record = await asyncio.to_thread(issue, path, kind, by=by, lab=cfg["capstone"]["lab"])
            except SpecError as e:
                raise web.HTTPError(400, str(e), reason="Bad injection") from None
            except OSError as e:
                raise web.HTTPError(500, f"could not write the spool file {path} ({e.strerror}): the dashboard "
                                         "runs as the hub's account, which must own its folder") from None
            print(f"dashboard: {by} injected {record['kind']} (id {record['id']}) into {path}", flush=True)
            if form:
                self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
                self.finish(render_issued(record, path))
            else:
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps(record))

        def write_error(self, status_code, **kwargs):
            exc = kwargs.get("exc_info", (None, None))[1]  # the reason, a missing _xsrf field's included
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"status": status_code, "message": getattr(exc, "log_message", None)
                                    or self._reason}))

    return [("leaderboard", Page), ("api/leaderboard", Api), ("api/inject", Inject)]


__all__ = ["key_path", "pseudonym_key", "public_rows", "leaderboard", "render_board", "render_issued", "handlers"]
