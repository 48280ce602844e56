"""The grader measures a run's result itself: its checkpoints scored on a held-out set the student never saw.

A lab whose hidden checks define `GRADER_HOOKS = {"heldout": {...}}` (the capstone, labs/12_capstone) names a
held-out set — a seeded data set of the engine's whose seed lives only in the hidden checks, never in a student's
copy or a grading's working copy — and the challenge's fixed model. After the notebook's run (and re-verification)
the grader

1. picks the runs to score (`plan`): every plausible run of this grading that kept a checkpoint manifest, newest
   first, at most MAX_RUNS;
2. scores them in a fresh sandbox, as the submission's throwaway user, when the notebook's processes are all gone:
   the runner (`score_in_sandbox`) starts `python -m scalelab.train.heldout` in an empty folder, which loads each
   listed checkpoint (checksums verified, weights_only) into a freshly built model of the challenge's shape and
   scores it on the held-out set;
3. adds `grader.heldout` to the records: per run, the held-out accuracy of each checkpoint and the run's timeline
   read from its event files (`timeline`: when each launch started and last wrote, rank 0's checkpoint times, the
   faults its events report), so checks and the lab's `standing` stay functions of the records.

What it protects: the accuracy that ranks a run is the grader's, measured on data the student's code never had,
on weights the run itself checkpointed; a record or an event claiming an accuracy counts for nothing against it.
What it does not: a run trained on more data than the challenge hands out (the data set's generator is the
engine's own, so a student may draw more samples); the lab's budget check limits what that buys.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .evidence import PREFIX, RUNS, MAX_EVENT_BYTES, RANK_FILE, _launches, _read_events
from .untrusted import cap_text, load_json_beneath

HELDOUT = PREFIX + "heldout"
"""records[HELDOUT]: {run key: {"accuracy": {step: accuracy}, "error": str, "timeline": {...}}}."""
HELDOUT_DIR = "heldout"
"""In the job folder: the scoring's request, its empty working folder and its answer."""
MAX_RUNS = 4


def plan(workdir: Path, job: Path, runs: dict, heldout: dict) -> list[dict]:
    """The scoring to do: one job item naming the held-out set and the runs (newest first, at most MAX_RUNS)."""
    keys = [k for k, s in runs.items() if isinstance(s, dict) and not s.get("implausible")
            and (workdir / k / "checkpoints" / "manifest.json").is_file()
            and not (workdir / k / "checkpoints").is_symlink()]
    keys.sort(key=lambda k: -(runs[k].get("t_end") or 0))
    if not keys:
        return []
    folder = job / HELDOUT_DIR
    return [{"key": HELDOUT, "heldout": heldout, "cwd": str(folder / "cwd"), "answer": str(folder / "answer.json"),
             "runs": [{"key": k, "checkpoints": str(workdir / k / "checkpoints")} for k in keys[:MAX_RUNS]]}]


# -- in the sandbox (the runner's confined process, as the submission's uid) -----------------------------------

def score_in_sandbox(item: dict, left: float) -> str | None:
    """Run the scorer on the item; None when it answered, else what went wrong."""
    cwd = Path(item["cwd"])
    cwd.mkdir(parents=True, exist_ok=True)  # empty: no module of the student's can shadow the scorer's imports
    request = cwd.parent / "request.json"
    request.write_text(json.dumps({"heldout": item["heldout"], "runs": item["runs"]}))
    cmd = [sys.executable, "-P", "-m", "scalelab.train.heldout", str(request), item["answer"]]
    try:
        proc = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=left)
    except subprocess.TimeoutExpired:
        return f"scoring the checkpoints passed the grader's time ({left:.0f} s)"
    finally:
        request.unlink(missing_ok=True)  # the held-out seed leaves the job folder with the scoring
    if proc.returncode:
        return f"the scorer exited {proc.returncode}: {proc.stdout.decode('utf-8', 'replace')[-300:]}"
    return None


# -- back in the grader ---------------------------------------------------------------------------------------

def timeline(workdir: Path, key: str) -> dict:
    """What the event files say of a run's course in time: launches (start, last event, first and last step,
    world size, {step: time}), rank 0's checkpoints {step: time}, its end event's time (t_end: when the final
    weights were there), the accuracy it reported on its own validation split ({step or "final": accuracy}: its
    eval events and its end event), the rate of every step ({step: lr}, every launch) and the faults any rank
    reported ({rank, kind, step, t, source}). Read as untrusted data; the run's plausibility was checked by evidence.run_evidence."""
    events_dir = Path(key) / "events"
    try:
        names = sorted(n for n in os.listdir(workdir / events_dir) if RANK_FILE.fullmatch(n))
    except OSError:
        return {}
    files, _ = _read_events(workdir, events_dir, names, MAX_EVENT_BYTES)
    out: dict = {"launches": [], "checkpoints": {}, "evals": {}, "lrs": {}, "faults": []}
    for rank, evs in sorted(files.items()):
        for e in evs:
            if e.get("type") in ("fault", "preempted") and isinstance(e.get("t"), (int, float)):
                out["faults"].append({"rank": rank, "kind": e.get("kind") or e.get("type"), "step": e.get("step"),
                                      "t": e["t"], "source": e.get("source", "spec")})
        if rank != 0:
            continue
        ends = [e for e in evs if e.get("type") == "end" and isinstance(e.get("t"), (int, float))]
        out["t_end"] = ends[-1]["t"] if ends else None
        for e in evs:  # the accuracy the run itself reported, at each step it evaluated and at its end
            if e.get("type") == "eval" and isinstance(e.get("step"), int) and \
                    isinstance(e.get("accuracy"), (int, float)):
                out["evals"][str(e["step"])] = e["accuracy"]
        if ends and isinstance(ends[-1].get("eval_accuracy"), (int, float)):
            out["evals"]["final"] = ends[-1]["eval_accuracy"]
        for launch in _launches(evs):
            steps = [e for e in launch if e.get("type") == "step" and isinstance(e.get("step"), int)]
            times = [e["t"] for e in launch if isinstance(e.get("t"), (int, float))]
            start = launch[0] if launch and launch[0].get("type") == "start" else {}
            out["launches"].append({"t_start": times[0] if times else None, "t_last": times[-1] if times else None,
                                    "start_step": start.get("start_step"), "world_size": start.get("world_size"),
                                    "first_step": steps[0]["step"] if steps else None,
                                    "last_step": steps[-1]["step"] if steps else None,
                                    "step_t": {str(e["step"]): e["t"] for e in steps if
                                               isinstance(e.get("t"), (int, float))}})
            out["lrs"].update({str(e["step"]): e["lr"] for e in steps if isinstance(e.get("lr"), (int, float))})
            for e in launch:
                if e.get("type") == "checkpoint" and isinstance(e.get("step"), int) and \
                        isinstance(e.get("t"), (int, float)):
                    out["checkpoints"][str(e["step"])] = e["t"]
    return out


def hold(heldout: dict, job: Path, records: dict, result, score: Callable[[list[dict]], dict],
         log: Callable[[str], None]) -> bool:
    """Score the runs' checkpoints on the held-out set (with `score`, the runner in a fresh sandbox) and put what
    was measured in records[HELDOUT]; notes for the student in `result.notes`. Returns whether anything was added,
    so the checks run again."""
    runs = records.get(RUNS)
    if not isinstance(runs, dict):
        return False
    items = plan(job / "work", job, runs, heldout)
    if not items:
        return False
    t0 = time.monotonic()
    outcome = score(items)
    took = time.monotonic() - t0
    done = {d.get("key"): d for d in outcome.get("reruns", []) if isinstance(d, dict)} \
        if isinstance(outcome.get("reruns"), list) else {}
    error = done.get(HELDOUT, {}).get("error") if HELDOUT in done else \
        f"the scorer did not report ({cap_text(str(outcome.get('status')), 40)})"
    answer: dict = {}
    if not error:
        try:
            answer = load_json_beneath(job / HELDOUT_DIR, Path("answer.json"), 2**20)
        except Exception as e:  # noqa: BLE001 - written in the sandbox: the grader's own scorer, but its folder
            error = f"its answer could not be read: {e}"
    scored = answer.get("runs") if isinstance(answer, dict) and isinstance(answer.get("runs"), dict) else {}
    found = {}
    for run in items[0]["runs"]:
        key = run["key"]
        got = scored.get(key) if isinstance(scored.get(key), dict) else {"error": error or "not scored"}
        acc = got.get("accuracy") if isinstance(got.get("accuracy"), dict) else {}
        found[key] = {"accuracy": {str(s): float(a) for s, a in acc.items() if isinstance(a, (int, float))},
                      "error": cap_text(str(got.get("error") or ""), 400),
                      "timeline": timeline(job / "work", key)}
    records[HELDOUT] = found
    log(f"scored the checkpoints of {sorted(found)} on the held-out set in {took:.1f} s"
        + (f": {error}" if error else ""))
    result.notes.append(f"the grader scored the checkpoints of {len(found)} run(s) on its held-out set itself "
                        f"({took:.0f} s)" + ("" if not error else f"; scoring failed: {cap_text(error, 200)}"))
    return True


__all__ = ["HELDOUT", "plan", "score_in_sandbox", "timeline", "hold"]
