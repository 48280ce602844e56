"""Lab 08: the checkpoint interval on real runs. A training loop checkpoints every `interval_s` seconds of work
while faults strike at the times of a seeded Poisson process on the run's own clock; each fault throws the model
away, and the restart rebuilds it and loads the newest checkpoint from disk. The student's accounting turns the
run's event log into the useful-work fraction, set against Daly's prediction for the same C, R and M.

    rows = sweep(out, intervals, account="my_interval:useful_work", mtbf_s=0.2, window_s=1.5, trials=4)
    predicted_fraction(interval_s, ckpt_s, restart_s, mtbf_s)   # Daly (2006): tau / (M e^(R/M) (e^((tau+C)/M) - 1))

Everything in a run is real: the steps (an MLP's forward, backward and SGD update on its batches), each checkpoint
(torch.save of the model, the optimizer and a ballast that stands for the rest of a large model's state, written to
a temporary file, flushed and renamed into place), each restart (a new model and optimizer, torch.load of the
newest checkpoint) and the wall clock. Only the faults are drawn: waiting for real ones at a rate where the interval
matters would take days. The restart also waits `restart_s`, the stand-in for starting new processes (section 4 of
the lab measures that: seconds).

A fault is noticed at the end of the step, checkpoint or restart it struck (within a step's time); a checkpoint
struck while being written is thrown away (its temporary file deleted: never renamed into place), and a restart
struck starts over, as in Daly's model. The log (`<run dir>/faults.jsonl`, one JSON object a line, `t` in seconds
on time.time()'s clock) holds events of types:

- `start`       the run (or a restart) begins training at `start_step` (the restart's `restart_s` ends here)
- `step`        `step` (1-based, the steps done), `step_s` (seconds the step took)
- `checkpoint`  a checkpoint of `step` is on disk; `blocked_s` (seconds training waited for it)
- `fault`       a fault noticed after step `step` (the model in memory is lost)
- `end`         the run is over after `step` steps: all `total_steps` done and saved (a run of fixed work, whose
                last step is saved by a final checkpoint), or its time `window_s` is up (a run of fixed time, as a
                job's time limit: the steps since the last checkpoint are lost with it)

A sweep runs every interval for the same time with the same fault times (common random numbers: the intervals
differ by what they make of the same faults, not by their luck) and adds up each interval's trials.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scalelab.paths import json_lines

FEATURES, HIDDEN, CLASSES, BATCH = 64, 256, 10, 64
LOG = "faults.jsonl"


def predicted_fraction(interval_s: float, ckpt_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's (2006) expected useful-work fraction for a checkpoint every `interval_s` of work, checkpoint cost C,
    restart cost R and exponential failures with mean M (failures may strike checkpoints and restarts too):
    tau / (M e^(R/M) (e^((tau + C)/M) - 1))."""
    m = mtbf_s
    return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + ckpt_s) / m))


def daly_optimum(ckpt_s: float, restart_s: float, mtbf_s: float, lo: float = 1e-3, hi: float = 1e3) -> float:
    """The interval that maximises `predicted_fraction` (a golden-section search on log tau)."""
    f = lambda x: -predicted_fraction(math.exp(x), ckpt_s, restart_s, mtbf_s)  # noqa: E731
    a, b, g = math.log(lo * mtbf_s), math.log(hi * mtbf_s), (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        a, b = (a, d) if f(c) < f(d) else (c, b)
    return math.exp((a + b) / 2)


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(seed: int, step: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the same batch for a step, however often redone
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x[:, :CLASSES].argmax(1))


class _Log:
    def __init__(self, path: Path):
        self._f = open(path, "w", buffering=1)

    def emit(self, type_: str, **fields) -> dict:
        record = {"type": type_, "t": time.time(), **fields}
        self._f.write(json.dumps(record) + "\n")
        return record

    def close(self):
        self._f.close()


def faulty_run(run_dir, interval_s: float, *, total_steps: int | None = None, window_s: float | None = None,
               mtbf_s: float, restart_s: float, seed: int = 0, ballast_mb: float = 8.0, step_s: float = 0.0,
               fsync: bool = False) -> dict:
    """Train `total_steps` steps (the last one saved by a final checkpoint) or for `window_s` seconds on the run's
    clock (what is not saved when the time is up is lost), whichever comes first, checkpointing once `interval_s`
    seconds of work have passed since the last checkpoint, while faults strike at seeded Poisson times (mean gap
    `mtbf_s`, seed `seed`: the same faults on the run's clock, whatever the interval). `step_s` > 0 pads each
    step to at least that long (a steadier clock on a busy machine); `fsync` forces each checkpoint to the disk
    before the rename (off: the page cache is the fast tier, and a shared disk's flushes would make C wander).
    Returns {run_dir, log (the path of faults.jsonl), faults, checkpoints, wall_s}."""
    if total_steps is None and window_s is None:
        raise ValueError("faulty_run needs total_steps or window_s: when does the run end?")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, tmp = run_dir / "checkpoint.pt", run_dir / "checkpoint.pt.tmp"
    for p in (ckpt, tmp):
        p.unlink(missing_ok=True)
    ballast = torch.zeros(int(ballast_mb * 2**20 / 4))  # the rest of a large model's state
    rng = random.Random(seed)
    log = _Log(run_dir / LOG)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: a busy machine's other threads do not stretch the steps
    total_steps = math.inf if total_steps is None else total_steps
    window_s = math.inf if window_s is None else window_s
    try:
        return _train(run_dir, log, ckpt, tmp, ballast, rng, t0, interval_s, total_steps, window_s, mtbf_s,
                      restart_s, seed, step_s, fsync)
    finally:
        torch.set_num_threads(threads)


class _Faults:
    """Faults struck at exponentially spaced moments (mean `mtbf_s`) since `t0`; `struck()` looks once."""

    def __init__(self, rng, mtbf_s: float, t0: float):
        self.rng, self.mtbf_s, self.t0 = rng, mtbf_s, t0
        self.next = rng.expovariate(1 / mtbf_s)
        self.count = 0

    def struck(self) -> bool:
        """A fault since the last look? (the next one is drawn from the one that struck)"""
        if time.perf_counter() - self.t0 < self.next:
            return False
        self.next += self.rng.expovariate(1 / self.mtbf_s)
        self.count += 1
        return True


def _write(model, opt, step: int, ballast, tmp, fsync: bool) -> None:
    """The checkpoint, written to `tmp` (renamed into place by the caller when no fault struck meanwhile)."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "ballast": ballast}, tmp)
    if fsync:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())


def _restarted(seed: int, ckpt, restart_s: float):
    """After a fault: the restart's cost waited out, new objects, the newest checkpoint from disk. (model, opt, step)"""
    r0 = time.perf_counter()
    while time.perf_counter() - r0 < restart_s:
        time.sleep(min(0.005, restart_s))
    model, opt = _model(seed)
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    return model, opt, step


def _train(run_dir, log, ckpt, tmp, ballast, rng, t0, interval_s, total_steps, window_s, mtbf_s, restart_s, seed,
           step_s, fsync):
    faults, checkpoints = _Faults(rng, mtbf_s, t0), 0
    model, opt = _model(seed)
    step, work = 0, 0.0  # steps done (in memory), seconds of work since the last checkpoint
    log.emit("start", start_step=0)
    while step < total_steps and time.perf_counter() - t0 < window_s:
        s0 = time.perf_counter()
        x, y = _batch(seed, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        while time.perf_counter() - s0 < step_s:
            pass
        step += 1
        took = time.perf_counter() - s0
        work += took
        log.emit("step", step=step, step_s=took, loss=loss.item())
        lost = faults.struck()
        if not lost and (step == total_steps or work >= interval_s):  # the last one: the trained model saved
            c0 = time.perf_counter()
            _write(model, opt, step, ballast, tmp, fsync)
            lost = faults.struck()
            if lost:  # struck while writing: never renamed into place
                tmp.unlink(missing_ok=True)
            else:
                os.replace(tmp, ckpt)
                checkpoints += 1
                work = 0.0
                log.emit("checkpoint", step=step, blocked_s=time.perf_counter() - c0)
        while lost:  # the model in memory is gone
            log.emit("fault", step=step)
            model, opt, step = _restarted(seed, ckpt, restart_s)
            work = 0.0
            lost = faults.struck()
            if not lost:
                log.emit("start", start_step=step)
    log.emit("end", step=step)
    log.close()
    for p in (ckpt, tmp):
        p.unlink(missing_ok=True)
    return {"run_dir": str(run_dir), "log": str(run_dir / LOG), "faults": faults.count, "checkpoints": checkpoints,
            "wall_s": time.perf_counter() - t0}


def calibrate(run_dir, checkpoints: int = 10, restart_s: float = 0.05, ballast_mb: float = 8.0) -> dict:
    """C and R of these runs before any sweep: a run with no fault that checkpoints after every step (ckpt_s, the
    median blocked_s of its checkpoints: on a busy machine one save the scheduler held up must not move the sweep's
    intervals), and one restart timed as a fault's would be (restart_s: the
    wait, a new model and optimizer, torch.load of the checkpoint). Returns {ckpt_s, restart_s, log}."""
    run = faulty_run(run_dir, 0.0, total_steps=checkpoints + 1, mtbf_s=1e9, restart_s=restart_s, seed=0,
                     ballast_mb=ballast_mb)
    ckpt_s = costs(read_log(run["log"]))["ckpt_median_s"]
    path = Path(run_dir) / "checkpoint.pt"
    model, opt = _model(0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 0,
                "ballast": torch.zeros(int(ballast_mb * 2**20 / 4))}, path)
    r0 = time.perf_counter()
    time.sleep(restart_s)
    model, opt = _model(0)
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    restart = time.perf_counter() - r0
    path.unlink()
    return {"ckpt_s": ckpt_s, "restart_s": restart, "log": run["log"]}


def read_log(path) -> list[dict]:
    """The events of a run's faults.jsonl (a line a kill cut short is skipped)."""
    return json_lines(Path(path).read_text())


def costs(events: list[dict]) -> dict:
    """The run's measured C (ckpt_s: the mean blocked_s of its checkpoints; ckpt_median_s their median), R (the
    mean seconds one restart took: from a fault to training again, divided among the restarts a fault struck
    again on the way) and mean step time: the inputs of the prediction."""
    ckpts = [e["blocked_s"] for e in events if e["type"] == "checkpoint"]
    steps = [e["step_s"] for e in events if e["type"] == "step"]
    restarts, fault_t, tries = [], None, 0
    for e in events:
        if e["type"] == "fault":
            fault_t, tries = e["t"] if fault_t is None else fault_t, tries + 1
        elif e["type"] == "start" and fault_t is not None:
            restarts += [(e["t"] - fault_t) / tries] * tries
            fault_t, tries = None, 0
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    ordered = sorted(ckpts)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2 if ordered else 0.0
    return {"ckpt_s": mean(ckpts), "ckpt_median_s": median, "restart_s": mean(restarts), "step_s": mean(steps)}


def load_function(ref, folder=None):
    """The function "module:function" names, loaded afresh from `module`.py in `folder` (default: the working
    folder), so a module the notebook has just rewritten (%%writefile) is the one used; a callable is returned as
    it is."""
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    path = Path(folder or os.getcwd()) / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_scalelab_user_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.pop(spec.name, None)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def sweep(out, intervals: list[float], account, *, mtbf_s: float, window_s: float, restart_s: float = 0.05,
          trials: int = 4, ballast_mb: float = 8.0, step_s: float = 0.004, seed: int = 0, say=print) -> dict:
    """One faulty run of `window_s` seconds per interval and trial, trial by trial (every interval of trial k has
    the fault times of seed `seed` + k: common random numbers, so the intervals differ by what they do with the
    same faults, not by their luck), each accounted by `account(events) -> {useful_s, lost_s, checkpoint_s,
    restart_s, wall_s}` (the student's function, or "module:function"). Returns {rows: per interval the measured
    fraction (useful_s summed over its trials / their wall_s summed), each trial's own (`fractions`), Daly's
    prediction for the runs' own C and R, faults; best_interval_s (the interval of the most useful work); error
    (None, or why the accounting could not run: then the sweep stops there, and no row has a measurement)}."""
    error = None
    try:
        account = load_function(account)
    except Exception as e:  # noqa: BLE001 - a module that does not load is the student's to fix
        account, error = None, f"{type(e).__name__}: {e}"
    runs = {tau: [] for tau in intervals}  # per interval: (run, its events, the accounting's parts)
    for k in range(trials):
        for tau in intervals:
            if error is not None:
                break  # the accounting does not run: no more runs to account
            run = faulty_run(Path(out) / f"interval-{tau:.4f}-trial-{k}", tau, window_s=window_s,
                             mtbf_s=mtbf_s, restart_s=restart_s, seed=seed + k, ballast_mb=ballast_mb, step_s=step_s)
            events = read_log(run["log"])
            parts = None
            try:
                parts = account(events)
                parts = {"useful_s": float(parts["useful_s"]), "wall_s": float(parts["wall_s"])}
            except NotImplementedError:
                error = "not implemented yet: useful_work (exercise)"
            except Exception as e:  # noqa: BLE001 - the student's function failed: say how, go on
                error = f"{type(e).__name__}: {e}"
            runs[tau].append((run, events, parts))
    rows = []
    for tau in intervals:
        if not runs[tau]:
            continue
        measured = [costs(events) for _, events, _ in runs[tau]]
        ckpt_s = sum(c["ckpt_s"] for c in measured) / len(measured)
        rest = [c["restart_s"] for c in measured if c["restart_s"]]
        restart = sum(rest) / len(rest) if rest else restart_s
        done = error is None and all(parts and parts["wall_s"] > 0 for _, _, parts in runs[tau])
        row = {"interval_s": tau, "runs": [run["run_dir"] for run, _, _ in runs[tau]],
               "faults": sum(run["faults"] for run, _, _ in runs[tau]), "ckpt_s": ckpt_s, "restart_s": restart,
               "predicted": predicted_fraction(tau, ckpt_s, restart, mtbf_s),
               "fraction": (sum(p["useful_s"] for _, _, p in runs[tau]) / sum(p["wall_s"] for _, _, p in runs[tau])
                            if done else None),
               "fractions": [p["useful_s"] / p["wall_s"] for _, _, p in runs[tau]] if done else None}
        rows.append(row)
        if say:
            got = f"{row['fraction']:.3f}" if row["fraction"] is not None else "  -  "
            say(f"interval {tau:6.3f} s: {row['faults']:3d} faults, useful-work fraction {got} measured, "
                f"{row['predicted']:.3f} predicted (C {ckpt_s * 1e3:.1f} ms, R {restart * 1e3:.0f} ms)")
    if error and say:
        say(f"the accounting did not run: {error}")
    best = max(rows, key=lambda r: r["fraction"])["interval_s"] if error is None else None
    return {"rows": rows, "best_interval_s": best, "error": error, "mtbf_s": mtbf_s, "window_s": window_s,
            "trials": trials}


__all__ = ["predicted_fraction", "daly_optimum", "faulty_run", "calibrate", "read_log", "costs", "load_function",
           "sweep"]
