"""Lab 06 hidden checks: recompute answers from other records (a forged number rarely fits them all)."""
import math
import re

from scalelab.ckpt.retention import select
from scalelab.grade.checks import check


@check(points=2)
def stall_ratio_follows_from_the_modes(r):
    """stall_ratio is async blocked_s over sync blocked_s; least_blocking is the smallest blocked_s."""
    m = r["modes"]
    assert math.isclose(r["stall_ratio"], m["async"]["blocked_s"] / m["sync"]["blocked_s"], rel_tol=1e-9)
    assert r["least_blocking"] == min(m, key=lambda k: m[k]["blocked_s"])


@check(points=1)
def checksum_is_a_crc32(r):
    """my_checksum has the manifest's format: crc32 and eight hex digits."""
    assert re.fullmatch(r"crc32:[0-9a-f]{8}", r["my_checksum"] or ""), f"{r['my_checksum']!r}"


@check(points=2)
def resume_records_agree(r):
    """The recorded loss curves agree with losses_equal, and the resume started at the last checkpoint before
    the stop (no checkpoint is written at a run's final step)."""
    res, p = r["resume"], r["lab06_params"]
    tail = res["whole_losses"][res["start_step"]:]
    assert (res["resumed_losses"] == tail) == r["losses_equal"], "losses_equal contradicts the recorded curves"
    assert res["start_step"] == p["every"] * ((p["stop_after"] - 1) // p["every"]), "unexpected resume step"
    assert len(res["whole_losses"]) == p["resume_steps"]


@check(points=2)
def engine_retention_follows_the_rule(r):
    """The engine kept the newest 2 and the best 1 of its recorded checkpoint history."""
    kept, _ = select(r["engine_history"], keep_last=2, keep_best=1)
    assert r["kept_by_engine"] == [e["step"] for e in kept]


@check(points=2)
def my_kept_by_hand(r):
    """my_kept recomputed without the library: the newest two and the two lowest metrics."""
    h = r["retention_history"]
    newest = {e["step"] for e in sorted(h, key=lambda e: e["step"])[-2:]}
    lowest = {e["step"] for e in sorted(h, key=lambda e: e["metric"])[:2]}
    assert r["my_kept"] == sorted(newest | lowest)


@check(points=1)
def attempts_resume_where_the_last_stopped(r):
    """Each attempt starts at a checkpoint step no later than where the previous attempt got to."""
    attempts, every = r["slices"]["attempts"], r["lab06_params"]["every"]
    assert attempts[0]["start_step"] == 0
    reached = 0  # an attempt cut off before its first step (a slow start) reaches nothing new
    for prev, cur in zip(attempts, attempts[1:]):
        reached = max(reached, prev["last_step"] or 0)
        assert cur["start_step"] % every == 0 and cur["start_step"] <= reached, cur
    assert attempts[-1]["last_step"] == r["lab06_params"]["slice_steps"]
