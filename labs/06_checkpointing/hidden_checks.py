"""Lab 06 hidden checks: the engine runs against their event files; answers recomputed from other records.

Every training run of this lab writes events: the mode comparison, the resume, the retention run and the chain
of time-limited attempts are held against them. The anatomy demo and the checksum are file operations in the
notebook's process, held against each other only. The kill test of the student's save and restore (exercises 2 and
3) is judged again from the files it left in the working copy: the folder as the kill left it (after-kill/), the
planted folder, and each process's log (losses, state digests, what each restore loaded, the save's file
operations), re-read with `kill_resume.verdict`. Every check needs a real run (`needs_run`).
"""
import hashlib
import math
import re

from scalelab.ckpt.retention import select
from scalelab.experiments.kill_resume import reader_beneath, verdict
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import RUNS, WORKDIR
from scalelab.paths import read_beneath


def _kill_verdict(r) -> dict:
    """The kill test's verdict worked out again from its files in the working copy, after checking that the
    processes ran the submitted my_ckpt.py; the recorded flags must agree with it."""
    r[RUNS]  # no grader evidence, no verdict (a notebook that ran nothing ends here as missing)
    k, work = r["kill_test"], r[WORKDIR]
    try:
        v = verdict(reader_beneath(work, k["run_dir"]))
    except Exception as e:  # noqa: BLE001 - missing, a link, too big, not a log: all the student's files
        raise AssertionError(f"the kill test's files could not be read ({type(e).__name__}: {e})") from None
    try:
        sha = hashlib.sha256(read_beneath(work, "my_ckpt.py", 1 << 20)).hexdigest()
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"my_ckpt.py could not be read from the submission ({e})") from None
    assert v["code"].get("my_ckpt.py") == sha, f"the kill test did not run the submitted my_ckpt.py ({v['code']})"
    for part in ("save", "restore", "resume"):
        assert k[f"{part}_ok"] == v[f"{part}_ok"], f"kill_test {part}_ok is not what the test's files show"
    return v


@check(points=4, needs_run=True)
def kill_leaves_no_partial_checkpoint(r):
    """Exercise 2, from the files: the crash run's log shows its save of step 12 begun and the process killed by
    SIGXFSZ inside it; in the folder as the kill left it, every file under a checkpoint's name is listed in the
    manifest with the checksum of its bytes, and every finished save is listed; the log of each finished save shows
    a temporary file in the folder fsynced, renamed into place, the folder fsynced, then the manifest the same way."""
    v = _kill_verdict(r)
    assert not v["save_problems"], "; ".join(v["save_problems"])


@check(points=4, needs_run=True)
def restore_loads_only_intact_checkpoints(r):
    """Exercise 3, from the files: in the planted folder (newest listed checkpoint corrupted, an unlisted half-written
    one beside it) the restore loaded only bytes of the newest intact checkpoint, step 4, its state digest (weights,
    momentum, RNG) equal to the uninterrupted run's at step 4, and every later loss and the final state equal."""
    v = _kill_verdict(r)
    assert not v["restore_problems"], "; ".join(v["restore_problems"])


@check(points=4, needs_run=True)
def resumed_after_the_kill_equals_the_whole_run(r):
    """Exercises 2 and 3, from the files: a fresh process restored what the kill left at step 8 (the newest finished
    save), and from there computed the uninterrupted run's losses and final state bit for bit."""
    v = _kill_verdict(r)
    assert not v["resume_problems"], "; ".join(v["resume_problems"])


@check(points=0.5, needs_run=True)
def modes_are_the_engine_runs(r):
    """Each mode's checkpoints and blocked time are what its run's event files show, for the recorded workers."""
    dirs, workers = r["mode_run_dirs"], r["lab06_params"]["workers"]
    assert set(dirs) == set(r["modes"]), f"run dirs recorded for {sorted(dirs)}, modes for {sorted(r['modes'])}"
    for mode, s in r["modes"].items():
        found = evidence(r, dirs[mode], total_steps="steps")
        assert found["world_size"] == workers, f"{mode}: {found['world_size']} ranks ran, {workers} recorded"
        assert found["checkpoints"] == s["checkpoints"], f"{mode}: {s['checkpoints']} checkpoints recorded, " \
                                                         f"{found['checkpoints']} in the events"
        close(found["blocked_s"], s["blocked_s"], rel=1e-4, what=f"{mode} blocked_s")


@check(points=0.5, needs_run=True)
def resume_is_the_engine_runs(r):
    """The uninterrupted and the resumed loss curves, and the resume step, are what the runs' events show."""
    res = r["resume"]
    whole = evidence(r, res["whole_run_dir"], total_steps="resume_steps")
    resumed = evidence(r, res["resumed_run_dir"], total_steps="resume_steps")
    assert whole["loss_curve"] == res["whole_losses"], "whole_losses are not the uninterrupted run's"
    assert resumed["loss_curve"] == res["resumed_losses"], "resumed_losses are not the resumed launch's"
    assert resumed["launches"] == 2 and resumed["start_step"] == res["start_step"], \
        f"the resumed run's events show {resumed['launches']} launches, the last from step {resumed['start_step']}"


@check(points=0.5, needs_run=True)
def engine_history_is_the_run(r):
    """The retention run's checkpoint history is what its events show."""
    found = evidence(r, r["keep_run_dir"])
    assert found["checkpoint_history"] == r["engine_history"], "engine_history is not the run's checkpoints"


@check(points=0.5, needs_run=True)
def chain_is_the_engine_run(r):
    """The chained run's events show a launch for every attempt that started training (one cut off before its
    first step, a slow start under load, may leave none), no more than the recorded attempts, and the last one
    reaching the grader's slice_steps."""
    sl, steps = r["slices"], r["lab06_params"]["slice_steps"]
    found = evidence(r, sl["run_dir"], total_steps="slice_steps")
    started = sum(a["start_step"] is not None for a in sl["attempts"])
    assert max(1, started) <= found["launches"] <= len(sl["attempts"]), \
        f"{found['launches']} launches in the events, {started} of {len(sl['attempts'])} recorded attempts started"
    assert found["steps"] == steps, f"the chained run's events end at step {found['steps']}, not {steps}"


@check(points=2, needs_run=True)
def stall_ratio_follows_from_the_modes(r):
    """stall_ratio is async blocked_s over sync blocked_s; least_blocking is the smallest blocked_s."""
    m = r["modes"]
    assert math.isclose(r["stall_ratio"], m["async"]["blocked_s"] / m["sync"]["blocked_s"], rel_tol=1e-9)
    assert r["least_blocking"] == min(m, key=lambda k: m[k]["blocked_s"])


@check(points=1, needs_run=True)
def checksum_is_a_crc32(r):
    """my_checksum has the manifest's format: crc32 and eight hex digits."""
    assert re.fullmatch(r"crc32:[0-9a-f]{8}", r["my_checksum"] or ""), f"{r['my_checksum']!r}"


@check(points=2, needs_run=True)
def resume_records_agree(r):
    """The recorded loss curves agree with losses_equal, and the resume started at the last checkpoint before
    the stop (no checkpoint is written at a run's final step)."""
    res, p = r["resume"], r["lab06_params"]
    tail = res["whole_losses"][res["start_step"]:]
    assert (res["resumed_losses"] == tail) == r["losses_equal"], "losses_equal contradicts the recorded curves"
    assert res["start_step"] == p["every"] * ((p["stop_after"] - 1) // p["every"]), "unexpected resume step"
    assert len(res["whole_losses"]) == p["resume_steps"]


@check(points=0.5, needs_run=True)
def engine_retention_follows_the_rule(r):
    """The engine kept the newest 2 and the best 1 of its recorded checkpoint history."""
    kept, _ = select(r["engine_history"], keep_last=2, keep_best=1)
    assert r["kept_by_engine"] == [e["step"] for e in kept]


@check(points=2, needs_run=True)
def my_kept_by_hand(r):
    """my_kept recomputed without the library: the newest two and the two lowest metrics."""
    h = r["retention_history"]
    newest = {e["step"] for e in sorted(h, key=lambda e: e["step"])[-2:]}
    lowest = {e["step"] for e in sorted(h, key=lambda e: e["metric"])[:2]}
    assert r["my_kept"] == sorted(newest | lowest)


@check(points=0.5, needs_run=True)
def attempts_resume_where_the_last_stopped(r):
    """Each attempt starts at a checkpoint step no later than where the previous attempt got to."""
    attempts, every = r["slices"]["attempts"], r["lab06_params"]["every"]
    started = [a for a in attempts if a["start_step"] is not None]  # one lost at start-up (failed) has none
    assert started and started[0]["start_step"] == 0
    reached = 0  # an attempt cut off before its first step (a slow start) reaches nothing new
    for prev, cur in zip(attempts, attempts[1:]):
        reached = max(reached, prev["last_step"] or 0)
        if cur["start_step"] is None:
            continue
        assert cur["start_step"] % every == 0 and cur["start_step"] <= reached, cur
    assert attempts[-1]["last_step"] == r["lab06_params"]["slice_steps"]
