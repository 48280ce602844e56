"""`scalelab doctor`: what this machine has for the course kit, and the command that fixes what is missing.

    scalelab doctor            # one line per check, a `fix:` line under each failure; exit 1 if a required one fails
    scalelab doctor --json     # the same checks as a JSON list of {name, ok, required, detail, fix}

"Required" means needed by `make test` and `make hub` (the full kit: Horovod, MPI, Slurm, the proxy, a browser).
CUDA is never required: without it every run uses gloo on CPU. The API is `run_checks() -> list[Check]`; the CLI
only prints it. Tools are looked up as the launchers look them up (`scalelab.paths.find_tool`: beside this Python,
then PATH), and each fix is the command in `scalelab.paths.INSTALL_HINTS`.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..paths import INSTALL_HINTS, find_tool, venv_bin



@dataclass(frozen=True)
class Check:
    """One thing the doctor looked at."""

    name: str
    """Short name of the component (torch, cuda, horovod, ...)."""
    ok: bool
    """Whether it is there and works."""
    detail: str
    """What was found (version, path, device count) or what went wrong."""
    fix: str
    """The command that fixes it; empty when ok."""
    required: bool = True
    """Whether `make test` / `make hub` need it; a failing optional check does not fail the doctor."""


def _run(cmd: list[str], timeout: float = 60, env: dict | None = None) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `cmd`; 127 when it cannot be started, 124 when it timed out."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except OSError as e:
        return 127, str(e)
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)} did not finish in {timeout:.0f} s"
    return p.returncode, (p.stdout + p.stderr).strip()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def check_torch() -> Check:
    """torch imports; its version and how many threads it uses for intra-op work."""
    try:
        import torch
    except ImportError as e:
        return Check("torch", False, f"cannot import torch: {e}",
                     "make venv   (pip install -c constraints/cpu.txt -e '.[labs,hub,dev]')")
    return Check("torch", True, f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
                                f"Python {platform.python_version()}", "")


def check_cuda() -> Check:
    """CUDA devices and NCCL, when there are any; a CPU-only machine is fine (gloo)."""
    try:
        import torch
    except ImportError:
        return Check("cuda", False, "torch is missing (see the torch check)", "make venv", required=False)
    if not torch.cuda.is_available():
        built = f"torch built with CUDA {torch.version.cuda}, but no device is visible" if torch.version.cuda \
            else "CPU build of torch"
        return Check("cuda", True, f"CPU only — gloo will be used ({built})", "", required=False)
    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    try:
        v = torch.cuda.nccl.version()
        nccl = "NCCL " + (".".join(map(str, v)) if isinstance(v, tuple) else str(v))
    except (AttributeError, RuntimeError) as e:
        nccl = f"NCCL not available ({e})"
    return Check("cuda", True, f"{n} device(s): {', '.join(names)}; CUDA {torch.version.cuda}; {nccl}", "",
                 required=False)


_HOROVOD_PROBE = """
import json, horovod, horovod.torch as hvd
print(json.dumps({"version": horovod.__version__, "gloo": bool(hvd.gloo_built()),
                  "mpi": bool(hvd.mpi_built()), "nccl": bool(hvd.nccl_built())}))
"""
_HOROVOD_FIX = INSTALL_HINTS["horovodrun"]


def check_horovod() -> Check:
    """horovod.torch imports and was built with Gloo and MPI (NCCL is reported, not needed)."""
    # A subprocess: importing horovod.torch loads its compiled extension, which is slow and can crash the process.
    rc, out = _run([sys.executable, "-c", _HOROVOD_PROBE], timeout=120)
    if rc != 0:
        return Check("horovod", False, f"cannot import horovod.torch: {_last_line(out) or f'exit {rc}'}", _HOROVOD_FIX)
    built = json.loads(out.strip().splitlines()[-1])
    flags = ", ".join(f"{k} {'yes' if built[k] else 'no'}" for k in ("gloo", "mpi", "nccl"))
    detail = f"horovod {built['version']}: {flags}"
    if not (built["gloo"] and built["mpi"]):
        return Check("horovod", False, detail + " (the kit needs Gloo and MPI)",
                     f"{sys.executable} -m pip uninstall -y horovod && rm -rf ~/.cache/scalelab/wheels/horovod-* "
                     f"&& {_HOROVOD_FIX}")
    return Check("horovod", True, detail, "")


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def check_horovodrun() -> Check:
    """The `horovodrun` launcher is on PATH or in the venv."""
    path = find_tool("horovodrun")
    if not path:
        return Check("horovodrun", False, "horovodrun not found on PATH or in " + str(venv_bin()), _HOROVOD_FIX)
    return Check("horovodrun", True, path, "")


def _version_check(name: str, missing: str, *, tool: str | None = None, why: str = "", said=None,
                   failed_line=None) -> Check:
    """`tool --version` runs: passed with the line `said` picks from its output (the first line by default),
    failed with its install hint when the tool is missing (`missing`) or its --version fails (`why` in the
    brackets, the `failed_line` of its output)."""
    tool = tool or name
    fix = INSTALL_HINTS[tool]
    path = find_tool(tool)
    if not path:
        return Check(name, False, missing, fix)
    rc, out = _run([path, "--version"], timeout=30)
    line = (said or _first_line)(out)
    if rc != 0 or not line:
        return Check(name, False, f"{path} --version failed (exit {rc}{why}): {(failed_line or _last_line)(out)}", fix)
    return Check(name, True, f"{line} ({path})", "")


def check_mpi() -> Check:
    """Open MPI's `mpirun` runs."""
    return _version_check("mpirun", "mpirun not found on PATH", failed_line=_first_line)


def check_slurm() -> Check:
    """Slurm's client commands (sbatch, squeue) are installed."""
    found = {name: find_tool(name) for name in ("sbatch", "squeue")}
    missing = [name for name, path in found.items() if not path]
    if missing:
        return Check("slurm", False, f"{', '.join(missing)} not found on PATH", INSTALL_HINTS["sbatch"])
    return Check("slurm", True, ", ".join(f"{n} at {p}" for n, p in found.items()), "")


def check_slurm_cluster() -> Check:
    """A Slurm cluster answers: the one SLURM_CONF names, /etc/slurm's, or scalelab's local one."""
    squeue = find_tool("squeue")
    if not squeue:
        return Check("slurm cluster", False, "no squeue (see the slurm check)", INSTALL_HINTS["sbatch"],
                     required=False)
    conf = os.environ.get("SLURM_CONF") or ("/etc/slurm/slurm.conf" if Path("/etc/slurm/slurm.conf").exists() else "")
    if conf:
        rc, out = _run([squeue, "-h", "-o", "%i"], timeout=20)
        if rc == 0:
            return Check("slurm cluster", True, f"answers at SLURM_CONF={conf} ({len(out.split())} jobs queued)", "",
                         required=False)
        return Check("slurm cluster", False, f"squeue with SLURM_CONF={conf} failed (exit {rc}): {_first_line(out)}",
                     "check that slurmctld runs for that slurm.conf, or unset SLURM_CONF to use the local cluster",
                     required=False)
    try:
        from ..cluster.local import LocalCluster
    except ImportError as e:
        return Check("slurm cluster", False, f"no SLURM_CONF, and scalelab.cluster.local cannot be imported: {e}", "",
                     required=False)
    cluster = LocalCluster()
    try:
        status = cluster.status()
    except Exception as e:  # noqa: BLE001 - a diagnosis reports whatever went wrong instead of crashing on it
        return Check("slurm cluster", False, f"local cluster status failed: {e!r}", "sudo scalelab cluster up",
                     required=False)
    if status.get("up"):
        return Check("slurm cluster", True, f"local cluster up, {len(status.get('nodes', []))} node(s), "
                                            f"SLURM_CONF={status.get('conf')}", "", required=False)
    return Check("slurm cluster", False, f"no SLURM_CONF and the local cluster is down ({status.get('conf')}); "
                                         "tests and `make hub` start it themselves",
                 "sudo scalelab cluster up", required=False)


def check_chp() -> Check:
    """configurable-http-proxy (JupyterHub's proxy) runs and says its version."""
    return _version_check("configurable-http-proxy", f"not found on PATH or in {venv_bin()}",
                          why="; node missing from PATH?")


def check_chromium() -> Check:
    """Debian's chromium, the browser the browser tests drive through playwright."""
    return _version_check("chromium", "chromium not found on PATH",
                          said=lambda out: next((x for x in out.splitlines() if x.startswith("Chromium")), ""))


def check_playwright() -> Check:
    """The python playwright package (browser tests drive /usr/bin/chromium with it; no browser download)."""
    from importlib import metadata
    try:
        version = metadata.version("playwright")
    except metadata.PackageNotFoundError:
        return Check("playwright", False, "python package playwright is not installed",
                     "make venv   (playwright is in the dev extra)")
    return Check("playwright", True, f"playwright {version} (python; drives /usr/bin/chromium)", "")


CHECKS = (check_torch, check_cuda, check_horovod, check_horovodrun, check_mpi, check_slurm, check_slurm_cluster,
          check_chp, check_chromium, check_playwright)


def run_checks() -> list[Check]:
    """Every check, in a fixed order; a check that crashes is reported as failed, never raised."""
    results = []
    for check in CHECKS:
        try:
            results.append(check())
        except Exception as e:  # noqa: BLE001 - one broken component must not hide the report on the others
            name = check.__name__.removeprefix("check_")
            results.append(Check(name, False, f"the check itself failed: {e!r}", "report this as a scalelab bug"))
    return results


def failed_required(checks: list[Check]) -> list[Check]:
    """The required checks that failed: the doctor exits 1 when there is any."""
    return [c for c in checks if c.required and not c.ok]


def format_report(checks: list[Check]) -> str:
    """The human-readable report: one line per check, the fix under each failure, then the verdict."""
    width = max(len(c.name) for c in checks)
    lines = ["scalelab doctor: required = needed by `make test` and `make hub`; optional checks never fail it", ""]
    for c in checks:
        status = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"  {status}  {c.name:<{width}}  {'' if c.required else '(optional) '}{c.detail}")
        if not c.ok and c.fix:
            lines.append(f"        {'':<{width}}  fix: {c.fix}")
    bad = failed_required(checks)
    n_required = sum(c.required for c in checks)
    lines.append("")
    lines.append(f"{len(bad)} of {n_required} required checks FAIL: {', '.join(c.name for c in bad)}" if bad
                 else f"all {n_required} required checks pass")
    return "\n".join(lines)


def _cli(args) -> int:
    checks = run_checks()
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(format_report(checks))
    return 1 if failed_required(checks) else 0


def add_cli(subparsers) -> None:
    """`scalelab doctor [--json]`."""
    p = subparsers.add_parser(
        "doctor", help="check torch, CUDA, Horovod, MPI, Slurm, the proxy and Chromium; say how to fix each",
        description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the checks as a JSON list (exit status unchanged)")
    p.set_defaults(func=_cli)
