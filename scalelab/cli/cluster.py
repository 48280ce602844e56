"""`scalelab cluster up|down|status`: the local Slurm (`scalelab.cluster.local`) from a terminal."""
from __future__ import annotations

import json
import sys

from ..cluster.conf import status_table
from ..cluster import local
from ..cluster.local import LocalCluster


def add_cli(subparsers) -> None:
    """Add `scalelab cluster up|down|status [--json]`."""
    p = subparsers.add_parser("cluster", help="a real single-node Slurm on this machine (development and tests)",
                              description=local.__doc__.splitlines()[0])
    p.add_argument("--state-dir", default=None, help="state directory (default: $SCALELAB_CLUSTER_DIR, else "
                                                       "/var/lib/scalelab/cluster as root, else "
                                                       "~/.cache/scalelab/cluster)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start munged, slurmctld and slurmd (no-op when up); prints `export SLURM_CONF=`")
    up.add_argument("--timeout", type=float, default=60, help="seconds to wait for a usable node (default 60)")
    up.set_defaults(func=_cli_up)
    sub.add_parser("down", help="stop the daemons; the state directory is kept").set_defaults(func=_cli_down)
    st = sub.add_parser("status", help="partitions, nodes and jobs; exit 0 when up, 3 when down")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.set_defaults(func=_cli_status)


def _cli_up(args) -> int:
    cluster = LocalCluster(args.state_dir).up(timeout=args.timeout)
    print(f"scalelab: local Slurm is up (logs in {cluster.log_dir}); clients need:", file=sys.stderr)
    for k, v in cluster.env().items():
        print(f"export {k}={v}")
    return 0


def _cli_down(args) -> int:
    LocalCluster(args.state_dir).down()
    return 0


def _cli_status(args) -> int:
    cluster = LocalCluster(args.state_dir)
    st = cluster.status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(status_table(st))
    return 0 if st["up"] else 3
