"""Lab 08 (resilience): faults and their detection, the checkpoint interval against a failure trace, preemption,
and recovery times read off a run's events.

    report = fault_run(spec)                   # launch with an injected fault; who failed, after how long
    young_interval(ckpt_s=0.02, mtbf_s=60)     # sqrt(2 C M): Young's checkpoint interval
    sweep = interval_sweep(work_s, ckpt_s, restart_s, mtbf_s, intervals)   # wall time vs interval, simulated
    signal_rank(run, rank=1, after_step=5)     # a real SIGTERM to one rank once it has done 5 steps
    recovery(events)                           # failure -> training again, and the steps redone

The training runs are real (`scalelab.launch`); the failure trace is a seeded simulation, because waiting for real
failures at a rate that makes the interval matter would take days.
"""
from __future__ import annotations

import math
import os
import random
import signal
import time

from ..ckpt import read_manifest  # noqa: F401 - re-exported for the lab (the tiers of a multilevel run)
from ..errors import RunFailed


# -- faults and detection ---------------------------------------------------------------------------------
def fault_run(spec, timeout: float = 300) -> dict:
    """Launch `spec` (which injects a fault), wait for the run to fail; who failed, what the error says, how long
    after the fault the run noticed (detect_s), each rank's last step, the error type each rank reported (errors;
    both keyed by the rank as a string, as JSON records keep them) and the run directory."""
    from ..launch import launch
    run = launch(spec)
    try:
        run.wait(timeout=timeout)
        failed, error = None, None
    except RunFailed as e:
        failed, error = e.rank, str(e)
    noticed = time.time()
    events = run.events()
    fault = next((e for e in events if e["type"] == "fault"), None)
    return {"status": run.status, "failed_rank": failed, "error": error, "run_dir": str(run.run_dir),
            "fault_rank": fault["rank"] if fault else None, "fault_step": fault["step"] if fault else None,
            "detect_s": noticed - fault["t"] if fault else None,
            "last_steps": {str(r): step for r, step in last_steps(events).items()},  # str keys: JSON records
            "errors": {str(e["rank"]): e["error"] for e in events if e["type"] == "error"}}


def last_steps(events: list[dict]) -> dict[int, int]:
    """Each rank's last reported step (0 if none): the rank that stopped first is the suspect."""
    last: dict[int, int] = {}
    for e in events:
        if e["type"] == "start":
            last.setdefault(e["rank"], e.get("start_step", 0))
        elif e["type"] == "step":
            last[e["rank"]] = max(last.get(e["rank"], 0), e["step"])
    return dict(sorted(last.items()))


# -- the checkpoint interval ----------------------------------------------------------------------------------
def checkpoint_cost(events: list[dict], rank: int = 0) -> float:
    """Mean seconds one checkpoint blocked training on `rank` (its checkpoint events' blocked_s)."""
    blocks = [e["blocked_s"] for e in events if e["type"] == "checkpoint" and e["rank"] == rank]
    if not blocks:
        raise ValueError("the run wrote no checkpoint: set checkpoint.every_steps > 0")
    return sum(blocks) / len(blocks)


def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 C M) between checkpoints (C: checkpoint cost, M: mean time between failures)."""
    return math.sqrt(2 * ckpt_s * mtbf_s)


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (2006); close to Young's when C << M, M when C >= 2M."""
    if ckpt_s >= 2 * mtbf_s:
        return mtbf_s
    x = ckpt_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - ckpt_s


def failure_trace(mtbf_s: float, horizon_s: float, seed: int = 0) -> list[float]:
    """Failure times in [0, horizon_s): a Poisson process with mean gap mtbf_s (seeded)."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append(t)


def simulate(work_s: float, interval_s: float, ckpt_s: float, restart_s: float, failures: list[float]) -> float:
    """Wall-clock seconds to finish `work_s` of computation checkpointing every `interval_s` of work, when the
    job fails at the times in `failures`: a failure loses the work since the last checkpoint and costs restart_s."""
    t, saved, i = 0.0, 0.0, 0
    while saved < work_s:
        chunk = min(interval_s, work_s - saved)
        need = chunk + (ckpt_s if saved + chunk < work_s else 0.0)  # no checkpoint after the last chunk
        while i < len(failures) and failures[i] < t:
            i += 1  # failures while restarting are absorbed by the restart
        if i < len(failures) and failures[i] < t + need:
            t, i = failures[i] + restart_s, i + 1
        else:
            t, saved = t + need, saved + chunk
    return t


def interval_sweep(work_s: float, ckpt_s: float, restart_s: float, mtbf_s: float, intervals: list[float],
                   trials: int = 20, seed: int = 0) -> list[dict]:
    """Mean wall time and waste (wall - work) per interval over `trials` seeded failure traces."""
    traces = [failure_trace(mtbf_s, 50 * work_s, seed + k) for k in range(trials)]
    out = []
    for tau in intervals:
        wall = sum(simulate(work_s, tau, ckpt_s, restart_s, tr) for tr in traces) / trials
        out.append({"interval_s": tau, "wall_s": wall, "waste_s": wall - work_s})
    return out


# -- preemption -------------------------------------------------------------------------------------------------
def signal_rank(run, rank: int, after_step: int, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
    """Send `sig` to rank `rank`'s process once it has reported step `after_step`; returns its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = [e for e in run.events() if e["rank"] == rank]
        starts = [e for e in events if e["type"] == "start"]
        if starts and last_steps(events).get(rank, 0) >= after_step:
            os.kill(starts[-1]["pid"], sig)
            return starts[-1]["pid"]
        if run.status not in ("pending", "running"):
            break
        time.sleep(0.05)
    raise TimeoutError(f"rank {rank} did not reach step {after_step} (run {run.status}) within {timeout:g} s")


def preempt_with_handler(spec, handler: str, rank: int = 1, after_step: int = 5, timeout: float = 300,
                         say=print) -> dict:
    """Preempt a run whose ranks vote with a handler of the student's own, and resume it.

    `handler` is "module:Class" for a module beside the notebook: it is copied into the run's code/ folder (every
    rank imports it from there, and the start event names it with its SHA-256) and named to the ranks by the
    environment variable SCALELAB_PREEMPT_HANDLER (train/preempt.py); `spec` needs checkpoint.on_signal. Rank
    `rank` gets SIGTERM once it has done `after_step` steps; the run should end `preempted`, every rank after the
    same step with an emergency checkpoint of it, and a relaunch (the same handler) resume from there to the end.
    Returns status (the signalled run's), step (rank 0's preempted step, or None), preempted (each rank's step),
    signal_rank0, start_step (the relaunch's), resumed (its status), resumed_losses, code (file: sha256 of the
    start events), run_dir and error (None, or what went wrong: "not implemented yet" for an unsolved exercise)."""
    from ..launch import launch
    from ..train.preempt import HANDLER_ENV
    run_dir = _ship_handler(spec, handler)
    env = {**os.environ, HANDLER_ENV: handler}
    out = {"status": None, "step": None, "preempted": {}, "signal_rank0": None, "start_step": None,
           "resumed": None, "resumed_losses": None, "code": {}, "run_dir": str(run_dir), "error": None}

    run = launch(spec, env=env)
    try:
        signal_rank(run, rank=rank, after_step=after_step, timeout=timeout)
        first = run.wait(timeout=timeout)
        out["status"] = first["status"]
    except (RunFailed, TimeoutError) as e:
        run.stop()
        out.update(status=run.status, error=_handler_error(run, handler) or f"{type(e).__name__}: {str(e)[:300]}")
    events = run.events()
    stops = {e["rank"]: e for e in events if e["type"] == "preempted"}
    out["preempted"] = {str(r): e["step"] for r, e in sorted(stops.items())}
    out["code"] = next((e.get("code") or {} for e in events if e["type"] == "start"), {})
    if 0 in stops:
        out.update(step=stops[0]["step"], signal_rank0=stops[0]["signal"])
    if out["status"] != "preempted":
        say(f"the preempted run ended {out['status']}: {out['error'] or 'no preempted status'}")
        return out
    resumed_run = launch(spec, env=env)
    try:
        resumed = resumed_run.wait(timeout=timeout)
        out.update(resumed=resumed["status"], resumed_losses=resumed["loss_curve"])
    except (RunFailed, TimeoutError) as e:
        resumed_run.stop()
        out.update(resumed=resumed_run.status, error=_handler_error(resumed_run, handler) or f"{type(e).__name__}: {str(e)[:300]}")
    start = [e for e in resumed_run.events() if e["type"] == "start" and e["rank"] == 0]
    out["start_step"] = start[-1]["start_step"] if start else None
    return out


def _ship_handler(spec, handler: str):
    """The handler's module (beside the notebook) copied into the run's code/ folder before the ranks start: they
    import it from there. The run folder."""
    import shutil
    from pathlib import Path

    from ..run.user_code import CODE_DIR
    src = Path(f"{handler.partition(':')[0]}.py")
    if not src.is_file():
        raise FileNotFoundError(f"{src.resolve()}: write the handler's module beside the notebook first")
    run_dir = Path(spec.output_dir).resolve()
    (run_dir / CODE_DIR).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, run_dir / CODE_DIR / src.name)
    return run_dir


def _handler_error(run, handler: str) -> str | None:
    """What the run's error events say: an unsolved exercise, the first rank's error, or None."""
    errs = [e for e in run.events() if e["type"] == "error"]
    if any(e["error"] == "NotImplementedError" for e in errs):
        return f"not implemented yet: {handler} (exercise)"
    return f"rank {errs[0]['rank']}: {errs[0]['error']}: {errs[0]['message'][:200]}" if errs else None


def slurm_preempt(spec, after_step: int, timeout: float = 600) -> dict:
    """Submit `spec` (launcher slurm, checkpoint.on_signal, slurm.requeue) and, once rank 0 has done `after_step`
    steps, signal the batch shell with SIGUSR1 — what `--signal=B:USR1@N` does N seconds before the time limit.
    Waits for the requeued job to finish; returns its attempts (start steps), preemptions, final status and
    Slurm's own count of the job's restarts (`scontrol show job`: Restarts)."""
    from ..cluster.slurm import slurm_command
    from ..launch import launch
    run = launch(spec)
    try:
        deadline = time.monotonic() + timeout
        while last_steps([e for e in run.events() if e["rank"] == 0]).get(0, 0) < after_step:
            if time.monotonic() > deadline or run.status not in ("pending", "running"):
                raise TimeoutError(f"job {run.job_id} did not reach step {after_step} ({run.status})")
            time.sleep(0.2)
        slurm_command(["scancel", "--batch", "--signal=USR1", run.job_id], run.env)
        summary = run.wait(timeout=timeout)
        restarts = int(run.job_info().get("Restarts", 0))  # Slurm keeps a finished job's record for MinJobAge
    finally:
        run.stop()
    events = [e for e in run.events() if e["rank"] == 0]
    return {"job_id": run.job_id, "status": summary["status"], "run_dir": str(run.run_dir), "restarts": restarts,
            "start_steps": [e["start_step"] for e in events if e["type"] == "start"],
            "preempted": [{"step": e["step"], "signal": e["signal"]} for e in events if e["type"] == "preempted"]}


# -- recovery ---------------------------------------------------------------------------------------------------
def recovery(events: list[dict], rank: int = 0) -> dict:
    """From the injected fault to training again on `rank`: training_again_s (the first step finished after the
    failure was handled: a restarted worker's first step, or the survivors' redone step), back_s (until the step
    after the fault is done: redone work included), steps_redone, and how (restart, forward or elastic: Horovod
    elastic's rollback to a commit)."""
    fault = next(e for e in events if e["type"] == "fault")
    mine = [e for e in events if e["rank"] == rank and e["t"] > fault["t"]]
    resumed = [e for e in mine if e["type"] in ("start", "recovered")]
    how = ("elastic" if any(e.get("mode") == "elastic" for e in resumed if e["type"] == "recovered") else "forward"
           if any(e["type"] == "recovered" for e in resumed) else "restart" if resumed else "none")
    after = resumed[-1]["t"] if resumed else fault["t"]
    steps = [e for e in mine if e["type"] == "step" and e["t"] > after]
    start = next((e for e in resumed if e["type"] == "start"), None)
    rolled = next((e for e in resumed if e["type"] == "recovered"), {})  # Horovod elastic: back to a commit
    redone = fault["step"] - start["start_step"] if start else rolled.get("rolled_back_steps", 0)
    back = next((e for e in steps if e["step"] > fault["step"]), None)
    return {"how": how, "fault_step": fault["step"], "steps_redone": redone,
            "training_again_s": steps[0]["t"] - fault["t"] if steps else None,
            "back_s": back["t"] - fault["t"] if back else None}


def timeline_rows(events: list[dict]) -> dict[int, dict]:
    """Per rank, on the run's clock (seconds since its first event): step bars (start, length), and the moments of
    faults, errors (detection), recoveries (restart or re-formed group), preemptions and ends."""
    t0 = min(e["t"] for e in events)
    rows: dict[int, dict] = {}
    for e in events:
        row = rows.setdefault(e["rank"], {"steps": [], "fault": [], "error": [], "recovered": [], "start": [],
                                          "preempted": [], "end": []})
        t = e["t"] - t0
        if e["type"] == "step":
            row["steps"].append((t - e["step_s"], e["step_s"]))
        elif e["type"] in row:
            row[e["type"]].append(t)
    return dict(sorted(rows.items()))


__all__ = ["fault_run", "last_steps", "checkpoint_cost", "young_interval", "daly_interval", "failure_trace",
           "simulate", "interval_sweep", "signal_rank", "preempt_with_handler", "slurm_preempt", "recovery",
           "timeline_rows", "read_manifest"]
