"""`scalelab hub` (what `make hub` runs) and `scalelab kernels install`.

    scalelab hub                               # local mode from hub_config/course.yaml
    scalelab hub --mode slurm                  # the batch path; on one machine it starts the local Slurm
    scalelab hub --config my_course.toml       # another course settings file
    scalelab hub --check                       # check the settings, print the security posture; start nothing
                                               # (exit 1 when the posture is unsafe)
    scalelab kernels install [--preset local|cluster] [--user | --prefix DIR]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import SetupError
from ..hub.config import private_state_dir, refuse_unsafe
from ..hub.posture import format_posture, problems, seal_instructor_files, warnings, who_runs_servers
from ..hub.settings import (ENV_OVERRIDES, ENV_SETTINGS, deep_merge, default_settings_path, hub_config_dir,
                            load_settings)


def add_cli(subparsers) -> None:
    """Add `scalelab hub` and `scalelab kernels`."""
    p = subparsers.add_parser("hub", help="start JupyterHub for the course (local processes or Slurm jobs)",
                              description="Start JupyterHub for the course (what `make hub` runs): students' "
                                          "servers as local processes or Slurm jobs, from one settings file.")
    p.add_argument("--config", default=None, help=f"course settings file, YAML or TOML (default "
                                                   f"{default_settings_path()})")
    p.add_argument("--mode", choices=("local", "slurm"), default=None, help="override the settings' mode")
    p.add_argument("--check", action="store_true", help="check the settings, print them and the security posture "
                   "(who servers run as, who signs in); start nothing; exit 1 if the posture is unsafe")
    p.set_defaults(func=run_hub)

    k = subparsers.add_parser("kernels", help="the course Jupyter kernels")
    ksub = k.add_subparsers(dest="action", metavar="ACTION", required=True)
    ki = ksub.add_parser("install", help="install the course kernels (kernels/) for this environment")
    ki.add_argument("--preset", choices=("local", "cluster"), default="local",
                    help="local: distributed runs on this machine over loopback (default); cluster: site network")
    where = ki.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into ~/.local/share/jupyter instead of this environment")
    where.add_argument("--prefix", default=None, help="into PREFIX/share/jupyter (default: sys.prefix)")
    ki.set_defaults(func=run_kernels_install)


def run_kernels_install(args) -> int:
    """`scalelab kernels install`."""
    from ..hub.kernels import install_kernels

    for path in install_kernels(args.preset, prefix=args.prefix, user=args.user):
        print(f"installed kernel {path.name} ({args.preset}) in {path}")
    return 0


def slurm_overrides(cfg: dict) -> tuple[dict, object | None]:
    """Settings that point the hub at a Slurm: the configured one, $SLURM_CONF, the system one, or a local one."""
    if cfg["slurm"]["conf"]:
        return {}, None
    if os.environ.get("SLURM_CONF"):
        return {"slurm": {"conf": os.environ["SLURM_CONF"]}}, None
    if Path("/etc/slurm/slurm.conf").exists():
        return {}, None
    from ..cluster.local import LocalCluster

    cluster = LocalCluster().up()
    over = {"slurm": {"conf": cluster.env()["SLURM_CONF"]}}
    # one machine: the servers listen on the loopback only, and the hub reaches them there
    if cfg["slurm"]["server_ip"] == "0.0.0.0":
        over["slurm"]["server_ip"] = "127.0.0.1"
    if not cfg["slurm"]["node_address"]:
        over["slurm"]["node_address"] = "127.0.0.1"
    return over, cluster


def apply_student_qos(cfg: dict) -> tuple[int, int] | None:
    """On a local cluster with accounting: its student QOS's MaxTRESPerUser := the hub's per-student cap (the one
    number, `options.student_limits`), so a course account's own sbatch from a terminal is held to it as its
    servers are. A centre's Slurm (or one without accounting): nothing; its QOS is its administrators' to set."""
    from ..cluster.accounting import accounting_conf
    from ..cluster.local import LocalCluster
    from ..errors import ClusterError
    from ..hub.options import profiles_from_settings, student_limits
    conf = cfg["slurm"]["conf"]
    if not conf or accounting_conf(conf) is None:
        return None
    per = cfg["slurm"]["per_student"]
    limits = student_limits(profiles_from_settings(cfg["slurm"]), int(per["cpus"]), int(per["gpus"]))
    try:
        LocalCluster(Path(conf).parent, accounting=True).set_student_limits(*limits)
    except ClusterError as e:
        print(f"scalelab hub: warning: the local cluster's student QOS was not set ({e})", file=sys.stderr)
        return None
    return limits


def _preflight(cfg: dict) -> None:
    from ..hub.config import find_proxy, python_bin

    if not find_proxy(cfg):
        raise SetupError("configurable-http-proxy not found beside the course Python or on PATH: run `make hub` "
                         "once (it installs it), or `npm install -g configurable-http-proxy`")
    single = Path(python_bin(cfg)) / "jupyterhub-singleuser"
    if not single.exists():
        raise SetupError(f"{single} not found: install the hub extra (`pip install -e '.[hub,labs]'`) or set "
                         "servers.python_bin to the course environment's bin directory")
    if cfg["mode"] == "slurm":
        sbatch = Path(cfg["slurm"]["bin_dir"]) / "sbatch"
        if not sbatch.exists():
            raise SetupError(f"{sbatch} not found: set slurm.bin_dir to where sbatch is, or run "
                             "`apt-get install slurm-wlm munge` to try Slurm on this machine")


def _banner(cfg: dict, passwords: dict, cluster) -> str:
    hub = cfg["hub"]
    host = "127.0.0.1" if hub["ip"] in ("0.0.0.0", "") else hub["ip"]
    url = f"http://{host}:{hub['port']}{hub['base_url']}"
    lines = [f"scalelab hub: {cfg['course']['name']} — mode {cfg['mode']}",
             f"  open      {url}"]
    if cfg["auth"]["type"] == "shared-password":
        names = cfg["auth"]["allowed_users"]
        who = (f"as one of {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}" if names
               else "with any user name (lower-case letters, digits, - or _)")
        if passwords.get("students"):
            from ..hub.auth import student_passwords_file
            lines.append(f"  log in    {who}, each with a password of their own: "
                         f"{student_passwords_file(cfg)} (generated ones; the roster's otherwise)")
        else:
            lines.append(f"  log in    {who} and the password: {passwords['user']}")
        if passwords.get("admin"):
            lines.append(f"  admins    {', '.join(cfg['hub']['admin_users'])}: password in "
                         f"{Path(hub['state_dir']) / 'admin_password'} (or auth.admin_password)")
    else:
        lines.append("  log in    with your Unix account (PAM)")
    if cluster is not None:
        lines.append(f"  Slurm     local single-node cluster, SLURM_CONF={cfg['slurm']['conf']}")
    lines.append(f"  servers   run as {who_runs_servers(cfg)}")
    lines.append(f"  state     {hub['state_dir']} (database, secrets, homes); stop with Ctrl-C")
    return "\n".join(lines)


def _release_course_labs() -> None:
    """Write the student copies (solutions and hidden checks removed) that `labs.source: auto` hands out."""
    from ..course.lab import find_labs
    from ..course.release import release_labs
    from ..paths import labs_dir
    from ..hub.provision import source_candidates
    labs_root = labs_dir()
    if not find_labs(labs_root):
        print(f"scalelab hub: no labs under {labs_root}; students get none", file=sys.stderr)
        return
    reports = release_labs(labs_root=labs_root, out_root=source_candidates()[0])
    print(f"scalelab hub: released {len(reports)} labs (solutions removed) into {source_candidates()[0]}", flush=True)


def run_hub(args) -> int:
    """`scalelab hub`: check the settings, prepare what the mode needs, print how to log in, run JupyterHub."""
    from ..hub.auth import ensure_passwords

    overrides: dict = {"mode": args.mode} if args.mode else {}
    cfg = load_settings(args.config, overrides)
    cluster = None
    if cfg["mode"] == "slurm" and not args.check:
        extra, cluster = slurm_overrides(cfg)
        if extra:
            overrides = deep_merge(overrides, extra)
            cfg = load_settings(args.config, overrides)
        if cluster is not None and cfg["slurm"]["reservation"]:
            import pwd
            cluster.ensure_reservation(cfg["slurm"]["reservation"], users=[pwd.getpwuid(os.geteuid()).pw_name])
        apply_student_qos(cfg)
    _preflight(cfg)
    if args.check:
        print(json.dumps(cfg, indent=1))
        print(f"security posture:\n{format_posture(cfg)}", file=sys.stderr)
        return 1 if problems(cfg) else 0
    refuse_unsafe(cfg)
    for w in warnings(cfg):
        print(f"scalelab hub: warning: {w}", file=sys.stderr)
    if cfg["labs"]["source"] == "auto":
        _release_course_labs()
    if cfg["servers"]["run_as"] == "student-accounts":
        sealed = seal_instructor_files()
        if sealed:
            print("scalelab hub: closed to students (no access for others): " + ", ".join(str(p) for p in sealed),
                  flush=True)
    passwords = ensure_passwords(cfg)
    if cfg["kernels"]["install"]:
        from ..hub.kernels import install_kernels
        preset = cfg["kernels"]["preset"]
        if preset == "auto":
            preset = "local" if cfg["mode"] == "local" or cluster is not None else "cluster"
        install_kernels(preset)
    print(_banner(cfg, passwords, cluster), flush=True)
    env = dict(os.environ)
    env[ENV_SETTINGS] = str(Path(args.config).resolve()) if args.config else ""
    env[ENV_OVERRIDES] = json.dumps(overrides)
    private_state_dir(cfg["hub"]["state_dir"])
    os.chdir(cfg["hub"]["state_dir"])  # anything JupyterHub writes beside itself lands in the state dir
    argv = [sys.executable, "-m", "jupyterhub", "-f", str(hub_config_dir() / "jupyterhub_config.py")]
    sys.stdout.flush()
    sys.stderr.flush()
    old_umask = os.umask(0o077)  # the database, secrets and logs the hub creates: only its own account reads them
    try:
        os.execve(sys.executable, argv, env)
    finally:  # reached only when execve failed (or in a test that stands in for it)
        os.umask(old_umask)
    return 0
