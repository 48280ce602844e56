"""Lab 12, the capstone: a time-to-accuracy challenge over every lever of the course, under a rank-second budget.

Every team trains the same model on the same data set (CHALLENGE) to a target accuracy on a held-out set it never
sees: the grader keeps that set (its seed lives in the lab's hidden checks), scores the run's own checkpoints on it
(grade/heldout.py) and ranks the class by time to the target (grade/leaderboard.py). A team chooses:

    global_batch     samples per step over all ranks (a multiple of workers x nodes)
    lr, lr_scaling   the peak learning rate, or a base rate scaled to the batch (linear, sqrt; base_batch 32)
    schedule         constant, cosine, poly, or module:function of the team's own (run on every rank)
    warmup_steps     linear warm-up to the peak
    optimizer        sgd, adamw, lars, lamb or kfac
    strategy         ddp or fsdp
    workers, nodes   the layout: ranks per node and nodes (one node: torchrun, which restarts the ranks from the
                     newest checkpoint after a failure; nodes > 1: a Slurm job, which does not restart)
    data_format      memory, shards or files (lab 05's formats)
    checkpoint_every steps between checkpoints: what the grader can score, and what a failure loses
    steps            how long to train

`challenge_spec` turns those choices into the one RunSpec of the team's run, with the challenge's fixed model and
data, the grading's injected failure (a kill of the last rank at `kill_at_step`, recovered by one restart from the
newest checkpoint) and every checkpoint kept; a choice outside the menu is an error naming it and what to pick.
`own_view` is what a team can see of its own run: its events' accuracy on the engine's validation split (not the
grader's held-out set) over time, the budget used and the time a restart cost.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import SpecError
from ..run.field_groups import CheckpointSpec, DataSpec, FaultSpec, ModelSpec, OptimSpec, WorldSpec
from ..run.spec import RunSpec

CHALLENGE = {"model": {"name": "cnn", "width": 16, "depth": 2}, "data": {"source": "heat", "size": 16, "classes": 4}}
"""The fixed model and data set: the grader builds this model to score the checkpoints, so no other shape loads."""
MENU = {
    "optimizer": ("sgd", "adamw", "lars", "lamb", "kfac"),
    "strategy": ("ddp", "fsdp"),
    "lr_scaling": ("none", "linear", "sqrt"),
    "data_format": ("memory", "shards", "files"),
    "schedule": ("constant", "cosine", "poly"),
}
DEFAULTS = {"global_batch": 64, "lr": 0.05, "lr_scaling": "none", "schedule": "constant", "warmup_steps": 0,
            "optimizer": "sgd", "strategy": "ddp", "workers": 1, "nodes": 1, "data_format": "memory",
            "checkpoint_every": 10, "steps": 60, "samples": 4096}
MAX_WORKERS, MAX_NODES, MAX_STEPS, MAX_SAMPLES = 16, 8, 5000, 65536
RESTARTS = 3
"""torchrun's restarts: the grading's kill, and in class the instructor's injections (scalelab course inject)."""


def _int(choices: dict, name: str, low: int, high: int) -> int:
    value = choices[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SpecError(f"choices[{name!r}]", f"{value!r}: choose a whole number from {low} to {high}")
    return value


def checked_choices(choices: dict) -> dict:
    """The team's choices with the defaults filled in, each checked against the menu."""
    unknown = sorted(set(choices) - set(DEFAULTS))
    if unknown:
        raise SpecError(f"choices[{unknown[0]!r}]", f"not a choice of the challenge; choose among {sorted(DEFAULTS)}")
    c = {**DEFAULTS, **choices}
    for name, allowed in MENU.items():
        if c[name] not in allowed and not (name == "schedule" and isinstance(c[name], str) and ":" in c[name]):
            raise SpecError(f"choices[{name!r}]", f"{c[name]!r}: choose one of {', '.join(allowed)}"
                            + (" (or module:function of your own)" if name == "schedule" else ""))
    ranks = _int(c, "workers", 1, MAX_WORKERS) * _int(c, "nodes", 1, MAX_NODES)
    batch = _int(c, "global_batch", ranks, 65536)
    if batch % ranks:
        raise SpecError("choices['global_batch']", f"{batch} does not split over {ranks} ranks; choose a multiple "
                        f"of {ranks}")
    _int(c, "steps", 1, MAX_STEPS), _int(c, "checkpoint_every", 1, MAX_STEPS), _int(c, "warmup_steps", 0, MAX_STEPS)
    _int(c, "samples", batch, MAX_SAMPLES)
    if not isinstance(c["lr"], (int, float)) or isinstance(c["lr"], bool) or not 0 < c["lr"] <= 10:
        raise SpecError("choices['lr']", f"{c['lr']!r}: choose a learning rate above 0 and at most 10")
    return c


def challenge_spec(choices: dict, *, output_dir: str, kill_at_step: int = 0, device: str = "cpu",
                   seed: int = 0) -> RunSpec:
    """The RunSpec of a team's run: their checked choices, the challenge's model and data, every checkpoint kept
    and an evaluation at each (the accuracy the run reports there, which the grader holds its checkpoint to),
    RESTARTS restarts allowed on one node, and with `kill_at_step` > 0 the grading's failure (the last rank killed before that step,
    in the first launch only)."""
    c = checked_choices(choices)
    ranks = c["workers"] * c["nodes"]
    every = c["checkpoint_every"]
    fault = FaultSpec(kind="kill", rank=ranks - 1, step=kill_at_step) if 0 < kill_at_step < c["steps"] else FaultSpec()
    return RunSpec(
        name="capstone", model=ModelSpec(**CHALLENGE["model"]),
        data=DataSpec(CHALLENGE["data"]["source"], samples=c["samples"], size=CHALLENGE["data"]["size"],
                      classes=CHALLENGE["data"]["classes"], format=c["data_format"]),
        strategy=c["strategy"], device=device, launcher="slurm" if c["nodes"] > 1 else "torchrun",
        world=WorldSpec(workers_per_node=c["workers"], nodes=c["nodes"], max_restarts=0 if c["nodes"] > 1 else RESTARTS),
        optim=OptimSpec(name=c["optimizer"], batch_per_worker=c["global_batch"] // ranks, lr=float(c["lr"]),
                        lr_scaling=c["lr_scaling"], base_batch=32, warmup_steps=c["warmup_steps"],
                        schedule=c["schedule"]),
        checkpoint=CheckpointSpec(every_steps=every, keep_last=c["steps"] // every + 1, resume=True),
        fault=fault, steps=c["steps"], seed=seed, output_dir=output_dir, log_every=1, eval_every=every)


def own_view(run_dir: str | Path) -> dict:
    """What a team sees of its own run from its event files: launches, rank-seconds used, the accuracy of the
    engine's eval events over time (the run's own validation split, not the grader's held-out set: an estimate), the
    seconds each restart cost (the dying launch's last step to the time the next launch logged it again)."""
    from ..paths import json_lines
    events = {}
    for path in sorted((Path(run_dir) / "events").glob("rank-*.jsonl")):
        events[int(path.stem[5:])] = json_lines(path.read_bytes())
    main = events.get(0, [])
    launches, current = [], None
    for e in main:
        if e.get("type") == "start":
            current = {"t_start": e["t"], "t_last": e["t"], "world_size": e.get("world_size", 1), "steps": {}}
            launches.append(current)
        elif current is not None:
            current["t_last"] = e["t"]
            if e.get("type") == "step":
                current["steps"][e["step"]] = e["t"]
    t0 = launches[0]["t_start"] if launches else 0.0
    curve = [(e["t"] - t0, e["step"], e["accuracy"]) for e in main if e.get("type") == "eval"]
    end = [e for e in main if e.get("type") == "end"]
    if end and "eval_accuracy" in end[-1]:
        curve.append((end[-1]["t"] - t0, end[-1]["steps"], end[-1]["eval_accuracy"]))
    lost = []
    for before, after in zip(launches, launches[1:]):
        if before["steps"]:
            last = max(before["steps"])
            again = after["steps"].get(last, after["t_last"])
            lost.append(again - before["steps"][last])
    faults = [{"rank": r, **{k: e.get(k) for k in ("kind", "step", "source")}}
              for r, evs in events.items() for e in evs if e.get("type") == "fault"]
    return {"launches": len(launches), "wall_s": (launches[-1]["t_last"] - t0) if launches else 0.0,
            "rank_seconds": sum(x["world_size"] * (end - x["t_start"]) for x, end in
                                zip(launches, [y["t_start"] for y in launches[1:]] + [launches[-1]["t_last"]]))
            if launches else 0.0,
            "accuracy_curve": curve, "lost_s": lost, "faults": faults}


def time_to(curve: list[tuple[float, int, float]], target: float) -> float | None:
    """Seconds to the first point of an accuracy curve [(seconds, step, accuracy)] at or above `target`."""
    return next((t for t, _, a in curve if a >= target), None)


def report(choices: dict, view: dict, target: float, budget_rank_s: float) -> str:
    """One line for the notebook: what the run cost and when it got there (on its own validation split)."""
    t = time_to(view["accuracy_curve"], target)
    final = view["accuracy_curve"][-1][2] if view["accuracy_curve"] else math.nan
    return (f"{json.dumps(choices)}: {view['launches']} launch(es), {view['rank_seconds']:.1f} of "
            f"{budget_rank_s:g} rank-s, final validation accuracy {final:.3f}, target {target:g} "
            + (f"reached after {t:.1f} s" if t is not None else "not reached")
            + (f"; the restart cost {sum(view['lost_s']):.1f} s" if view["lost_s"] else ""))


__all__ = ["CHALLENGE", "MENU", "DEFAULTS", "checked_choices", "challenge_spec", "own_view", "time_to", "report"]
