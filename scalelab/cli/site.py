"""`scalelab site build` and `scalelab site serve`: thin commands over `scalelab.course.site`.

    scalelab site build                      # execute (or reuse) every lab, render the pages -> site/_build/html
    scalelab site build --lab 01_single_device --force   # only that lab's page, executed again
    scalelab site serve --port 8008          # look at the built site on http://127.0.0.1:8008/
    scalelab site build --leaderboard /srv/grades/12_capstone   # after the deadline: the capstone's board
"""
from __future__ import annotations

import json
import sys

from ..paths import checkout_root


def add_cli(subparsers) -> None:
    """Add `site` (with `build` and `serve`) to the `scalelab` command."""
    site = subparsers.add_parser("site", help="the course website: build it from the executed labs, or serve it",
                                 description="The course website (Sphinx + myst-nb), built from the executed labs.")
    actions = site.add_subparsers(dest="site_command", metavar="ACTION")
    b = actions.add_parser("build", help="execute each lab (or reuse an up-to-date copy), render its page, build "
                                         "the HTML into site/_build/html",
                           description="Execute each lab's reference notebook with its lab.yaml grading parameters "
                                       "(reusing build/executed/<lab>/ when the lab's files are unchanged), render "
                                       "one page per lab with the solutions hidden, and run sphinx-build.")
    b.add_argument("--lab", action="append", dest="labs", metavar="NAME",
                   help="only this lab's page (a folder name under labs/); repeatable; default: every lab")
    b.add_argument("--labs-root", help="where the labs are (default: the repository's labs/)")
    b.add_argument("--out", help=f"HTML output folder (default: {checkout_root() / 'site' / '_build' / 'html'})")
    b.add_argument("--force", action="store_true", help="execute every lab again, even when a copy is up to date")
    b.add_argument("--json", action="store_true", help="print what was built as JSON")
    b.add_argument("--leaderboard", metavar="GRADED_LAB",
                   help="a graded capstone's folder (`scalelab grade --out`, with results/): add its board as a page, "
                        "every name a pseudonym (run it after the deadline)")
    b.add_argument("--pseudonym-key-file", metavar="FILE",
                   help="the pseudonyms' secret (mode 0600), so that names match the dashboard's board (default: the "
                        "hub's, capstone.pseudonym_key_file of the course settings)")
    b.set_defaults(func=build_command)
    s = actions.add_parser("serve", help="serve the built site on 127.0.0.1 (Ctrl-C stops)")
    s.add_argument("--port", type=int, default=8008, help="port (default 8008)")
    s.add_argument("--dir", help="folder to serve (default: site/_build/html)")
    s.set_defaults(func=serve_command)
    site.set_defaults(func=lambda args: (site.print_help(), 2)[1])


def build_command(args) -> int:
    """`scalelab site build`: 0 when the site was built; a failing lab or page is a SiteBuildError (exit 1)."""
    from ..course import site as sb
    kwargs = {"only": args.labs, "force": args.force,
              "progress": (lambda msg: None) if args.json else (lambda msg: print(f"site: {msg}", file=sys.stderr,
                                                                                   flush=True))}
    if args.labs_root:
        kwargs["labs_root"] = args.labs_root
    if args.out:
        kwargs["out"] = args.out
    if args.leaderboard:
        kwargs["leaderboard"] = public_board(args.leaderboard, args.pseudonym_key_file)
    report = sb.build_site(**kwargs)
    if args.json:
        print(json.dumps(sb.report_dict(report), indent=1))
    else:
        ran = sum(not lab.reused for lab in report.labs)
        print(f"site: built {report.html}/index.html ({len(report.labs)} lab page(s), {ran} executed now, "
              f"{len(report.labs) - ran} reused; sphinx {report.sphinx_s:.0f} s)")
    return 0


def public_board(graded: str, key_file: str | None) -> dict:
    """{"lab", "rows"} for the site: the graded folder's standings under pseudonyms made with `key_file` (default:
    the hub's key, as the dashboard makes them)."""
    from pathlib import Path
    from ..course.site import SiteBuildError
    from ..grade.leaderboard import standings
    from ..hub.capstone import key_path, public_rows, pseudonym_key
    folder = Path(graded)
    if not (folder / "results").is_dir():
        raise SiteBuildError(f"--leaderboard {graded}: no results/ folder there; give a graded lab's folder "
                             "(`scalelab grade --out`), e.g. <dashboard.grades>/12_capstone")
    if key_file is None:
        from ..hub.settings import load_settings
        key_file = str(key_path(load_settings()))
    return {"lab": folder.resolve().name, "rows": public_rows(standings(folder), pseudonym_key(key_file))}


def serve_command(args) -> int:
    """`scalelab site serve`: the built HTML over http.server on 127.0.0.1."""
    import functools
    import http.server
    from pathlib import Path
    from ..course.site import HTML_OUT, SiteBuildError
    root = Path(args.dir or HTML_OUT)
    if not (root / "index.html").is_file():
        raise SiteBuildError(f"{root} has no index.html: build the site first (`scalelab site build`)")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    with http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler) as httpd:
        print(f"site: serving {root} on http://127.0.0.1:{args.port}/ (Ctrl-C stops)", flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0
