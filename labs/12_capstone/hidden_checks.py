"""Lab 12 hidden checks: the schedule every rank ran is the student's and is right; the run is the challenge's, its
checkpoints were scored by the grader on a held-out set only the grader has (GRADER_HOOKS["heldout"]), the accuracy
it reports is what its weights give, it recovered from the grading's failure, kept to the budget and reached the
target. `standing` places the submission on the class board (grade/leaderboard.py)."""
import math

from scalelab.grade.checks import check, evidence, param, partial
from scalelab.grade.evidence import WORKDIR, relative_run_dir
from scalelab.grade.heldout import HELDOUT
from scalelab.grade.leaderboard import measure

HELDOUT_SET = {"source": "heat", "size": 16, "classes": 4, "samples": 2048, "seed": 730_184_967,
               "model": {"name": "cnn", "width": 16, "depth": 2}}
"""The grader's held-out set (its seed is this file's alone: never in a student's copy, never in a grading's
working copy) and the challenge's model, which the grader builds to load the checkpoints."""
ACCURACY_TOLERANCE = 0.15
"""How far the accuracy a run reports (its own validation split: one fixed set of 512 fields) may lie from the
grader's on the same weights (2048 other fields of the same distribution). Measured on real runs of the reference
choices: up to 0.06 in 120 comparisons (6 seeds x 20 checkpoints) here, 0.104 once in a CI grading (early in
training, where a small fixed set's luck shows most). A run whose checkpoints were swapped for later weights
misses by 0.3 or more at its early checkpoints; hand-written events claiming 0.9 for an untrained model by 0.6."""


def _run(r):
    """(the grader's summary of the capstone run, its key, the grader's scoring of it)."""
    cap, c = r["capstone"], r["choices"]
    found = evidence(r, cap["run_dir"], world_size=c["workers"] * c["nodes"], global_batch=c["global_batch"],
                     total_steps=c["steps"])
    key = relative_run_dir(str(cap["run_dir"]), r.get(WORKDIR))
    scored = (r.get(HELDOUT) or {}).get(key)
    return found, key, scored


def _scored(r):
    found, key, scored = _run(r)
    assert scored, "the grader found no checkpoint of this run to score (checkpoint_every: it keeps every one)"
    acc = scored["accuracy"]
    assert "final" in acc and sum(s.isdigit() for s in acc) >= 2, \
        f"the grader could score {sorted(acc)} of this run ({scored['error'] or 'no error'}): it needs the final " \
        "weights and at least two checkpoints"
    return found, scored


def _lr(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@check(points=4, needs_run=True)
def schedule_is_yours_in_every_step(r):
    """Exercise 1: the run imported my_schedule.py, and the rate of every step in its events is a linear warm-up
    then a cosine decay of the peak rate the choices give."""
    found, _, scored = _run(r)
    c = r["choices"]
    assert c["schedule"] == "my_schedule:lr_at", f"the run used schedule {c['schedule']!r}, not yours"
    assert "my_schedule.py" in (found.get("code") or {}), "the run did not import my_schedule.py"
    scale = {"none": 1.0, "linear": c["global_batch"] / 32, "sqrt": math.sqrt(c["global_batch"] / 32)}
    peak = c["lr"] * scale[c["lr_scaling"]]
    lrs = (scored or {}).get("timeline", {}).get("lrs") or {}  # every launch's steps: the warm-up is in the first
    pairs = sorted((int(s), lr) for s, lr in lrs.items()) or list(zip(found.get("step_numbers") or [],
                                                                      found.get("lr_curve") or []))
    assert len(pairs) >= 10 and pairs[0][0] == 1, f"{len(pairs)} step events with a rate, from step " \
                                                  f"{pairs[0][0] if pairs else None}"
    for step, lr in pairs:
        want = _lr(step - 1, c["steps"], peak, c["warmup_steps"])
        assert math.isclose(lr, want, rel_tol=1e-6, abs_tol=1e-12), \
            f"step {step} ran at rate {lr:.6g}; a warm-up over {c['warmup_steps']} steps to {peak:g} and a cosine " \
            f"decay over the rest of {c['steps']} gives {want:.6g}"


@check(points=2, needs_run=True)
def grader_scored_your_checkpoints(r):
    """The grader loaded the run's checkpoints and final weights into the challenge's model and scored them."""
    _scored(r)


@check(points=3, needs_run=True)
def reported_accuracy_is_what_the_weights_give(r):
    """The accuracy the run reported (its eval events at its checkpoints' steps, and its end event) is within
    ACCURACY_TOLERANCE of the grader's on the weights it kept there: the final weights and every scored checkpoint
    the run evaluated at."""
    _, scored = _scored(r)
    said, measured = scored["timeline"]["evals"], scored["accuracy"]
    both = sorted(set(said) & set(measured), key=lambda s: (s == "final", int(s) if s.isdigit() else 0))
    assert "final" in both, "the run reported no final accuracy (its end event)"
    assert len(both) >= 2, "no checkpoint at a step the run evaluated at (the challenge evaluates every 10 steps)"
    off = [f"{'the end' if s == 'final' else 'step ' + s}: reported {said[s]:.3f}, the weights score "
           f"{measured[s]:.3f}" for s in both if abs(said[s] - measured[s]) > ACCURACY_TOLERANCE]
    assert not off, "the weights the run kept do not give the accuracy it reported on the grader's held-out set: " \
                    + "; ".join(off[:3])


@check(points=3, needs_run=True)
def recovered_from_the_failure(r):
    """The rank killed before step kill_at_step came back: a restart from a checkpoint, the run to its end, the
    lost seconds in its events."""
    found, scored = _scored(r)
    kill, steps = param(r, "kill_at_step"), r["choices"]["steps"]
    if not kill or not 0 < kill < steps:
        return partial(1.0, "no failure was injected in this grading")
    tl = scored["timeline"]
    ranks = r["choices"]["workers"] * r["choices"]["nodes"]
    killed = [f for f in tl["faults"] if f["kind"] == "kill" and f["step"] == kill and f["rank"] == ranks - 1]
    assert killed, f"no event says rank {ranks - 1} was killed before step {kill}"
    assert len(tl["launches"]) >= 2, "the run did not restart"
    again = tl["launches"][1]
    assert isinstance(again["start_step"], int) and 0 < again["start_step"] <= kill, \
        f"the restart began at step {again['start_step']}, not from a checkpoint taken before step {kill}"
    assert tl.get("t_end"), "the run did not come to its end after the restart"
    m = measure(scored, param(r, "target") or 0.0)
    assert m["lost_s"] and m["lost_s"] > 0, "no lost time shows in the events"


@check(points=1, needs_run=True)
def within_the_budget(r):
    """The run used at most budget_rank_s rank-seconds (ranks x wall seconds of every launch)."""
    _, scored = _scored(r)
    used, budget = measure(scored, 0.0)["rank_seconds"], param(r, "budget_rank_s")
    assert budget is None or used <= budget, f"{used:.1f} rank-seconds used; the budget is {budget:g}"


@check(points=3, needs_run=True)
def target_reached_on_the_heldout_set(r):
    """A checkpoint (or the final weights) reached the target on the grader's held-out set; partial credit for
    getting close."""
    _, scored = _scored(r)
    target = param(r, "target") or r["lab12_params"]["target"]
    best = max(scored["accuracy"].values())
    if best < target:
        return partial(best / target, f"best held-out accuracy {best:.3f}; the target is {target:g}")


RANKING = ("grader_scored_your_checkpoints", "reported_accuracy_is_what_the_weights_give",
           "recovered_from_the_failure", "within_the_budget")


def standing(r):
    """Where this submission stands on the class board: ranked when the run is the challenge's, scored, honest about
    its accuracy, recovered and within budget; measured by the grader (grade/leaderboard.measure)."""
    from scalelab.grade.checks import run_checks
    by_name = {f.__name__: f for f in (grader_scored_your_checkpoints, reported_accuracy_is_what_the_weights_give,
                                       recovered_from_the_failure, within_the_budget)}
    results = run_checks([by_name[n].scalelab_check for n in RANKING], r)
    failed = [x for x in results if x.points < x.max_points]
    target = param(r, "target") or r["lab12_params"]["target"]
    out = {"ranked": not failed, "why": "; ".join(f"{x.name}: {x.message}" for x in failed)[:500],
           "target": target, "budget_rank_s": param(r, "budget_rank_s")}
    try:
        _, key, scored = _run(r)
        out["choices"] = dict(r["choices"])
        if scored:
            out.update({k: v for k, v in measure(scored, target).items() if k != "restarts"})
    except Exception as e:  # noqa: BLE001 - no run to measure: unranked with the reason
        out.update(ranked=False, why=out["why"] or str(e)[:300])
    return out


GRADER_HOOKS = {"heldout": HELDOUT_SET, "standing": standing}
