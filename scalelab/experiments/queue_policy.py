"""Lab 11 (ML for HPC): a queue-aware provisioning policy learned from queue traces (TACC's Mirage, SC'23, in small).

    samples = wait_samples(seeds=range(1, 7))            # the queue each big job met, and the wait it then had
    model = fit_wait_model(samples)                      # least squares on log waits: a small learned model
    decide = learned_policy(model)                       # submit the next link once its predicted wait covers the rest
    figures = evaluate({"learned": decide, "average": average_policy(samples)}, seeds=(101, 102, 103))
    verify(figures["runs"][0])                           # a grader's replay of the recorded submissions

Mirage predicts how long the next job of a chain will wait in the queue from the queue's state and submits it that
long before its predecessor ends. Here the queue is `queue_sim`'s (FIFO + EASY backfill over a seeded synthetic
trace): the model learns from the background jobs of training traces — the queue state each job of at least
`min_nodes` nodes met when it was submitted (`queue_sim.queue_state`: work waiting ahead of it, work the running
jobs may still hold, free nodes, its size, recent waits) and the wait it got — and is tested on traces it never saw.
Baselines: "reactive" (the next link when the previous ends) and "average" (the training traces' mean wait, the
same for every queue). A policy is a function `decide(view) -> bool` the simulator calls every `poll_h` hours while
a link runs (`queue_sim.QueueView`); Mirage itself trains a deeper model (and a reinforcement-learning policy) on
months of a real machine's traces: this is the idea at the size of a lab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import SpecError
from ..run.nonce import mix_seed, nonce
from .queue_sim import Simulator, Job, background_trace, queue_state, simulate

FEATURES = ("ahead_h", "running_h", "free", "size", "recent_wait_h")
LOGGED = ("ahead_h", "running_h", "recent_wait_h")
"""Hours of work and waits span orders of magnitude: the model reads them as log(1 + x)."""
TRAIN_SEEDS = tuple(range(1, 7))
"""The traces the wait model learns from."""
HELD_OUT_FROM = 101
"""Held-out traces are seeds 101, 102, ... outside a grading, those mixed with the grading's nonce inside one."""
CURRENT = object()
CHAIN = {"nodes": 32, "days": 4.0, "load": 0.9, "links": 4, "link_hours": 2.0, "link_nodes": 8}
"""The lab's cluster and chain (queue_sim.compare_policies' defaults)."""


def wait_samples(seeds, nodes: int = 32, days: float = 4.0, load: float = 0.9, min_nodes: int = 4,
                 window_h: float = 6.0) -> list[dict]:
    """For every background job of at least `min_nodes` nodes in the seeded traces: the queue state it met when it
    was submitted (`queue_state`, taken before it joined the queue) and the wait it then had (start - submit)."""
    samples = []
    for seed in seeds:
        sim, met = Simulator(nodes), {}

        def arrive(job: Job, sim=sim, met=met) -> None:
            if job.nodes >= min_nodes:
                met[job.id] = queue_state(sim, job.nodes, window_h)
            sim.submit(job)

        for bg in background_trace(nodes, days, load, seed):
            sim.at(bg.submit, arrive, Job(bg.id, bg.submit, bg.nodes, bg.runtime, bg.walltime))
        sim.run()
        samples += [{**met[job.id], "wait_h": job.start - job.eligible, "seed": seed}
                    for job in sorted(sim.done.values(), key=lambda j: j.id) if job.id in met]
    return samples


def _row(features: dict) -> list[float]:
    return [1.0] + [math.log1p(max(0.0, features[k])) if k in LOGGED else float(features[k]) for k in FEATURES]


@dataclass
class WaitModel:
    """A linear model of log(1 + wait hours) over the queue's features: `predict(features)` in hours."""

    coef: list[float]
    samples: int = 0
    train_error_h: float = 0.0
    features: tuple = field(default=FEATURES)

    def predict(self, features: dict) -> float:
        return max(0.0, math.expm1(sum(c * x for c, x in zip(self.coef, _row(features)))))

    def to_dict(self) -> dict:
        return {"coef": list(self.coef), "samples": self.samples, "train_error_h": self.train_error_h,
                "features": list(self.features)}


def fit_wait_model(samples: list[dict], ridge: float = 1e-3) -> WaitModel:
    """Least squares (with a little ridge) of log(1 + wait) on the features of `samples` (`wait_samples`)."""
    import numpy as np
    if len(samples) < 2 * (len(FEATURES) + 1):
        raise SpecError("samples", f"{len(samples)} samples are too few to fit {len(FEATURES) + 1} coefficients; "
                                   "give wait_samples more seeds")
    x = np.array([_row(s) for s in samples])
    y = np.log1p(np.array([s["wait_h"] for s in samples]))
    coef = np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)
    model = WaitModel([float(c) for c in coef], len(samples))
    model.train_error_h = mean_abs_error(model, samples)
    return model


def mean_abs_error(model: WaitModel, samples: list[dict]) -> float:
    """Mean |predicted - real| wait in hours over `samples`."""
    return sum(abs(model.predict(s) - s["wait_h"]) for s in samples) / max(1, len(samples))


def learned_policy(model: WaitModel, margin_h: float = 0.0):
    """Submit the next link once the wait the model predicts for it (from the queue now) covers the time left."""
    def decide(view) -> bool:
        return view.left_h <= model.predict(view.features()) + margin_h
    return decide


def average_policy(samples: list[dict]):
    """The baseline that reads no queue: submit the average wait of the training samples before the end."""
    mean = sum(s["wait_h"] for s in samples) / max(1, len(samples))

    def decide(view) -> bool:
        return view.left_h <= mean
    return decide


def held_out_seeds(count: int, grading_nonce=CURRENT) -> list[int]:
    """The seeds of `count` held-out traces: HELD_OUT_FROM, +1, ... mixed with the grading's nonce (this process's,
    from its environment, by default; run/nonce.py): inside a grading they are traces no one saw before, so a
    policy's figures copied from another grading do not fit them."""
    if not isinstance(count, int) or count < 1:
        raise SpecError("count", f"need at least one held-out trace, got {count!r}")
    n = nonce() if grading_nonce is CURRENT else grading_nonce
    return [mix_seed(HELD_OUT_FROM + i, n) for i in range(count)]


def evaluate(policies: dict, seeds, chain: dict | None = None) -> dict:
    """Each policy (name -> decide function) and the reactive baseline on the seeded traces: {"runs": one entry per
    (seed, policy) with its chain's figures and submit times, "totals": {policy: {idle_h, overlap_node_h}},
    "not_implemented": policies whose function raised NotImplementedError (an exercise not done yet: left out)}."""
    c = {**CHAIN, **(chain or {})}
    runs, totals, missing = [], {}, []
    for seed in seeds:
        trace = background_trace(c["nodes"], c["days"], c["load"], seed)
        for name, decide in [("reactive", None), *policies.items()]:
            if name in missing:
                continue
            try:
                fig = simulate(trace, c["nodes"], "reactive" if decide is None else "decide", links=c["links"],
                               link_hours=c["link_hours"], link_nodes=c["link_nodes"], decide=decide)
            except NotImplementedError:
                missing.append(name)
                continue
            runs.append({"seed": seed, "policy": name, "submit_at": submit_times(fig),
                         **{k: fig[k] for k in ("total_idle_h", "idle_gap_h", "overlap_node_h", "queue_h",
                                                "makespan_h", "tries")}})
            t = totals.setdefault(name, {"idle_h": 0.0, "overlap_node_h": 0.0})
            t["idle_h"] += fig["total_idle_h"]
            t["overlap_node_h"] += fig["overlap_node_h"]
    for name in missing:
        runs = [r for r in runs if r["policy"] != name]
        totals.pop(name, None)
    return {"runs": runs, "totals": totals, "seeds": list(seeds), "chain": c, "not_implemented": missing}


def submit_times(figures: dict) -> list[float]:
    """When each link after the first was first submitted (a policy's decisions; resubmissions after a link gave up
    follow from the simulation)."""
    first = {}
    for job in figures["links"]:
        first.setdefault(job["link"], job["submit"])
    return [first[i] for i in sorted(first) if i > 0]


def verify(run: dict, chain: dict | None = None) -> dict:
    """Re-simulate a recorded run (`evaluate`'s entries) from its seed and submit times: the figures the queue
    gives those decisions. A grader compares them to what was recorded."""
    c = {**CHAIN, **(chain or {})}
    trace = background_trace(c["nodes"], c["days"], c["load"], run["seed"])
    policy = "reactive" if run["policy"] == "reactive" else "replay"
    fig = simulate(trace, c["nodes"], policy, links=c["links"], link_hours=c["link_hours"],
                   link_nodes=c["link_nodes"], submit_at=None if policy == "reactive" else run["submit_at"])
    return {k: fig[k] for k in ("total_idle_h", "idle_gap_h", "overlap_node_h", "queue_h", "makespan_h", "tries")}


__all__ = ["FEATURES", "CHAIN", "TRAIN_SEEDS", "held_out_seeds", "wait_samples", "WaitModel", "fit_wait_model", "mean_abs_error", "learned_policy",
           "average_policy", "evaluate", "submit_times", "verify"]
