"""Lab 04: what a larger global batch does to optimisation, measured in one process.

Data-parallel training with N ranks of B samples computes exactly the gradient of one batch of N x B (Lab 02), so
the *optimisation* side of scaling can be studied on one rank with the global batch: that is what these functions
do, with the engine's model, data, optimizers (`scalelab.train.optim`, LARS/LAMB from pytorch-optimizer) and its
warm-up and decay schedules. Every run sees the same number of samples (`samples`): a larger batch means fewer steps.

    rows = train_runs(spec, [{"batch": 32, "lr": 0.05}, {"batch": 512, "lr": 0.8, "warmup_steps": 3}], samples=8192)
    norms = gradient_norms(spec, small=16, big=256)
    study = steps_to_target_study(spec, {64: [0.1, 0.2], 256: [0.2, 0.4]}, target=0.5, max_steps=300)
    fit = fit_critical_batch(study["best"])                  # S = S_min (1 + B_crit / B), McCandlish et al. 2018
    rows = growth_vs_decay(spec, batch=64, lr=0.16, samples=12000)   # Smith et al. 2018

The schedule exercise's runs are engine runs instead (DDP: the student's schedule runs in every rank):

    rows = schedule_runs(spec, "runs/schedules", {"yours": "my_schedule:lr_at", "constant": "constant"})
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import build_dataset
from ..data.loader import build_eval_set
from ..train.optim import build_optimizer, lr_at
from ._common import build_workload


@contextlib.contextmanager
def one_thread():
    """Run tiny models on one intra-op thread (restored afterwards): for a 64-unit MLP, splitting each small
    matrix product over threads costs more in synchronisation than it gains, badly so on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _batches(dataset, batch: int, seed: int):
    """Shuffled batches forever (a seeded permutation per epoch), whole batches only."""
    n = len(dataset)
    g = torch.Generator().manual_seed(seed)
    x, y = dataset.tensors
    while True:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - batch + 1, batch):
            idx = perm[i:i + batch]
            yield x[idx], y[idx]


@torch.no_grad()
def evaluate(model, spec) -> tuple[float, float]:
    """(loss, accuracy) on the held-out set."""
    x, y = build_eval_set(spec.data, spec.seed)
    out = model(x)
    return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def train_run(spec, batch: int, lr: float, samples: int, optimizer: str = "sgd", warmup_steps: int = 0,
              dataset=None, schedule: str = "constant") -> dict:
    """Train from the spec's start on `samples` samples in batches of `batch` at peak `lr` (warm-up, then the
    engine's `schedule`: constant, cosine or poly); returns the result."""
    spec = spec.with_overrides({"optim.name": optimizer, "optim.batch_per_worker": batch, "optim.lr": float(lr),
                                "optim.lr_scaling": "none", "optim.warmup_steps": 0, "world.workers_per_node": 1})
    wl = build_workload(spec, device=torch.device("cpu"), dataset=dataset)
    opt = build_optimizer(spec.optim, wl.model, lr)
    steps = max(1, samples // batch)
    curve, batches = [], _batches(wl.dataset, batch, spec.seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, warmup_steps, schedule, steps)
        x, y = next(batches)
        loss = F.cross_entropy(wl.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        curve.append(float(loss.detach()))
    eval_loss, accuracy = evaluate(wl.model, spec)
    if not math.isfinite(eval_loss):
        eval_loss = float("inf")  # diverged: a huge learning rate is a legitimate (bad) result
    return {"batch": batch, "lr": lr, "optimizer": optimizer, "warmup_steps": warmup_steps, "schedule": schedule,
            "steps": steps, "eval_loss": eval_loss, "accuracy": accuracy,
            "train_loss_curve": curve[:: max(1, steps // 50)]}


def train_runs(spec, runs: list[dict], samples: int) -> list[dict]:
    """`train_run` for each dict of its keyword arguments (batch, lr, optimizer, warmup_steps, schedule) plus any
    labels (keys that are not arguments, e.g. "rule", are copied into the result); one dataset for all, and runs
    with the same arguments are trained once."""
    dataset = build_dataset(spec.data, spec.seed)
    args = ("batch", "lr", "optimizer", "warmup_steps", "schedule")
    out, done = [], {}
    with one_thread():
        for run in runs:
            kwargs = {k: v for k, v in run.items() if k in args}
            key = tuple(sorted(kwargs.items()))
            if key not in done:  # e.g. every scaling rule gives the same lr at the base batch: train it once
                done[key] = train_run(spec, samples=samples, dataset=dataset, **kwargs)
            out.append({**{k: v for k, v in run.items() if k not in args}, **done[key]})
    return out


def gradient_norms(spec, small: int, big: int, batches: int = 8, warm_steps: int = 20) -> dict:
    """Mean squared gradient norm |g_B|^2 over `batches` batches of size `small` and of size `big`.

    Measured after `warm_steps` SGD steps (the noise scale of a freshly initialised model is not the one that
    matters). Same parameters for both sizes, so E|g_B|^2 = |G|^2 + tr(Sigma)/B holds between them.
    """
    with one_thread():
        return _gradient_norms(spec, small, big, batches, warm_steps)


def _gradient_norms(spec, small: int, big: int, batches: int, warm_steps: int) -> dict:
    """The measurement behind gradient_norms."""
    dataset = build_dataset(spec.data, spec.seed)
    wl = build_workload(spec.with_overrides({"world.workers_per_node": 1}), device=torch.device("cpu"),
                        dataset=dataset)
    it = _batches(wl.dataset, spec.optim.batch_per_worker, spec.seed)
    for _ in range(warm_steps):
        x, y = next(it)
        F.cross_entropy(wl.model(x), y).backward()
        wl.optimizer.step()
        wl.optimizer.zero_grad()
    out = {"b_small": small, "b_big": big, "batches": batches}
    for key, size in (("g2_small", small), ("g2_big", big)):
        it = _batches(wl.dataset, size, spec.seed + size)
        total = 0.0
        for _ in range(batches):
            x, y = next(it)
            wl.model.zero_grad()
            F.cross_entropy(wl.model(x), y).backward()
            total += sum(float(p.grad.pow(2).sum()) for p in wl.model.parameters())
        out[key] = total / batches
    wl.model.zero_grad()
    return out


# -- steps to a target loss against the batch: the critical batch (McCandlish et al. 2018) -----------------------

def steps_to_target(spec, batch: int, lr: float, target: float, max_steps: int, warmup_steps: int = 0,
                    dataset=None) -> int | None:
    """SGD steps at `batch` and `lr` (after a linear warm-up) until the held-out loss first reaches `target`;
    None if it does not within `max_steps`. The held-out loss is measured after every step."""
    spec = spec.with_overrides({"optim.batch_per_worker": batch, "optim.lr": float(lr), "optim.lr_scaling": "none",
                                "optim.warmup_steps": 0, "world.workers_per_node": 1})
    wl = build_workload(spec, device=torch.device("cpu"), dataset=dataset)
    opt = build_optimizer(spec.optim, wl.model, lr)
    x_eval, y_eval = build_eval_set(spec.data, spec.seed)
    batches = _batches(wl.dataset, batch, spec.seed)
    for step in range(max_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr, warmup_steps)
        x, y = next(batches)
        F.cross_entropy(wl.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            loss = float(F.cross_entropy(wl.model(x_eval), y_eval))
        if loss <= target:
            return step + 1
        if not math.isfinite(loss):
            return None  # diverged: it never gets there
    return None


def steps_to_target_study(spec, candidates: dict, target: float, max_steps: int, warmup_steps: int = 5) -> dict:
    """Steps to `target` for every batch and each of its candidate learning rates ({batch: [lr, ...]}), and the
    fewest per batch (`best`: what the batch can do with its best rate of those tried).

    A run is cut at the fewest steps its batch already needed (it cannot be the fastest after that): its row says
    steps None and `limit`, the steps it was given."""
    dataset = build_dataset(spec.data, spec.seed)
    rows, best = [], []
    with one_thread():
        for batch, lrs in sorted((int(b), list(v)) for b, v in candidates.items()):
            fewest = None
            for lr in lrs:
                limit = max_steps if fewest is None else fewest
                steps = steps_to_target(spec, batch, lr, target, limit, warmup_steps, dataset)
                rows.append({"batch": batch, "lr": float(lr), "steps": steps, "limit": limit})
                if steps is not None and (fewest is None or steps < fewest):
                    fewest = steps
            tried = [r for r in rows if r["batch"] == batch and r["steps"] is not None]
            if tried:
                fastest = min(tried, key=lambda r: r["steps"])
                best.append({"batch": batch, "lr": fastest["lr"], "steps": fastest["steps"]})
    return {"target": target, "max_steps": max_steps, "warmup_steps": warmup_steps, "rows": rows, "best": best}


def fit_critical_batch(best: list[dict]) -> dict:
    """Least-squares fit of S = S_min + E_min / B to (batch, steps) points, the empirical model of McCandlish et
    al. (2018): S = S_min (1 + B_crit / B), so B_crit = E_min / S_min (E: samples, = B x S). Needs two batches."""
    points = [(float(p["batch"]), float(p["steps"])) for p in best]
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"fit_critical_batch needs steps at two batch sizes or more, got {points}")
    xs, ys = [1 / b for b, _ in points], [s for _, s in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    e_min = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    s_min = my - e_min * mx
    b_crit = e_min / s_min if s_min > 0 else float("inf")
    return {"s_min": s_min, "e_min": e_min, "b_crit": b_crit, "points": n}


# -- batch growth instead of decay (Smith et al. 2018) ------------------------------------------------------------

def phased_run(spec, phases: list[dict], samples: int, warmup_steps: int = 0, dataset=None) -> dict:
    """Train through `phases` ([{"share", "batch", "lr"}]): each sees its share of `samples` at its batch and
    learning rate (a linear warm-up over the first `warmup_steps` steps of the run); returns steps and losses."""
    first = phases[0]
    spec = spec.with_overrides({"optim.batch_per_worker": first["batch"], "optim.lr": float(first["lr"]),
                                "optim.lr_scaling": "none", "optim.warmup_steps": 0, "world.workers_per_node": 1})
    wl = build_workload(spec, device=torch.device("cpu"), dataset=dataset)
    opt = build_optimizer(spec.optim, wl.model, first["lr"])
    step = 0
    for i, phase in enumerate(phases):
        batches = _batches(wl.dataset, phase["batch"], spec.seed + i)
        for _ in range(max(1, int(phase["share"] * samples) // phase["batch"])):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, phase["lr"], warmup_steps)
            x, y = next(batches)
            F.cross_entropy(wl.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
    eval_loss, accuracy = evaluate(wl.model, spec)
    return {"phases": phases, "samples": samples, "steps": step,
            "eval_loss": eval_loss if math.isfinite(eval_loss) else float("inf"), "accuracy": accuracy}


def growth_vs_decay(spec, batch: int, lr: float, samples: int, factor: int = 4,
                    shares: tuple = (0.5, 0.25, 0.25), warmup_steps: int = 5) -> list[dict]:
    """Three runs on the same `samples`: a constant rate and batch; the rate divided by `factor` at each new phase
    (step decay); the batch multiplied by `factor` instead, the rate kept (Smith et al. 2018, "Don't decay the
    learning rate, increase the batch size"). One row each: label, phases, samples, steps, eval_loss, accuracy."""
    plans = {"constant": [(batch, lr)] * len(shares),
             "decay": [(batch, lr / factor ** i) for i in range(len(shares))],
             "growth": [(batch * factor ** i, lr) for i in range(len(shares))]}
    dataset = build_dataset(spec.data, spec.seed)
    rows = []
    with one_thread():
        for label, plan in plans.items():
            phases = [{"share": share, "batch": b, "lr": r} for share, (b, r) in zip(shares, plan)]
            rows.append({"label": label, **phased_run(spec, phases, samples, warmup_steps, dataset)})
    return rows


# -- the schedule exercise: engine runs (DDP) with the student's schedule in every rank ---------------------------

def try_schedule(ref: str, total_steps: int = 40, peak_lr: float = 1.0, warmup_steps: int = 5,
                 folder: str | Path = ".") -> list[float]:
    """The learning rates a "module:function" schedule gives for steps 0 .. total_steps - 1, from the module's
    file in `folder` as it is now (not an imported copy an earlier cell left behind). An unsolved exercise raises
    NotImplementedError saying so."""
    module, _, name = ref.partition(":")
    path = Path(folder) / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_scalelab_try_{module}", path)
    if spec is None or not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the %%writefile {module}.py cell first")
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)
    try:
        return [float(getattr(code, name)(step, total_steps, peak_lr, warmup_steps)) for step in range(total_steps)]
    except NotImplementedError:
        raise NotImplementedError(f"{ref} is not implemented yet: write it in the %%writefile {module}.py cell, "
                                  "run that cell, then this one") from None


def schedule_runs(spec, out_dir: str | Path, schedules: dict, timeout: float = 600) -> list[dict]:
    """One engine run of `spec` per schedule ({label: "constant" | "cosine" | "poly" | "module:function"}),
    started together and waited for; a schedule of the student's own is tried first (`try_schedule`), so an
    unsolved one stops here with a clear message instead of in every rank. One row per run: label, schedule,
    run_dir, peak_lr, warmup_steps, steps, lr_curve and loss_curve (rank 0's step events), tail_loss (the mean
    of the last tenth of that loss curve) and eval_accuracy."""
    from ..launch import launch
    for ref in schedules.values():
        if ":" in ref:
            try_schedule(ref)
    runs = {}
    for label, schedule in schedules.items():
        one = spec.with_overrides({"name": f"schedule-{label}", "optim.schedule": schedule, "log_every": 1,
                                   "output_dir": str(Path(out_dir) / label)})
        runs[label] = (schedule, launch(one))
    rows = []
    try:
        for label, (schedule, run) in runs.items():
            rows.append(_schedule_row(label, schedule, run, run.wait(timeout=timeout)))
    finally:
        for _, run in runs.values():  # one failed or timed out: the others stop too
            if run.poll() in ("pending", "running"):
                run.stop()
    return rows


def _schedule_row(label: str, schedule: str, run, summary: dict) -> dict:
    """One schedule run's row (see `schedule_runs`), from its events."""
    events = run.events()
    start = next(e for e in events if e["type"] == "start" and e["rank"] == 0)
    steps = [e for e in events if e["type"] == "step" and e["rank"] == 0]
    losses = [e["loss"] for e in steps]
    return {"label": label, "schedule": schedule, "run_dir": str(run.run_dir), "peak_lr": start["peak_lr"],
            "warmup_steps": run.spec.optim.warmup_steps, "steps": len(steps), "lr_curve": [e["lr"] for e in steps],
            "loss_curve": losses, "tail_loss": tail_loss(losses), "eval_accuracy": summary.get("eval_accuracy")}


def tail_loss(losses: list[float]) -> float:
    """The mean of the last tenth of a loss curve (at least one step): where a run ended, less one batch's noise."""
    k = max(1, len(losses) // 10)
    return sum(losses[-k:]) / k
