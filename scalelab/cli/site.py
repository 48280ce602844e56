"""`scalelab site build` and `scalelab site serve`: thin commands over `scalelab.course.site`.

    scalelab site build                      # execute (or reuse) every lab, render the pages -> site/_build/html
    scalelab site build --lab 01_single_device --force   # only that lab's page, executed again
    scalelab site serve --port 8008          # look at the built site on http://127.0.0.1:8008/
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
    report = sb.build_site(**kwargs)
    if args.json:
        print(json.dumps(sb.report_dict(report), indent=1))
    else:
        ran = sum(not lab.reused for lab in report.labs)
        print(f"site: built {report.html}/index.html ({len(report.labs)} lab page(s), {ran} executed now, "
              f"{len(report.labs) - ran} reused; sphinx {report.sphinx_s:.0f} s)")
    return 0


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
