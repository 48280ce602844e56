"""`scalelab cluster up|down|status`: the local Slurm (`scalelab.cluster.local`, or `scalelab.cluster.nodes` with
`--nodes N`) from a terminal."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..cluster import local, netns
from ..cluster.conf import status_table
from ..cluster.local import LocalCluster
from ..cluster.nodes import NodesCluster, default_nodes_state_dir
from ..errors import ClusterError


def add_cli(subparsers) -> None:
    """Add `scalelab cluster up [--nodes N --gpus-per-node K --link-rate RATE]|down|status [--json]`."""
    p = subparsers.add_parser("cluster", help="a real Slurm on this machine: 1 node, or N nodes in network namespaces",
                              description=local.__doc__.splitlines()[0])
    p.add_argument("--state-dir", default=None, help="state directory (default: $SCALELAB_CLUSTER_DIR, else "
                                                       "/var/lib/scalelab/cluster as root, else "
                                                       "~/.cache/scalelab/cluster; with --nodes N>1 the same + "
                                                       "'-nodes')")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start munged, slurmctld and slurmd (no-op when up); prints `export SLURM_CONF=`")
    up.add_argument("--timeout", type=float, default=None, help="seconds to wait for usable nodes (default 60, "
                                                                  "90 with --nodes)")
    up.add_argument("--nodes", type=int, default=1, help="nodes; N>1: each its own network namespace and hostname "
                                                          "(node1..N), beside the 1-node cluster (default 1)")
    up.add_argument("--gpus-per-node", type=int, default=0, help="stand-in GPUs (GRES) per node, with --nodes: "
                                                                 "scheduled for real, computed on the CPU")
    up.add_argument("--link-rate", default=None, help="shape each node's link, e.g. 1gbit or 100mbit (tc tbf)")
    up.set_defaults(func=_cli_up)
    down = sub.add_parser("down", help="stop the daemons (and remove the nodes' namespaces); state dir is kept")
    down.add_argument("--nodes", type=int, default=1, help="N>1: the multi-node cluster (default: the 1-node one)")
    down.set_defaults(func=_cli_down)
    st = sub.add_parser("status", help="partitions, nodes and jobs; exit 0 when up, 3 when down")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--nodes", type=int, default=1, help="N>1: the multi-node cluster (default: the 1-node one)")
    st.set_defaults(func=_cli_status)


def _multi(args) -> bool:
    """Whether the command is about the multi-node cluster: --nodes N>1, or a state dir that holds one."""
    return args.nodes > 1 or bool(args.state_dir and (Path(args.state_dir) / "nodes.json").exists())


def _cli_up(args) -> int:
    if args.nodes < 1:
        raise ClusterError(f"--nodes {args.nodes}: give 1 or more nodes")
    if args.nodes == 1 and (args.gpus_per_node or args.link_rate):
        raise ClusterError("--gpus-per-node and --link-rate shape the namespace nodes: add --nodes N (N >= 2)")
    cluster: LocalCluster
    if args.nodes > 1:
        why = netns.unavailable()
        if why:
            print(f"scalelab: a {args.nodes}-node cluster needs network namespaces, but {why}; starting the 1-node "
                  "cluster instead (run as root on Linux for nodes)", file=sys.stderr)
            cluster = LocalCluster(None).up(timeout=args.timeout or 60)
        else:
            cluster = NodesCluster(args.state_dir, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                   link_rate=args.link_rate).up(timeout=args.timeout or 90)
    else:
        cluster = LocalCluster(args.state_dir).up(timeout=args.timeout or 60)
    print(f"scalelab: local Slurm is up (logs in {cluster.log_dir}); clients need:", file=sys.stderr)
    for k, v in cluster.env().items():
        print(f"export {k}={v}")
    return 0


def _cluster(args) -> LocalCluster:
    if _multi(args):
        return NodesCluster(args.state_dir or default_nodes_state_dir())
    return LocalCluster(args.state_dir)


def _cli_down(args) -> int:
    _cluster(args).down()
    return 0


def _cli_status(args) -> int:
    st = _cluster(args).status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(status_table(st))
    return 0 if st["up"] else 3
