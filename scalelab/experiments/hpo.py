"""Lab 10: parallel hyperparameter search with early stopping, on local worker processes or on Slurm jobs.

    r = parallel_hpo("runs/hpo", trials=16, workers=2, steps=80, seed=0)                    # 2 local processes
    r = parallel_hpo("runs/hpo", trials=16, workers=2, steps=80, seed=0, launcher="slurm")  # 2 sbatch jobs
    r["best"], r["pruned"], r["steps_saved"], r["trials"][0]  # params, value, state, steps, pid, host, worker

Why optuna, not deephyper: optuna is a pure-Python wheel; its `JournalStorage` over a `JournalFileBackend` keeps
a whole study in one append-only file that several processes, or Slurm jobs on a shared file system, read and
write without a database server (its default lock is a symlink, which works on NFS too); and its pruners
(`MedianPruner` here) give early stopping through `trial.report` / `trial.should_prune()`. deephyper pulls in
more and wants its own evaluators (process pools, Ray, MPI) to run the search.

How a search runs: `parallel_hpo` writes the settings (`hpo.json`) and creates the study in `study.journal` under
`out_dir`, then starts `workers` copies of `python -m scalelab.experiments.hpo worker <out_dir> <index>` (local
subprocesses, or one batch job each). A worker claims trial slots by creating `claims/<n>` with O_EXCL, which
is atomic on local and network file systems, so exactly `trials` trials run however many workers share them.
A trial trains the engine's MLP on the digits set for `steps` steps over lr, width and weight decay, reports the
held-out accuracy every `report_every` steps, and stops when the MedianPruner says it is below the median of the
trials before it at that step. "Steps saved" is what pruned trials did not run.

Each worker's sampler is TPE seeded with `seed + index`, so a rerun with one worker and the same seed proposes
the same first trials (with several workers, which worker gets which slot depends on timing).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cluster.slurm import job_fields, job_phase, slurm_command, slurm_env
from ..errors import LaunchError, RunFailed, SpecError
from ..launch.base import start_process
from ..paths import json_lines
from ..run.procs import scrub_env
from .large_batch import _batches, one_thread

SPACE = {"lr": (1e-3, 1.0), "width": (8, 128), "weight_decay": (1e-6, 1e-2)}
"""The search space: lr and weight decay log-uniform, width an integer on a log scale (hidden units)."""
ENGINE_SPACE = {"lr": (1e-3, 1.0), "width": [8, 16, 32], "weight_decay": (1e-6, 1e-2)}
"""The space of engine-run trials (`trial_run_spec`): width is the CNN's first channels (a choice: GroupNorm needs
channels its 8 groups divide)."""
ENGINE_BATCH = 64
LAUNCHERS = ("local", "slurm")
NOT_WRITTEN = "objective-not-written"
"""A worker leaves this file in out_dir when the student's objective raised NotImplementedError."""
BATCH = 64  # samples per step: a trial of 80 steps is well under a second on one CPU thread


def trial_spec(params: dict, seed: int = 0):
    """The RunSpec a trial trains: the engine's one-hidden-layer MLP on digits, with the trial's hyperparameters."""
    from ..run.spec import preset
    return preset("tiny").with_overrides({
        "name": "hpo-trial", "data.source": "digits", "model.name": "mlp", "model.depth": 1,
        "model.width": int(params["width"]), "optim.name": "sgd", "optim.lr": float(params["lr"]),
        "optim.weight_decay": float(params["weight_decay"]), "optim.batch_per_worker": BATCH, "seed": seed})


def suggest(trial, space: dict = SPACE) -> dict:
    """The trial's hyperparameters, drawn from `space` (SPACE, or ENGINE_SPACE for engine-run trials)."""
    return {"lr": trial.suggest_float("lr", *space["lr"], log=True),
            "width": trial.suggest_categorical("width", space["width"]) if isinstance(space["width"], list)
            else trial.suggest_int("width", *space["width"], log=True),
            "weight_decay": trial.suggest_float("weight_decay", *space["weight_decay"], log=True)}


def objective(trial, steps: int, report_every: int, seed: int) -> float:
    """Train one trial, reporting held-out accuracy every `report_every` steps; raises TrialPruned when told to."""
    import optuna

    from ..data import build_dataset
    from ..data.loader import build_eval_set
    from ._common import build_workload
    spec = trial_spec(suggest(trial), seed)
    wl = build_workload(spec, device=torch.device("cpu"), dataset=build_dataset(spec.data, spec.seed))
    x_eval, y_eval = build_eval_set(spec.data, spec.seed)
    batches, accuracy = _batches(wl.dataset, BATCH, seed + trial.number), 0.0
    for step in range(1, steps + 1):
        x, y = next(batches)
        loss = F.cross_entropy(wl.model(x), y)
        wl.optimizer.zero_grad()
        loss.backward()
        wl.optimizer.step()
        if step % report_every == 0 or step == steps:
            with torch.no_grad():
                accuracy = float((wl.model(x_eval).argmax(1) == y_eval).float().mean())
            trial.report(accuracy, step)
            trial.set_user_attr("steps", step)
            # the pruner compares this accuracy with the median of earlier trials at the same step
            if step < steps and trial.should_prune():
                raise optuna.TrialPruned()
    return accuracy


def trial_run_spec(trial, cfg: dict):
    """The engine run of a trial whose objective is the student's (`parallel_hpo(objective=...)`): the engine's
    small CNN on the heat fields (a step of ~3-10 ms on one thread, so an objective watching its events can stop it
    in time) with the trial's lr, channels and weight decay (ENGINE_SPACE), one rank on one thread, `steps` steps,
    an `eval` event every `report_every` steps, its folder <out_dir>/trials/<number>."""
    p = suggest(trial, ENGINE_SPACE)
    return trial_spec(p, cfg["seed"]).with_overrides({
        "name": f"hpo-trial-{trial.number}", "output_dir": str(Path(cfg["out_dir"]) / "trials" / f"{trial.number:03d}"),
        "data.source": "heat", "model.name": "cnn", "model.depth": 2, "optim.batch_per_worker": ENGINE_BATCH,
        "steps": cfg["steps"], "eval_every": cfg["report_every"], "world.workers_per_node": 1,
        "world.threads_per_worker": 1})


def engine_objective(trial, spec) -> float:
    """The library's answer to lab 10's exercise 1: launch the trial's engine run, report rank 0's held-out
    accuracy at every `eval` event as it is written, stop the run and prune the trial when the pruner says so;
    else the run's final accuracy."""
    import optuna

    from ..launch import launch
    run = launch(spec)
    for event in run.follow("eval"):
        if event.get("rank", 0) == 0:
            trial.report(event["accuracy"], event["step"])
            if trial.should_prune():
                run.stop()
                raise optuna.TrialPruned()
    return run.wait()["eval_accuracy"]


def steps_run(run_dir) -> int:
    """The last step rank 0 of an engine run logged (0: none)."""
    path = Path(run_dir) / "events" / "rank-0.jsonl"
    steps = [e.get("step", 0) for e in json_lines(path.read_bytes()) if e.get("type") == "step"] \
        if path.exists() else []
    return max([s for s in steps if isinstance(s, int)], default=0)


def storage(out_dir):
    """The study's storage: one journal file, shared by every worker (no database server)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    return JournalStorage(JournalFileBackend(str(Path(out_dir) / "study.journal")))


def _claim(out_dir: Path, trials: int) -> int | None:
    """The first free trial slot, taken atomically (O_EXCL create), or None when all `trials` are taken."""
    for n in range(trials):
        try:
            os.close(os.open(out_dir / "claims" / str(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            continue
    return None


def run_worker(out_dir, index: int) -> int:
    """One worker: claim slots and run trials until all are taken; returns the number of trials it ran."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir = Path(out_dir)
    cfg = json.loads((out_dir / "hpo.json").read_text())
    sampler = optuna.samplers.TPESampler(seed=cfg["seed"] + index, n_startup_trials=cfg["startup_trials"])
    # no pruning on the first report: accuracy after a few steps says little
    pruner = optuna.pruners.MedianPruner(n_startup_trials=cfg["pruner_startup"],
                                         n_warmup_steps=2 * cfg["report_every"])
    study = optuna.load_study(study_name=cfg["study"], storage=storage(out_dir), sampler=sampler, pruner=pruner)
    _start_together(out_dir, index, cfg)
    ran = 0
    with one_thread():  # a tiny MLP: threads cost more than they give, and workers share the cores
        while _claim(out_dir, cfg["trials"]) is not None:
            ran += _run_trial(study, index, cfg)
    return ran


def _start_together(out_dir: Path, index: int, cfg: dict) -> None:
    """Load the data (the slow part of a start), mark this worker ready, and wait up to `sync_start_s` for the
    others: with trials far shorter than an interpreter's start, the first worker up would otherwise take them all."""
    from ..data import build_dataset
    build_dataset(trial_spec({"lr": 0.1, "width": 8, "weight_decay": 0.0}).data, cfg["seed"])
    (out_dir / "ready").mkdir(exist_ok=True)
    (out_dir / "ready" / str(index)).touch()
    deadline = time.monotonic() + cfg["sync_start_s"]
    while len(list((out_dir / "ready").iterdir())) < cfg["workers"] and time.monotonic() < deadline:
        time.sleep(0.1)


def _run_trial(study, index: int, cfg: dict) -> int:
    """Ask the study for a trial, train it (in this process, or as an engine run the student's objective launches),
    tell the study how it ended."""
    import optuna
    trial = study.ask()
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("host", socket.gethostname())
    trial.set_user_attr("worker", index)
    spec = trial_run_spec(trial, cfg) if cfg.get("objective") else None
    try:
        if spec is None:
            value = objective(trial, cfg["steps"], cfg["report_every"], cfg["seed"])
        else:
            from .own_code import load_own
            try:
                value = float(load_own(cfg["objective"], source_dir=cfg["code_dir"])[0](trial, spec))
            except NotImplementedError:  # the exercise is not written yet: the parent says so (parallel_hpo)
                (Path(cfg["out_dir"]) / NOT_WRITTEN).touch()
                raise
        state = "complete"
    except optuna.TrialPruned:
        state = "pruned"
    if spec is not None:  # what ran is what the run's own events say
        trial.set_user_attr("run_dir", spec.output_dir)
        trial.set_user_attr("steps", steps_run(spec.output_dir))
    if state == "complete":
        study.tell(trial, value)
    else:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    print(f"worker {index}: trial {trial.number} {state} {trial.params}", flush=True)
    return 1


def worker_command(out_dir, index: int, python: str | None = None) -> list[str]:
    """The command line of one worker."""
    return [python or sys.executable, "-m", "scalelab.experiments.hpo", "worker", str(out_dir), str(index)]


def worker_script(out_dir, index: int, python: str | None = None, time_limit: str = "00:10:00") -> str:
    """The sbatch script of one worker: one task, one CPU, its output in out_dir/logs."""
    import shlex
    out_dir = Path(out_dir).resolve()
    cmd = " ".join(shlex.quote(p) for p in worker_command(out_dir, index, python))
    return "\n".join(["#!/bin/bash", f"#SBATCH --job-name=scalelab-hpo-{index}", "#SBATCH --ntasks=1",
                      "#SBATCH --cpus-per-task=1", f"#SBATCH --time={time_limit}",
                      f"#SBATCH --output={out_dir}/logs/worker-{index}.log", "set -euo pipefail",
                      "export OMP_NUM_THREADS=1", f"exec {cmd}", ""])


def _check(trials, workers, steps, report_every, launcher) -> None:
    """Name the first bad argument."""
    for name, value in (("trials", trials), ("workers", workers), ("steps", steps), ("report_every", report_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(name, f"must be a positive integer, got {value!r}")
    if report_every > steps:
        raise SpecError("report_every", f"{report_every} is more than steps={steps}: no trial could be pruned")
    if launcher not in LAUNCHERS:
        raise SpecError("launcher", f"unknown launcher {launcher!r}; choose one of: {', '.join(LAUNCHERS)}")


def _start_local(out_dir: Path, workers: int, env: dict, python) -> list:
    """Start the workers as subprocesses that end if this process dies (a dead kernel leaves none behind)."""
    return [start_process(worker_command(out_dir, i, python), env, out_dir / "logs" / f"worker-{i}.log")
            for i in range(workers)]


def _wait_local(procs: list, out_dir: Path, deadline: float) -> None:
    """Wait for every worker; RunFailed naming the first that failed (with its log's tail)."""
    for i, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RunFailed(f"HPO workers still running after the timeout; see {out_dir}/logs") from None
        if rc:
            raise RunFailed(f"HPO worker {i} exited with status {rc}: {_tail(out_dir, i)}", rank=i,
                            run_dir=str(out_dir))


def _start_slurm(out_dir: Path, workers: int, env: dict, python) -> list[str]:
    """sbatch one job per worker; returns the job ids."""
    jobs = []
    for i in range(workers):
        script = out_dir / f"worker-{i}.sh"
        script.write_text(worker_script(out_dir, i, python))
        r = slurm_command(["sbatch", "--parsable", "--chdir", str(out_dir), str(script)], env)
        if r.returncode:
            for job in jobs:
                slurm_command(["scancel", job], env)
            raise LaunchError(f"sbatch refused HPO worker {i}: {(r.stderr or r.stdout).strip()} (script: {script})")
        jobs.append(r.stdout.strip().split(";")[0])
        # cancels the job if this process dies before it ends (a SIGKILL, a dead kernel)
        start_process([sys.executable, "-m", "scalelab.cluster.guard", jobs[-1]], env, out_dir / f"guard-{i}.log")
    return jobs


def _wait_slurm(jobs: list[str], out_dir: Path, env: dict, deadline: float) -> None:
    """Poll the jobs until they end (scancel all at the deadline); RunFailed naming a job that did not complete."""
    pending = dict(enumerate(jobs))
    while pending:
        for i, job in list(pending.items()):
            fields = job_fields(job, env)
            if job_phase(fields.get("JobState", "")) == "ended":
                del pending[i]
                state = fields.get("JobState", "gone")
                if state not in ("COMPLETED", "gone"):
                    raise RunFailed(f"HPO worker {i} (job {job}) ended {state}: {_tail(out_dir, i)}", rank=i,
                                    run_dir=str(out_dir))
        if pending and time.monotonic() > deadline:
            raise RunFailed(f"HPO worker jobs {sorted(pending.values())} did not end before the timeout")
        time.sleep(0.5 if pending else 0)


def _tail(out_dir: Path, index: int, lines: int = 8) -> str:
    """The last lines of a worker's log."""
    path = out_dir / "logs" / f"worker-{index}.log"
    return " | ".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def prepare_study(out_dir, trials: int, steps: int, seed: int, report_every: int = 10, startup_trials: int = 10,
                  pruner_startup: int = 2, workers: int = 1, sync_start_s: float = 0.0,
                  objective: str | None = None) -> Path:
    """Write the settings and create an empty study in `out_dir` (replacing an earlier one); returns `out_dir`."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir = Path(out_dir).resolve()
    for old in ("study.journal", "claims", "logs", "ready", "hpo.json", "trials", NOT_WRITTEN):
        path = out_dir / old
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    (out_dir / "claims").mkdir(parents=True)
    (out_dir / "logs").mkdir()
    cfg = {"study": "scalelab-hpo", "trials": trials, "steps": steps, "seed": seed, "report_every": report_every,
           "startup_trials": startup_trials, "pruner_startup": pruner_startup, "workers": workers,
           "sync_start_s": sync_start_s, "objective": objective, "code_dir": os.getcwd(), "out_dir": str(out_dir)}
    (out_dir / "hpo.json").write_text(json.dumps(cfg, indent=1))
    optuna.create_study(study_name=cfg["study"], storage=storage(out_dir), direction="maximize")
    return out_dir


def parallel_hpo(out_dir, trials: int = 16, workers: int = 2, steps: int = 80, seed: int = 0,
                 launcher: str = "local", report_every: int = 10, startup_trials: int = 10,
                 pruner_startup: int = 2, sync_start_s: float = 0.0, env: dict | None = None,
                 python: str | None = None, timeout: float = 600, objective: str | None = None) -> dict:
    """Run `trials` trials on `workers` worker processes (local) or batch jobs (slurm) sharing one journal file in
    `out_dir` (on a file system the nodes share, for slurm); returns the summary (`summarize`) plus "launcher",
    "workers" and "wall_s". TPE samples at random for the first `startup_trials` trials; the pruner stops
    nothing before `pruner_startup` trials have finished. With `sync_start_s` > 0 each worker waits (that long
    at most) for the others to be up before its first trial: for a demonstration on one machine; leave it 0 on a
    busy queue, where a worker's job may start much later. A rerun in the same `out_dir` replaces the study.
    `objective` ("module:function" beside the notebook, e.g. "my_objective:objective"): each trial is an engine
    run (`trial_run_spec`) that function launches and reports (`engine_objective` is the library's own); default:
    the trial trains in the worker's process."""
    _check(trials, workers, steps, report_every, launcher)
    if objective is not None:
        from ..run.validate import CODE_REF
        if not isinstance(objective, str) or not CODE_REF.match(objective) or "." in objective.partition(":")[0]:
            raise SpecError("objective", f"{objective!r} must name a function in a module beside the notebook, "
                                         "as module:function (e.g. my_objective:objective)")
    out_dir = prepare_study(out_dir, trials, steps, seed, report_every, startup_trials, pruner_startup, workers,
                            sync_start_s, objective)
    env = scrub_env(env)
    env["OMP_NUM_THREADS"] = "1"
    start, deadline = time.monotonic(), time.monotonic() + timeout
    try:
        if launcher == "local":
            procs = _start_local(out_dir, workers, env, python)
            try:
                _wait_local(procs, out_dir, deadline)
            finally:  # an interrupt (or a failed worker) ends the others
                for p in procs:
                    if p.poll() is None:
                        p.kill()
        else:
            env = slurm_env(env)
            jobs = _start_slurm(out_dir, workers, env, python)
            try:
                _wait_slurm(jobs, out_dir, env, deadline)
            except BaseException:
                for job in jobs:
                    slurm_command(["scancel", job], env)
                raise
    except RunFailed:
        if (out_dir / NOT_WRITTEN).exists():
            from .own_code import not_written
            raise not_written(objective) from None
        raise
    return {**summarize(out_dir), "launcher": launcher, "workers": workers, "wall_s": time.monotonic() - start}


def summarize(out_dir) -> dict:
    """What the study in `out_dir` found: {"trials": [{number, params, value, state, steps, pid, host, worker,
    seconds}], "best", "complete", "pruned", "steps_run", "steps_saved", "steps_budget", "trials_per_worker",
    "journal", "seed"}."""
    import optuna
    out_dir = Path(out_dir)
    cfg = json.loads((out_dir / "hpo.json").read_text())
    study = optuna.load_study(study_name=cfg["study"], storage=storage(out_dir))
    rows = []
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        a = t.user_attrs
        rows.append({"number": t.number, "params": dict(t.params), "state": t.state.name.lower(),
                     "value": t.value if t.value is not None else t.intermediate_values.get(a.get("steps")),
                     "steps": a.get("steps", 0), "pid": a.get("pid"), "host": a.get("host"),
                     "worker": a.get("worker"), "run_dir": a.get("run_dir"),
                     "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())}, "seconds": (t.datetime_complete - t.datetime_start).total_seconds()
                     if t.datetime_complete and t.datetime_start else None})
    done = [r for r in rows if r["state"] == "complete"]
    best = max(done, key=lambda r: r["value"]) if done else None
    per_worker: dict = {}
    for r in rows:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    pruned = [r for r in rows if r["state"] == "pruned"]
    return {"trials": rows, "best": best, "complete": len(done), "pruned": len(pruned),
            "steps_run": sum(r["steps"] for r in rows), "steps_budget": cfg["steps"] * len(rows),
            "steps_saved": sum(cfg["steps"] - r["steps"] for r in pruned), "trials_per_worker": per_worker,
            "journal": str(out_dir / "study.journal"), "seed": cfg["seed"]}


def main(argv: list[str] | None = None) -> int:
    """`python -m scalelab.experiments.hpo worker <out_dir> <index>`: run one worker."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "worker":
        print("usage: python -m scalelab.experiments.hpo worker <out_dir> <index>", file=sys.stderr)
        return 2
    run_worker(argv[1], int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
