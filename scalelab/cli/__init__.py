"""The `scalelab` command: a thin layer over the library; each subcommand lives with the code it drives.

One module of `scalelab.cli` per command group. Every module listed in `COMMANDS` exposes `add_cli(subparsers)`, which adds its sub-parser and sets
`func(args) -> int` on it; the work itself is done by the library it calls. Imports are lazy so
`scalelab --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import ScalelabError

COMMANDS = [
    "scalelab.cli.run",       # scalelab run
    "scalelab.cli.doctor",    # scalelab doctor
    "scalelab.cli.cluster",   # scalelab cluster up|down|status
    "scalelab.cli.hub",       # scalelab hub, scalelab kernels
    "scalelab.cli.grade",     # scalelab grade, scalelab labs release
    "scalelab.cli.course",    # scalelab course collect|return|gradebook
    "scalelab.cli.site",      # scalelab site build
]


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI surface, every subcommand that is installed."""
    parser = argparse.ArgumentParser(prog="scalelab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in COMMANDS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name and modname.startswith(e.name):
                continue  # that part of the kit is not built yet
            raise
        mod.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `scalelab` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ScalelabError as e:
        print(f"scalelab {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a path the user gave that cannot be read or written: one line, not a traceback
        if os.environ.get("SCALELAB_DEBUG"):
            raise
        where = f" {e.filename}" if e.filename else ""
        print(f"scalelab {args.command}: error:{where}: {e.strerror or e}; check the paths given on the command "
              "line (--out, --prefix, --state-dir, ...); SCALELAB_DEBUG=1 shows the traceback", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

