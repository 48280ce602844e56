"""The capstone's class leaderboard, from the grader's own results.

A lab whose hidden checks define `standing(records) -> dict` (the capstone, labs/12_capstone) gets that dict in
every student's `results/<student>.json` as "standing" (grade/grader.py): what the grader measured itself —

    ranked            whether the run counts on the board (its checkpoints were re-evaluated by the grader on the
                      held-out set, its events are a real run's, it kept to the budget)
    why               when not ranked, why (for the student and the instructor)
    time_to_target_s  seconds from the run's first start to the first checkpoint whose held-out accuracy (the
                      grader's evaluation) reached the target; None when none did
    accuracy          the grader's held-out accuracy of the run's last checkpoint
    target            the target accuracy
    rank_seconds      ranks x wall seconds the run used (all its launches, restarts included)
    budget_rank_s     the budget
    lost_s            seconds the injected failure cost (the kill to the step the run had reached again), or None
    choices           what the student chose (batch, optimizer, strategy, layout, data format, checkpoint interval)

`standings(lab_out)` orders a lab's results into the board: ranked runs that reached the target by time to target
(then fewer rank-seconds), then ranked runs that did not (by accuracy), then the unranked. `pseudonym` names a
student on a board students may see. Results files are the grader's own (root's) output, not a student's.
"""
from __future__ import annotations

import hashlib
import hmac
import math
from pathlib import Path

from .report import load_results

ADJECTIVES = ("amber", "brisk", "calm", "deft", "eager", "fleet", "gentle", "hardy", "keen", "lucid", "merry",
              "nimble", "plucky", "quiet", "rapid", "steady", "swift", "tidy", "vivid", "wry")
NOUNS = ("badger", "condor", "dolphin", "falcon", "gecko", "heron", "ibis", "jaguar", "koala", "lynx", "marten",
         "narwhal", "otter", "puffin", "quokka", "raven", "stoat", "tapir", "vole", "wombat")


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) else None


def standings(lab_out: str | Path) -> list[dict]:
    """The board of one graded lab folder (`scalelab grade --out`: results/*.json): one row per graded student with
    a standing, best first; `place` is 1, 2, ... for ranked rows that reached the target, None for the others."""
    rows = []
    for result in load_results(Path(lab_out)):
        s = result.get("standing")
        if not isinstance(s, dict):
            continue
        row = {"student": str(result.get("student", "")), "ranked": bool(s.get("ranked")),
               "why": str(s.get("why") or ""), "choices": s.get("choices") if isinstance(s.get("choices"), dict)
               else {}, "graded_at": result.get("graded_at")}
        for key in ("time_to_target_s", "accuracy", "target", "rank_seconds", "budget_rank_s", "lost_s"):
            row[key] = _number(s.get(key))
        rows.append(row)

    def order(row):
        if not row["ranked"]:
            return (2, 0.0, 0.0, row["student"])
        if row["time_to_target_s"] is None:
            return (1, -(row["accuracy"] or 0.0), row["rank_seconds"] or 0.0, row["student"])
        return (0, row["time_to_target_s"], row["rank_seconds"] or 0.0, row["student"])

    rows.sort(key=order)
    place = 0
    for row in rows:
        reached = row["ranked"] and row["time_to_target_s"] is not None
        place += reached
        row["place"] = place if reached else None
    return rows


def place(standing, records: dict) -> dict:
    """The lab's standing of one submission (its hidden checks' GRADER_HOOKS["standing"], a function of the records
    the checks ran on); a crash of it leaves the submission unranked with the reason, never touches the grade."""
    from .checks import Records
    try:
        found = standing(Records(records))
        if not isinstance(found, dict):
            raise TypeError(f"standing returned {type(found).__name__}, not a dict")
        return found
    except Exception as e:  # noqa: BLE001 - the lab's code on the student's values
        return {"ranked": False, "why": f"the grader could not place this submission ({type(e).__name__}: "
                                        f"{str(e)[:200]})"}


def measure(scored: dict, target: float) -> dict:
    """The board's measures of one run from the grader's scoring of it (records["grader.heldout"][run]: held-out
    accuracy per checkpoint step and of the final weights, the run's timeline from its events):

    time_to_target_s  first (by time) scored checkpoint at or above `target`, seconds after the run's first start
                      (a checkpoint counts at the time rank 0's event says it was written; "final" at the end event)
    accuracy          the final weights' held-out accuracy (else the last checkpoint's)
    rank_seconds      sum over launches of world size x (the next launch's start, or its own last event - start):
                      the ranks are held through a restart too
    lost_s            per restart: from the last step the dying launch logged to the time the next launch logged
                      that step again (its restart and the steps it repeated), summed; None without a restart
    """
    acc = scored.get("accuracy") or {}
    tl = scored.get("timeline") or {}
    launches = [x for x in tl.get("launches") or [] if isinstance(x.get("t_start"), (int, float))]
    t0 = min((x["t_start"] for x in launches), default=None)
    when = dict(tl.get("checkpoints") or {})
    if isinstance(tl.get("t_end"), (int, float)):
        when["final"] = tl["t_end"]
    hits = [when[s] - t0 for s, a in acc.items() if s in when and t0 is not None and _number(a) is not None
            and a >= target]
    steps = sorted(int(s) for s in acc if s.isdigit())
    final = _number(acc.get("final"))
    if final is None and steps:
        final = _number(acc.get(str(steps[-1])))
    ends = [after["t_start"] for after in launches[1:]] + [launches[-1].get("t_last") if launches else None]
    rank_s = sum((x.get("world_size") or 0) * max(0.0, (end or x["t_start"]) - x["t_start"])
                 for x, end in zip(launches, ends))  # a restart's gap holds the ranks too
    lost = None
    for before, after in zip(launches, launches[1:]):
        last = before.get("last_step")
        t_last = (before.get("step_t") or {}).get(str(last))
        if last is None or t_last is None:
            continue
        again = (after.get("step_t") or {}).get(str(last)) or after.get("t_last")
        if isinstance(again, (int, float)):
            lost = (lost or 0.0) + max(0.0, again - t_last)
    return {"time_to_target_s": min(hits) if hits else None, "accuracy": final, "rank_seconds": rank_s,
            "lost_s": lost, "restarts": max(0, len(launches) - 1)}


def pseudonym(student: str, key: bytes) -> str:
    """A stable, unguessable name for `student` on a board students see (an HMAC of the name with the course's
    secret `key`): "swift-otter-3f". The same key gives the same name on the dashboard and the site."""
    digest = hmac.new(key, student.encode("utf-8"), hashlib.sha256).digest()
    return f"{ADJECTIVES[digest[0] % len(ADJECTIVES)]}-{NOUNS[digest[1] % len(NOUNS)]}-{digest[2:4].hex()[:3]}"


__all__ = ["standings", "place", "measure", "pseudonym"]
