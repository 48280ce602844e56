"""`scalelab course collect|return|gradebook|warm|inject`: the instructor's week around `scalelab grade`, the lecture.

    scalelab course collect 01_single_device --deadline 2026-12-01T17:00     # from every student's home
    scalelab grade 01_single_device build/collected/01_single_device/*/ -j 2
    scalelab course return 01_single_device                                  # feedback.html into each home
    scalelab course gradebook                                                # build/grades/course_gradebook.csv
    scalelab course gradebook --format canvas --roster lms_roster.csv        # Canvas's grade import CSV
    scalelab course gradebook --format moodle --roster lms_roster.csv        # Moodle's grade import CSV
    scalelab course warm --at 08:50                                          # start the class's servers then
    sudo scalelab course inject kill --lab 12_capstone                       # the capstone race: a rank dies

Students and their homes come from the hub's settings (`--config`, default hub_config/course.yaml): the class
list (auth.allowed_users and the roster), and each student's home as the hub makes it (the Unix account's home
with servers.run_as student-accounts, else servers.home). `--users` and `--homes` override them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..course.lab import GradingError


def add_cli(subparsers) -> None:
    """Add `course` (collect, return, gradebook, warm, inject) to the `scalelab` command."""
    p = subparsers.add_parser("course", help="collect labs from students' homes, return feedback, course gradebook",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="course_command", metavar="ACTION", required=True)

    def who(q):
        q.add_argument("--config", help="the hub's course settings (default hub_config/course.yaml)")
        q.add_argument("--users", help="students, comma-separated (default: the hub's class list)")
        q.add_argument("--homes", metavar="TEMPLATE",
                       help="each student's home, with {username} (default: as the hub makes them)")

    c = sub.add_parser("collect", help="copy a lab from every student's home into a folder to grade")
    c.add_argument("lab", help="lab folder (or a lab's name under labs/)")
    who(c)
    c.add_argument("--deadline", help="ISO 8601 date or time; notebooks modified after it are flagged late")
    c.add_argument("--out", help="where the copies go (default build/collected/<lab>)")
    c.set_defaults(func=collect_command)

    r = sub.add_parser("return", help="write each student's feedback page into their copy of the lab")
    r.add_argument("lab", help="lab folder (or a lab's name under labs/)")
    who(r)
    r.add_argument("--grades", help="the lab's report folder (default build/grades/<lab>)")
    r.set_defaults(func=return_command)

    g = sub.add_parser("gradebook", help="one CSV for the course: a row per student, a column per lab; or the "
                                         "file Canvas or Moodle imports")
    g.add_argument("--grades", default="build/grades", help="folder of the labs' report folders (default %(default)s)")
    g.add_argument("--collected", default="build/collected",
                   help="folder of the labs' collections, for the late flags (default %(default)s)")
    g.add_argument("--format", default="csv", choices=("csv", "canvas", "moodle"),
                   help="csv: scalelab's own columns (default); canvas / moodle: that LMS's grade import CSV")
    g.add_argument("--roster", help="canvas/moodle: CSV mapping each hub login (column 'login') to the student's "
                                    "LMS identity (Canvas: Student, ID, SIS User ID, SIS Login ID, Section; "
                                    "Moodle: email, username or idnumber)")
    g.add_argument("--login-column", default="login",
                   help="the roster's column of hub login names (default %(default)s)")
    g.add_argument("--moodle-id", default="email", choices=("email", "username", "idnumber"),
                   help="moodle: the user field the import maps students by (default %(default)s)")
    g.add_argument("--canvas-assignment", action="append", default=[], metavar="LAB=ID",
                   help="canvas: the Canvas assignment a lab's grades go to (the id in its address); repeat per "
                        "lab; a lab without one becomes a new assignment on import")
    g.add_argument("--allow-missing", action="store_true",
                   help="canvas/moodle: leave graded students who are not in the roster out (listed) instead of "
                        "stopping")
    g.add_argument("--out", help="the CSV (default <grades>/course_gradebook.csv, or course_gradebook_<format>.csv)")
    g.set_defaults(func=gradebook_command)

    w = sub.add_parser("warm", help="start every listed student's server (default profile, class reservation) "
                                    "before the lecture, through the class dashboard",
                       description="Start every listed student's server with the course's default profile, as the "
                                   "dashboard's button does; servers already running are left alone. Needs an "
                                   "instructor's hub token (the hub's Token page): $JUPYTERHUB_API_TOKEN or "
                                   "--token-file.")
    w.add_argument("--config", help="the hub's course settings (default hub_config/course.yaml): the hub's address")
    w.add_argument("--users", help="students, comma-separated (default: every student on the class list)")
    w.add_argument("--at", metavar="TIME", help="wait here until TIME (HH:MM today, or 2026-12-01T08:50), then warm; "
                                                "the token and the list are checked before the wait")
    w.add_argument("--hub", metavar="URL", help="the dashboard's address (default: from the settings, "
                                                "http://<hub.ip>:<hub.port>/services/dashboard/)")
    w.add_argument("--token-file", help="file holding an instructor's hub API token (default $JUPYTERHUB_API_TOKEN)")
    w.add_argument("--dry-run", action="store_true", help="say whose servers would start; start none")
    w.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                   help="then wait up to SECONDS for the servers to be ready, and report each as ready or failed")
    w.set_defaults(func=warm_command)

    i = sub.add_parser("inject", help="the capstone's live challenge: kill or preempt the students' running runs",
                       description="Write a kill or a preemption to the spool file every engine run watches "
                                   "($SCALELAB_INJECT_FILE): each run that started before now and matches --lab acts "
                                   "on it once, within the window. Run it as root: the file must be root's.")
    i.add_argument("kind", choices=("kill", "preempt"),
                   help="kill: SIGKILL to one rank of each run; preempt: SIGTERM to every rank (an emergency "
                        "checkpoint where checkpoint.on_signal is set)")
    i.add_argument("--file", help="the spool file (default: the hub setting capstone.inject_file, else "
                                  "/var/lib/scalelab/inject.json)")
    i.add_argument("--config", help="the hub's course settings (default hub_config/course.yaml): capstone.inject_file")
    i.add_argument("--lab", default="", metavar="NAME",
                   help="only runs with a folder NAME in their output path (default: every run)")
    i.add_argument("--rank", type=int, default=-1, help="kill: the rank to kill (default -1: each run's last rank)")
    i.add_argument("--window-s", type=float, default=600.0, metavar="S",
                   help="runs act on it for S seconds from now (default %(default)g)")
    i.set_defaults(func=inject_command)


def _lab(arg: str) -> Path:
    from ..course.release import resolve_lab
    return resolve_lab(arg)


def student_homes(args) -> tuple[dict[str, Path], str]:
    """{student: home} and the labs folder name inside homes, from --users/--homes or the hub's settings."""
    from ..hub.settings import load_settings, student_home
    cfg = load_settings(args.config)
    users = [u.strip() for u in args.users.split(",") if u.strip()] if args.users else cfg["auth"]["allowed_users"]
    if not users:
        raise GradingError("no students: the hub's settings list none (auth.allowed_users, auth.roster); pass "
                           "--users a,b,c")
    homes = {}
    for user in users:
        if args.homes:
            if "{username}" not in args.homes:
                raise GradingError(f"--homes {args.homes!r} must contain {{username}}, e.g. /home/{{username}}")
            homes[user] = Path(args.homes.format(username=user))
        else:  # no account yet (never signed in): reported missing
            homes[user] = student_home(cfg, user) or Path("/nonexistent") / user
    return homes, cfg["labs"]["dest"]


def collect_command(args) -> int:
    """Collect one lab; prints a line per student and where the copies are."""
    from ..course.collect import collect, parse_deadline
    lab = _lab(args.lab)
    homes, dest = student_homes(args)
    out = Path(args.out or Path("build") / "collected" / lab.name).resolve()
    deadline = parse_deadline(args.deadline) if args.deadline else None
    found = collect(lab, homes, out, labs_dest=dest, deadline=deadline)
    for c in found:
        flag = " LATE" if c.late else ""
        print(f"{c.student:<20} {c.status:<9}{flag} {c.modified or ''} {c.note}".rstrip())
    got = [c for c in found if c.status in ("collected", "kept")]
    print(f"collected {len(got)} of {len(found)} into {out}; grade them with:\n"
          f"  scalelab grade {lab} {out}/*/ -j 2 --out build/grades/{lab.name}", file=sys.stderr)
    return 0


def return_command(args) -> int:
    """Return the feedback pages of one graded lab."""
    from ..course.collect import return_feedback
    from ..grade.report import file_key
    lab = _lab(args.lab)
    homes, dest = student_homes(args)
    grades = Path(args.grades or Path("build") / "grades" / lab.name)
    if not (grades / "feedback").is_dir():
        raise GradingError(f"{grades}: no feedback/ folder; grade the lab first (scalelab grade ... --out {grades})")
    pages = {s: grades / "feedback" / f"{file_key(s)}.html" for s in homes}
    done = return_feedback(lab.name, homes, pages, labs_dest=dest)
    for r in done:
        print(f"{r.student:<20} {r.path or 'not returned: ' + r.note}")
    return 0


def gradebook_command(args) -> int:
    """Write the course gradebook from every graded lab, in scalelab's columns or an LMS's import format."""
    if args.format != "csv":
        return _lms_gradebook(args)
    from ..grade.report import course_gradebook
    late: dict[str, set[str]] = {}
    for manifest in Path(args.collected).glob("*/collected.json"):
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            late[manifest.parent.name] = {s["student"] for s in data.get("students", []) if s.get("late")}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    path = course_gradebook(Path(args.grades), Path(args.out) if args.out else None, late)
    print(path)
    return 0


def _lms_gradebook(args) -> int:
    from ..grade.report import lms_gradebook
    if not args.roster:
        raise GradingError(f"--format {args.format} needs --roster FILE: a CSV with a 'login' column (each "
                           "student's hub login name) and their LMS identity (see `scalelab course gradebook -h`)")
    ids = {}
    for item in args.canvas_assignment:
        lab, sep, number = item.partition("=")
        if not sep or not lab or not number:
            raise GradingError(f"--canvas-assignment {item!r}: give LAB=ID, e.g. 01_single_device=1234")
        ids[lab] = number
    path, export = lms_gradebook(Path(args.grades), args.format, Path(args.roster),
                                 Path(args.out) if args.out else None, login_column=args.login_column,
                                 moodle_id=args.moodle_id, canvas_ids=ids, allow_missing=args.allow_missing)
    if export.not_in_roster:
        print(f"left out, not in the roster: {', '.join(export.not_in_roster)}", file=sys.stderr)
    for line in export.not_exported:
        print(f"blank cell: {line}", file=sys.stderr)
    print(path)
    return 0


def warm_command(args) -> int:
    """Check the request at once (a dry run), wait for --at, warm; one line per student; exit 1 if any failed."""
    import os
    from ..hub.settings import load_settings
    from ..hub.warm import (WarmError, dashboard_url, follow, format_results, parse_at, request_warm,
                            wait_until)
    when = parse_at(args.at) if args.at else None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise WarmError(f"--token-file {args.token_file}: {e.strerror}; give the file holding your hub "
                            "token") from None
    else:
        token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not token:
        raise WarmError("no hub token: create one on the hub's Token page (/hub/token) as an instructor and pass it "
                        "in $JUPYTERHUB_API_TOKEN or --token-file FILE")
    url = args.hub or dashboard_url(load_settings(args.config))
    users = [u.strip() for u in args.users.split(",") if u.strip()] if args.users else None
    plan = request_warm(url, token, users, dry_run=True)  # a wrong token or name shows now, not at the lecture
    if args.dry_run:
        print(format_results(plan))
        return 0
    if when is not None:
        print(f"{sum(r['outcome'] == 'would start' for r in plan['results'])} servers to start", file=sys.stderr)
        wait_until(when, say=lambda m: print(m, file=sys.stderr))
    answer = request_warm(url, token, users)
    if args.wait > 0:
        answer = follow(url, token, answer, args.wait)
    print(format_results(answer))
    return 1 if answer["failed"] else 0


def inject_command(args) -> int:
    """Issue one instructor injection (run/inject.py) and print what was issued."""
    import getpass
    import os
    import time
    from ..run.inject import issue
    path = args.file
    if not path:
        from ..hub.settings import load_settings
        path = (load_settings(args.config).get("capstone") or {}).get("inject_file") or "/var/lib/scalelab/inject.json"
    record = issue(path, args.kind, by=os.environ.get("SUDO_USER") or getpass.getuser(), lab=args.lab,
                   rank=args.rank, window_s=args.window_s)
    target = "every rank" if args.kind == "preempt" else ("the last rank" if args.rank == -1 else f"rank {args.rank}")
    until = time.strftime("%H:%M:%S %Z", time.localtime(record["expires_at"]))
    print(f"issued {record['kind']} {record['id']} in {path}: {target} of every run "
          f"{'under ' + repr(args.lab) + ' ' if args.lab else ''}started before now, until {until}")
    return 0
