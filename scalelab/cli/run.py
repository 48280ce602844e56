"""`scalelab run`: launch a RunSpec from a terminal, with a progress bar and a summary table.

    scalelab run --preset tiny --workers 2 --strategy ddp
    scalelab run --preset tiny --workers 2 --strategy horovod --launcher mpirun
    scalelab run --preset tiny --workers 2 --strategy fsdp
    scalelab run --preset tiny --workers 2 --launcher slurm --set slurm.partition=cpu
    scalelab run --spec my.yaml --set optim.lr=0.1 --json
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from ..errors import RunFailed, ScalelabError
from ..run.validate import LAUNCHERS, STRATEGIES

JSON_KEYS = ("status", "world_size", "samples_per_s", "steps", "final_loss", "eval_accuracy", "strategy",
             "launcher", "elapsed_s", "per_rank_samples_per_s", "time_fraction", "comm_in_flight", "run_dir", "error",
             "failed_rank")


def add_cli(subparsers) -> None:
    """Register `scalelab run`."""
    p = subparsers.add_parser("run", help="launch a training run and report its throughput",
                              description=__doc__, formatter_class=_raw())
    p.add_argument("--preset", default="tiny", help="starting point: tiny, laptop, gpu-node, multi-node (default tiny)")
    p.add_argument("--spec", help="a RunSpec JSON/YAML file (instead of --preset)")
    p.add_argument("--workers", type=int, help="ranks per node (world.workers_per_node)")
    p.add_argument("--nodes", type=int, help="nodes (world.nodes; slurm launcher)")
    # the engine's own allowed values (run/validate.py), so the command line never lags what the engine runs
    p.add_argument("--strategy", choices=STRATEGIES,
                   help="how ranks share the work: ddp and horovod (data parallel), fsdp (sharded), pp (pipeline), "
                        "tp (tensor), 3d (tp x pp x dp)")
    p.add_argument("--launcher", choices=LAUNCHERS,
                   help="how ranks start (default: local, or horovodrun for horovod); slurm submits a batch job, "
                        "srun starts the ranks inside an allocation you hold")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any field, e.g. --set optim.lr=0.1 --set data.samples=2048 (repeatable)")
    p.add_argument("--out", help="run directory (output_dir); default runs/<name>-<time>-<pid>, always a new one")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="--out holds an earlier run: continue it from its newest checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="--out holds an earlier run: delete its files and start again")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (the last line of "
                   "stdout; progress still goes to stderr)")
    p.set_defaults(func=run_command)


def _raw():
    import argparse
    return argparse.RawDescriptionHelpFormatter


def build_spec(args):
    """The RunSpec the command line describes: preset or file, then flags, then --set overrides; validated."""
    from ..run.spec import load, preset
    spec = load(args.spec) if args.spec else preset(args.preset)
    changes = {}
    if args.workers is not None:
        changes["world.workers_per_node"] = args.workers
    if args.nodes is not None:
        changes["world.nodes"] = args.nodes
    if args.strategy:
        changes["strategy"] = args.strategy
        if not args.launcher and args.strategy == "horovod" and spec.launcher in ("local", "torchrun"):
            changes["launcher"] = "horovodrun"
    if args.launcher:
        changes["launcher"] = args.launcher
    if args.out:
        changes["output_dir"] = args.out
    if getattr(args, "resume", False):
        changes["checkpoint.resume"] = True
    spec = spec.with_overrides(changes)
    return spec.with_overrides(args.overrides) if args.overrides else spec


class _Ended(BaseException):
    """SIGTERM or SIGHUP reached `scalelab run` (kill, a closed terminal, Slurm at the time limit, systemd)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_ended(signum, frame):
    raise _Ended(signum)


def run_command(args) -> int:
    """Launch, follow with a progress bar (unless --json), print the summary; exit 1 when the run failed.

    Ctrl-C (SIGINT), SIGTERM and SIGHUP stop the run, every rank and Slurm job of it, and exit 128 + the signal;
    a SIGKILL cannot be caught, so the launcher processes and ranks watch this one (`run.procs`) and end too."""
    import signal
    from ..launch import launch
    spec = build_spec(args)
    if spec.output_dir:
        check_run_dir(Path(spec.output_dir), resume=args.resume, overwrite=args.overwrite)
    previous = {sig: signal.signal(sig, _raise_ended) for sig in (signal.SIGTERM, signal.SIGHUP)}
    run = None
    try:
        run = launch(spec)
        summary = _follow(run, args.timeout)
    except (KeyboardInterrupt, _Ended) as e:
        signum = e.signum if isinstance(e, _Ended) else signal.SIGINT
        if run is not None:
            run.stop()
        where = f"; run directory: {run.run_dir}" if run is not None else ""
        print(f"stopped by {signal.Signals(signum).name}{where}", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        print(json.dumps({k: _finite(summary.get(k)) for k in JSON_KEYS}))
    else:
        print(format_summary(summary))
    return 0 if summary["status"] == "succeeded" else 1


RUN_FILES = ("spec.json", "events", "logs", "checkpoints", "model.pt", "job.sh", "job_id")


def check_run_dir(run_dir: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse to start a second run in a folder that holds one (their events would merge into the same files):
    --resume continues it, --overwrite deletes the earlier run's files first (only a run's, never other files)."""
    if not run_dir.exists():
        if resume:
            raise ScalelabError(f"--resume: {run_dir} does not exist; there is no run to continue")
        return
    if not run_dir.is_dir():
        raise ScalelabError(f"--out {run_dir}: is a file, not a folder; choose another --out")
    entries = {p.name for p in run_dir.iterdir()}
    if not entries or resume:
        return
    if not (entries & {"spec.json", "events"}):
        raise ScalelabError(f"--out {run_dir}: the folder is not empty and holds no run ({len(entries)} other "
                            "entries); choose an empty or new folder")
    if not overwrite:
        raise ScalelabError(f"--out {run_dir}: holds an earlier run; pass --resume to continue it from its last "
                            "checkpoint, --overwrite to replace it, or choose another --out")
    import shutil
    for name in entries & set(RUN_FILES):
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _follow(run, timeout) -> dict:
    from tqdm import tqdm
    total = run.spec.steps if not run.spec.epochs else None
    # progress goes to stderr even with --json (its JSON stays the last line of stdout); less often when stderr is a
    # log file, not a terminal
    bar = tqdm(total=total, unit="step", desc=f"{run.spec.name} [{run.launcher}]", dynamic_ncols=True,
               file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 10.0)
    deadline = None if timeout is None else time.monotonic() + timeout
    seen, done = 0, 0
    while run.poll() in ("pending", "running"):
        if deadline and time.monotonic() > deadline:
            run.stop()
            break
        new = run.events(seen)
        seen += len(new)
        _advance(bar, new, done)
        done = bar.n
        time.sleep(0.2)
    _advance(bar, run.events(seen), done)
    bar.close()
    try:
        return run.wait(check=True)
    except RunFailed:
        return run.summary()


def _advance(bar, events, done) -> None:
    for e in events:
        if e["type"] == "start" and e["rank"] == 0 and bar.total is None:
            bar.total = e["total_steps"]
        if e["type"] == "step" and e["rank"] == 0:
            bar.update(e["step"] - bar.n)
            bar.set_postfix(loss=f"{e['loss']:.3f}", sps=f"{e['samples_per_s']:.0f}/rank", refresh=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def format_summary(s: dict) -> str:
    """The end-of-run table."""
    frac = s.get("time_fraction") or {}
    rows = [("status", s["status"]), ("strategy / launcher", f"{s['strategy']} / {s['launcher']}"),
            ("world size", s["world_size"]), ("steps", s["steps"]),
            ("final loss", f"{s['final_loss']:.4f}" if _num(s["final_loss"]) else "-"),
            ("eval accuracy", f"{s['eval_accuracy']:.3f}" if _num(s.get("eval_accuracy")) else "-"),
            ("samples/s (all ranks)", f"{s['samples_per_s']:.1f}"),
            ("samples/s per rank", ", ".join(f"{r:.1f}" for r in s["per_rank_samples_per_s"])),
            ("time: data / compute / comm / other",
             " / ".join(f"{frac.get(k, 0):.0%}" for k in ("data", "compute", "comm", "other")) + "  (adds to 100 %)"),
            ("all-reduce in flight", f"{s.get('comm_in_flight', 0):.0%} of step time (DDP: overlapping backward)"),
            ("elapsed", f"{s['elapsed_s']:.1f} s"), ("run directory", s["run_dir"])]
    if s.get("error"):
        rows.append(("error", s["error"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


__all__ = ["add_cli", "build_spec", "run_command", "format_summary", "ScalelabError"]
