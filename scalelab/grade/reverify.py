"""Re-verification by execution: the grader re-runs a sample of a submission's engine runs itself.

Event files are written by processes the student's code controls, so a run's files looking right proves little:
events can be written by hand, paced like a real run, or copied from a classmate and re-stamped. What they cannot
do is agree with a run they never saw. Every run launched while a submission is graded inherits the grading's
nonce (run/nonce.py), which the engine mixes into the seed of the model's initial weights and writes in each start
event. After the notebook's run the grader

1. picks the runs behind the submission's points (the run folders the checks that scored read through
   `checks.evidence`, and every plausible run once a check gated on a real run scored: any of them opened the
   gate) that it can re-run here (`eligible`: an engine run of one launch from step 0, its spec.json
   agreeing with its last start event);
2. draws `reverify_runs` of them at random (the student cannot know which);
3. re-runs each in the sandbox, as the submission's throwaway user, outside the notebook's process, with the same
   nonce, the run's own code of the student's (its `code/` folder) and the spec it recorded, for its first
   `reverify_steps` steps (`rerun_all`, called by the runner);
4. holds the run's step losses, rank by rank, to the re-run's (`compare`: deterministic training gives equal
   losses up to float noise; another nonce, another initialisation, gives others).

A run whose losses differ was not made by this grading's notebook: every run of the submission then counts for
nothing (one forged run puts all its files in doubt) and the note says which run and by how much. A re-run that
cannot run (its code raises, the time runs out) withholds only that run's points.

Limits (docs/grading.md): only the sampled runs are re-run; code of the student's own that a run imports (a comm
hook, a schedule) runs in the re-run too and could tamper with it; measurements made in the notebook's own process
and SPMD experiments are not re-run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import SpecError, UntrustedFileError
from .evidence import RUNS
from .untrusted import cap_text, load_json_beneath

REVERIFY_DIR = "reverify"
"""In the job folder, beside work/: one folder per re-run (r0, r1 ...)."""
LOSS_REL_TOL = 1e-5
"""Same spec, same nonce, same thread count: the losses agree to float noise (gloo sums in a fixed order); another
initialisation differs far more than this from the first step on."""
LOSS_ABS_TOL = 1e-7
MAX_RERUN_STEPS = 20
"""A run that logs a loss every `log_every` steps is re-run up to its first logged step (re-runs log every step), at
most this many steps; a run that logs none of them cannot be verified and its points are withheld."""
MAX_WORLD = 8
MAX_SPEC_BYTES = 2**20


def runs_behind_points(results, reads: dict[str, list[str]], runs: dict, gated: set[str] = frozenset()) -> list[str]:
    """The run keys behind the submission's points, in a stable order: those that the checks which scored read
    through `checks.evidence`, then — when a check named in `gated` (declared needs_run) scored — every plausible run,
    since any of them opened that gate (`checks.made_runs`)."""
    keys: dict[str, None] = {}
    for r in results:
        if r.points > 0:
            keys.update((k, None) for k in reads.get(r.name, []) if k in runs)
    if any(r.points > 0 and r.name in gated for r in results):
        keys.update((k, None) for k, v in runs.items() if isinstance(v, dict) and not v.get("implausible"))
    return list(keys)


def eligible(workdir: Path, key: str, summary: dict) -> tuple[Any, str, bool]:
    """(the spec to re-run, "", False) for a run the grader can re-run; else (None, why not, whether that makes the
    run's files untrustworthy: an engine run always leaves a spec.json that agrees with its last start event)."""
    first = summary.get("first_start") or {}
    if not os.path.lexists(workdir / key / "spec.json"):
        if first.get("strategy") == "single":  # an experiment of the notebook's own process (own_step.py)
            return None, "a run in the notebook's own process is not re-run", False
        return None, "it has no spec.json, which every engine run writes", True
    if first.get("elastic"):
        return None, "elastic Horovod runs are not re-run", False
    if first.get("start_step") not in (0, None):
        return None, "its first launch resumed from another run's checkpoint", False
    try:
        data = load_json_beneath(workdir, Path(key) / "spec.json", MAX_SPEC_BYTES)
        from ..run.spec import from_dict
        spec = from_dict(data)
        spec.validate()
    except (UntrustedFileError, OSError, ValueError, TypeError, KeyError, RecursionError, SpecError) as e:
        return None, f"its spec.json cannot be read ({type(e).__name__})", True
    total = spec.steps if not spec.epochs else summary.get("total_steps")
    said = {"strategy": spec.strategy, "world_size": spec.world_size, "global_batch": spec.global_batch,
            "total_steps": total}
    for name, value in said.items():  # spec.json is written at each launch: it describes the last one
        if summary.get(name) != value:
            return None, f"its spec.json says {name}={value!r}, its last start event {summary.get(name)!r}", True
    for name in ("strategy", "world_size", "global_batch"):  # the re-run repeats the first launch
        if first.get(name) != said[name]:
            return None, f"its first launch ran with {name}={first.get(name)!r}, its last with {said[name]!r}", False
    if first.get("total_steps") != total:
        if spec.epochs or not isinstance(first.get("total_steps"), int):
            return None, "its first launch ran a different number of steps", False
        spec = spec.replace(steps=first["total_steps"])  # a run extended on resume: the first launch's schedule
    if spec.world_size > MAX_WORLD or spec.backend == "mpi":
        return None, f"{spec.world_size} ranks / backend {spec.backend} are not re-run here", False
    return spec, "", False


def rerun_spec(spec, workdir: Path, out_dir: Path, threads: Any, steps: int):
    """The spec of the grader's re-run: the run's own, on this machine's local launcher, every rank here, with the
    run's thread count (the same float sums), its output in `out_dir`, no fault, checkpoint or profile, a step
    event every step, its data read from the file system (no storage server, no simulated slowness)."""
    from ..run.field_groups import CheckpointSpec, FaultSpec, ProfileSpec, SlurmSpec
    world = dataclasses.replace(spec.world, nodes=1, workers_per_node=spec.world_size, max_restarts=0,
                                threads_per_worker=threads if isinstance(threads, int) and threads > 0
                                else spec.world.threads_per_worker)
    # the same bytes straight from the file system: a storage server the run read through is gone, and simulated
    # latency and bandwidth slow a run without changing a loss
    data = dataclasses.replace(spec.data, server="", open_latency_ms=0.0, read_mb_per_s=0.0)
    if data.path and not os.path.isabs(data.path):
        data = dataclasses.replace(data, path=str(workdir / data.path))
    launcher = spec.launcher if spec.strategy == "horovod" and spec.launcher in ("horovodrun", "mpirun") \
        else "local"  # Horovod's ranks need its own launcher; every other strategy runs the same on local processes
    return spec.replace(launcher=launcher, world=world, data=data, fault=FaultSpec(),
                        checkpoint=CheckpointSpec(every_steps=0, resume=False), profile=ProfileSpec(),
                        slurm=SlurmSpec(), output_dir=str(out_dir), log_every=1), rerun_steps(spec, steps)


def rerun_steps(spec, steps: int) -> int:
    """How many steps the re-run makes: `steps`, or up to the run's first logged step when it logs less often (at
    most MAX_RERUN_STEPS), never past the run's own end (an epoch-based run's end is past any of these)."""
    n = min(max(steps, spec.log_every), max(steps, MAX_RERUN_STEPS))
    return n if spec.epochs else min(n, spec.steps)


def plan(workdir: Path, job: Path, runs: dict, keys: list[str], count: int, steps: int,
         rng: random.Random | None = None) -> tuple[list[dict], list[str], dict[str, str]]:
    """(the re-runs to make: job.json's `reverify` items, notes on runs behind points that are not re-run, {run:
    why its files cannot be trusted} for runs whose spec.json is missing or disagrees with its events)."""
    notes, candidates, bad = [], [], {}
    for key in keys:
        spec, why, untrusted = eligible(workdir, key, runs[key])
        if untrusted:
            bad[key] = why
        elif spec is None:
            notes.append(f"{key}: not re-run ({why})")
        else:
            candidates.append((key, spec))
    chosen = (rng or random.SystemRandom()).sample(candidates, min(count, len(candidates)))
    items = []
    for i, (key, spec) in enumerate(chosen):
        out = job / REVERIFY_DIR / f"r{i}"
        first = runs[key].get("first_start") or {}
        respec, n = rerun_spec(spec, workdir, out, first.get("threads"), steps)
        items.append({"key": key, "spec": respec.to_dict(), "code": str(workdir / key / "code"),
                      "cwd": str(job / REVERIFY_DIR / f"src{i}"), "steps": n})
    return items, notes, bad


# -- in the sandbox (the runner's confined process, as the submission's uid) -----------------------------------

def rerun_all(items: list[dict], nonce: str, timeout_s: float) -> dict:
    """Make each re-run (one after another, inside `timeout_s` together) with `scalelab run`, in its own process
    tree; returns the runner's outcome."""
    deadline = time.monotonic() + timeout_s
    done = []
    for item in items:
        left = deadline - time.monotonic()
        if left <= 1:
            done.append({"key": item["key"], "error": "the grader's time for re-runs ran out before this one"})
            continue
        try:
            if "heldout" in item:  # the grader's scoring of checkpoints on its held-out set (grade/heldout.py)
                from .heldout import score_in_sandbox
                done.append({"key": item["key"], "error": score_in_sandbox(item, left)})
                continue
            done.append({"key": item["key"], "error": _rerun_one(item, nonce, left)})
        except Exception as e:  # noqa: BLE001 - a working copy the student's code arranged: that run's failure only
            done.append({"key": item["key"], "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return {"status": "ok", "message": "", "reruns": done}


def _rerun_one(item: dict, nonce: str, left: float) -> str | None:
    """One re-run with `scalelab run`; None when it succeeded, else what went wrong."""
    from ..run.nonce import NONCE_VAR, REVERIFY_VAR
    env = {**os.environ, NONCE_VAR: nonce, REVERIFY_VAR: str(item["steps"])}
    cwd = Path(item["cwd"])
    cwd.mkdir(parents=True, exist_ok=True)
    code = Path(item["code"])
    if code.is_dir() and not code.is_symlink():  # the code the run ran, not what the folder holds now
        for f in code.glob("*.py"):
            if f.is_file() and not f.is_symlink():
                shutil.copyfile(f, cwd / f.name)
    spec_file = cwd / "rerun-spec.json"
    spec_file.write_text(json.dumps(item["spec"]))
    cmd = [sys.executable, "-m", "scalelab.cli", "run", "--spec", str(spec_file), "--timeout", f"{left:.0f}"]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=left + 10)
    except subprocess.TimeoutExpired:
        return f"the re-run passed the grader's time for re-runs ({left:.0f} s left)"
    tail = proc.stdout.decode("utf-8", "replace")[-300:]
    return None if proc.returncode == 0 else f"the re-run exited {proc.returncode}: {tail}"


# -- back in the grader: compare ----------------------------------------------------------------------------------

def step_losses(base: Path, run_dir: Path) -> dict[int, dict[int, float]]:
    """{rank: {step: loss}} of the first launch in a run folder's event files (read as untrusted data): the one
    that started from step 0, as the re-run does (a resumed run's later launches repeat steps)."""
    from .evidence import _launches, _read_events, RANK_FILE, MAX_EVENT_BYTES
    events = run_dir / "events"
    try:
        names = sorted(n for n in os.listdir(base / events) if RANK_FILE.fullmatch(n))
    except OSError:
        return {}
    files, _ = _read_events(base, events, names, MAX_EVENT_BYTES)
    out = {}
    for rank, evs in files.items():
        launches = _launches(evs)
        first = launches[0] if launches else []
        out[rank] = {e["step"]: e["loss"] for e in first if e.get("type") == "step"
                     and isinstance(e.get("step"), int) and isinstance(e.get("loss"), (int, float))}
    return out


SAME, DIFFERS, UNVERIFIED = "same", "differs", "unverified"


def compare(original: dict[int, dict[int, float]], rerun: dict[int, dict[int, float]],
            steps: int) -> tuple[str, str]:
    """(SAME, "") when the run's losses equal the re-run's for every rank and every step both have up to `steps`;
    (DIFFERS, what differs) when a loss or the set of ranks differs — the run's files were not written by a run of
    this grading; (UNVERIFIED, why) when the two share no logged step, so nothing could be held to anything."""
    if not rerun:
        return UNVERIFIED, "the re-run wrote no step events"
    if sorted(original) != sorted(rerun):
        return DIFFERS, f"the run has ranks {sorted(original)}, the re-run {sorted(rerun)}"
    compared = 0
    for rank in sorted(rerun):
        for step in sorted(s for s in rerun[rank] if s <= steps):
            if step not in original[rank]:
                continue
            a, b = original[rank][step], rerun[rank][step]
            same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=LOSS_REL_TOL, abs_tol=LOSS_ABS_TOL)
            if not same:
                return DIFFERS, f"rank {rank}, step {step}: the run's loss {a:.6g}, the grader's re-run {b:.6g}"
            compared += 1
    if not compared:
        return UNVERIFIED, f"the run logged none of the first {steps} step(s), which the re-run made"
    return SAME, ""


# -- the grader's side, after the notebook: pick, re-run, hold ----------------------------------------------------

def hold(settings, gated: set[str], job: Path, records: dict, result, reads: dict[str, list[str]],
         rerun: Callable[[list[dict]], dict], log: Callable[[str], None]) -> bool:
    """Re-run (with `rerun`, the runner in the sandbox) a sample of the runs behind the submission's points, as
    `settings` (the lab's grading) says, and hold them to it; `gated`: the names of checks declared needs_run.
    Marks the runs that fail as implausible in `records` (all of them when one run's losses differ: its files are
    forged), writes what happened in `result.notes` and the instructor's `log`. Returns whether anything was
    marked, so the checks run again."""
    runs = records.get(RUNS)
    if not isinstance(runs, dict):
        return False
    keys = runs_behind_points(result.checks, reads, runs, gated)
    items, skipped, bad = plan(job / "work", job, runs, keys, settings.reverify_runs, settings.reverify_steps)
    for key, why in bad.items():
        runs[key] = {**runs[key], "implausible": [f"{why}: the grader cannot tell this run from one written by hand"]}
        result.notes.append(f"{key!r}: {why}; its numbers count for nothing")
    if not items:
        if keys and not bad:
            result.notes.append("the grader re-runs a sample of the runs behind your points; none of yours could be "
                                "re-run: " + cap_text("; ".join(skipped), 300))
        return bool(bad)
    t0 = time.monotonic()
    outcome = rerun(items)
    took = time.monotonic() - t0
    log(f"re-ran {[i['key'] for i in items]} in {took:.1f} s")
    done = {d.get("key"): d for d in outcome.get("reruns", []) if isinstance(d, dict)} \
        if isinstance(outcome.get("reruns"), list) else {}
    marked, forged = _judge(items, done, outcome.get("status"), job, runs, result, log, took)
    if forged:
        _flag_all(runs, forged, result, log)
        marked = True
    return marked or bool(bad)


def _judge(items: list[dict], done: dict, status, job: Path, runs: dict, result, log: Callable[[str], None],
           took: float) -> tuple[bool, list[str]]:
    """Each re-run (`done`: the runner's reports by key; `status`: how the re-running ended) against its run: a
    failed or incomparable one marks its run implausible, a verified one is said in `result.notes`. (whether any was
    marked, the runs whose losses differ)"""
    marked, forged = False, []
    for i, item in enumerate(items):
        key, steps = item["key"], item["steps"]
        error = done.get(key, {}).get("error") if key in done else \
            f"the re-run did not report ({cap_text(str(status), 40)})"
        if error:
            runs[key] = {**runs[key], "implausible": ["the grader's re-run of this run failed, so its numbers "
                                                      "count for nothing"]}
            result.notes.append(f"the grader re-ran {key!r} for {steps} step(s) with this grading's seed; the re-run "
                                "failed (its output is in the instructor's log), so that run's points are withheld")
            log(f"{key}: {error}")
            marked = True
            continue
        verdict, why = compare(step_losses(job / "work", Path(key)),
                               step_losses(job, Path(REVERIFY_DIR) / f"r{i}"), steps)
        if verdict == DIFFERS:
            forged.append(f"{key} ({why})")
        elif verdict == UNVERIFIED:
            runs[key] = {**runs[key], "implausible": [f"the grader's re-run of this run could not be held to it "
                                                      f"({why}), so its numbers count for nothing"]}
            result.notes.append(f"the grader re-ran {key!r} for {steps} step(s) with this grading's seed but could not "
                                f"compare: {why}; that run's points are withheld (log a loss at least every "
                                f"{MAX_RERUN_STEPS} steps: log_every)")
            log(f"{key}: unverified: {why}")
            marked = True
        else:
            result.notes.append(f"the grader re-ran {key!r} for {steps} step(s) with this grading's seed: its losses "
                                f"are the run's own (verified; re-running took {took:.0f} s)")
    return marked, forged


def _flag_all(runs: dict, forged: list[str], result, log: Callable[[str], None]) -> None:
    """A run whose losses differ from the grader's re-run: its files were written by hand, so no run's are trusted."""
    why = cap_text("; ".join(forged), 400)
    for key in list(runs):
        if isinstance(runs[key], dict):
            runs[key] = {**runs[key], "implausible": [f"a run of this notebook does not match the grader's re-run "
                                                      f"of it ({why}): no run's event files are trusted"]}
    result.notes.append(f"the grader re-ran runs of this notebook with this grading's seed and got other losses: "
                        f"{why}. Event files that a real run of this notebook did not write count for nothing; "
                        "this submission is flagged for the instructor")
    log(f"FLAGGED: {why}")


__all__ = ["REVERIFY_DIR", "runs_behind_points", "eligible", "plan", "rerun_steps", "rerun_all", "step_losses",
           "compare", "hold"]
