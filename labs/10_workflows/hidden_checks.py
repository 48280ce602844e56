"""Lab 10 hidden checks: the search, the lineage, the streams and the online run held against their own records,
their runs' event files and logs, and the arithmetic they follow from.

HPO trials are engine runs: every value the objective reported is held to its run's eval events. NAS and continual
learning run in the notebook's process or on its ranks, so they are held against themselves: trial steps against
the budget, the lineage against the models, the ranks' replicas against each other; the buffers' samples per task
against a uniform sample of the stream; the online run's solver and trainer against their stream logs.
"""
import json
import math

from scalelab.experiments import online
from scalelab.experiments.profiling import read_run_file
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import WORKDIR


@check(points=0.25, needs_run=True)
def hpo_trials_are_consistent(r):
    """Complete trials ran the full budget, pruned ones less; the totals add up."""
    h, steps = r["hpo"], r["lab10_params"]["hpo_steps"]
    for t in h["trials"]:
        if t["state"] == "complete":
            assert t["steps"] == steps, f"trial {t['number']} complete after {t['steps']} of {steps} steps"
        elif t["state"] == "pruned":  # a run stopped late may have reached its end
            assert 0 < t["steps"] <= steps, f"trial {t['number']} pruned after {t['steps']} steps"
    assert h["steps_run"] == sum(t["steps"] for t in h["trials"])
    assert h["pruned"] == sum(t["state"] == "pruned" for t in h["trials"])
    assert sum(h["trials_per_worker"].values()) == len(h["trials"])


@check(points=0.25, needs_run=True)
def nas_lineage_is_its_models(r):
    """The lineage maps every child to its parent, and the lineage store's chain follows it."""
    n = r["nas"]
    lineage = {int(k): v for k, v in n["lineage"].items()}
    assert lineage == {m["id"]: m["parent"] for m in n["models"] if m["parent"] is not None}
    assert n["steps_saved"] == sum(m["steps_saved"] for m in n["models"] if m["parent"] is not None)
    chain = r["lineage"]["chain"]
    assert chain[0] == "frozen-child" and all(c.startswith("nas-") for c in chain[1:])
    for child, parent in zip(chain[1:], chain[2:]):
        assert lineage[int(child[4:])] == int(parent[4:]), f"{child}'s parent is not {parent}"


@check(points=0.25, needs_run=True)
def ranks_share_one_buffer(r):
    """On several ranks each holds its share of the buffer, and the replicas stay one model."""
    ranks, p = r["continual_ranks"], r["lab10_params"]
    assert len(ranks) == p["workers"]
    assert all(x["buffer_per_rank"] == max(p["buffers"]) // p["workers"] for x in ranks)
    assert all(x["acc"] == ranks[0]["acc"] for x in ranks), "the ranks' models differ"


@check(points=0.25, needs_run=True)
def stream_records_are_consistent(r):
    """Old-task accuracy and forgetting follow from each run's accuracy matrix."""
    for b, x in r["continual"].items():
        acc, tasks = x["acc"], len(x["acc"])
        old = [acc[-1][j] for j in range(tasks - 1)]
        assert math.isclose(x["old_accuracy"], sum(old) / len(old), abs_tol=1e-9), f"buffer {b}: old accuracy"
        assert int(b) == x["buffer"]


# The exercises, held against what ran: the grader's sizes, the runs' own rows and event files (points for the
# student's own work; the checks above hold records to runs that an untouched copy makes as well).

@check(points=6, needs_run=True)
def pruning_saving_is_the_searchs(r):
    """Exercise 2: the saving is the share of the grader's budget (hpo_trials x hpo_steps) that the pruned trials
    did not run, as the search counted its steps."""
    h = r["hpo"]
    steps = param(r, "hpo_steps") or r["lab10_params"]["hpo_steps"]
    trials = param(r, "hpo_trials") or len(h["trials"])
    assert len(h["trials"]) == trials, f"{len(h['trials'])} trials ran, the grader set hpo_trials={trials}"
    budget = steps * trials
    assert h["steps_run"] == sum(t["steps"] for t in h["trials"]), "steps_run is not the trials' steps"
    want = (budget - h["steps_run"]) / budget
    assert math.isclose(r["pruning_saving"], want, rel_tol=1e-6, abs_tol=1e-9), \
        f"pruning_saving {r['pruning_saving']!r}; the search saved {want:.4f}"


@check(points=5, needs_run=True)
def seconds_saved_is_the_lineages(r):
    """Exercise 3: the seconds saved are each child's steps saved at its own seconds per step, over the children
    the lineage names."""
    n = r["nas"]
    children = {int(k) for k in n["lineage"]}
    want = sum(m["steps_saved"] * m["s_per_step"] for m in n["models"] if m["id"] in children)
    assert children and math.isclose(r["seconds_saved"], want, rel_tol=1e-6, abs_tol=1e-12), \
        f"seconds_saved {r['seconds_saved']!r}; the lineage's children saved {want:.4g}"


@check(points=5, needs_run=True)
def forgetting_is_the_streams(r):
    """Exercise 4: task 0's forgetting is its accuracy right after it minus at the end, in the stream without a
    buffer."""
    acc = r["continual"]["0"]["acc"]
    want = acc[0][0] - acc[-1][0]
    assert math.isclose(r["forgetting_first"], want, abs_tol=1e-9), \
        f"forgetting_first {r['forgetting_first']!r}; the stream without a buffer gives {want:.4f}"


def _in_proportion(counts: list[int], capacity: int, where: str) -> None:
    """A reservoir of `capacity` over a stream of equal tasks holds each task's share up to binomial noise."""
    tasks = len(counts)
    assert sum(counts) == capacity, f"{where}: the buffer holds {sum(counts)} samples, its capacity is {capacity}"
    share, spread = capacity / tasks, 4 * math.sqrt(capacity * (1 / tasks) * (1 - 1 / tasks)) + 1
    for t, n in enumerate(counts):
        assert abs(n - share) <= spread, f"{where}: {n} of its {capacity} samples come from task {t}, a uniform " \
                                         f"sample of the stream holds {share:.0f} +- {spread:.0f}"


@check(points=6, needs_run=True)
def reservoir_keeps_every_task_in_proportion(r):
    """Exercise 5: every buffer your keep() filled (each buffer size, and each rank of the spread run) holds the
    first task whole after it, then each task in proportion to the stream (a uniform sample: reservoir sampling),
    and the largest buffer keeps more of the old tasks than no buffer."""
    cl, spread = r["continual"], r["continual_ranks"]
    runs = [(f"buffer {b}", x) for b, x in cl.items() if int(b) > 0] + \
        [(f"rank {x['rank']} of the spread run", x) for x in spread]
    assert any(int(b) > 0 for b in cl), "no run with a buffer: keep in my_buffer.py is not written yet"
    for where, x in runs:
        assert "my_buffer.py" in x.get("code", {}), f"{where} did not run my_buffer.py's keep"
        capacity, after = x["buffer_per_rank"], x["buffer_tasks"]
        assert after[0][0] == min(capacity, x["steps_per_task"] * x["batch"]), \
            f"{where}: after the first task its buffer holds {after[0]}: it should be full of task 0"
        _in_proportion(after[-1], capacity, where)
    largest = str(max(int(b) for b in cl))
    assert cl[largest]["old_accuracy"] > cl["0"]["old_accuracy"] + 0.1, \
        f"old tasks: {cl[largest]['old_accuracy']:.3f} with a buffer of {largest}, {cl['0']['old_accuracy']:.3f} without"


def _stream(r, run) -> dict:
    """The online run's own logs, read from the working copy as the grader reads any file a run wrote."""
    names = [f"solver-{x['rank']}" for x in run["solvers"]] + [f"trainer-{run['trainer']['rank']}"]
    out = {}
    for name in names:
        text = read_run_file(r[WORKDIR], f"{run['dir']}/{online.EVENTS_DIR}/{name}.jsonl")
        out[name] = [json.loads(line) for line in text.splitlines() if line.strip()]
    return out


def _evaluated(events: dict) -> dict:
    found = [e for k, evs in events.items() if k.startswith("trainer") for e in evs if e.get("type") == "evaluated"]
    assert found, "the trainer logged no evaluation"
    return found[-1]


@check(points=4, needs_run=True)
def online_solver_and_trainer_ran_at_once(r):
    """The online runs: solver and trainer ranks were separate processes whose logs show the trainer training on
    chunks while the solver still produced them, every chunk trained on after it was produced; the errors and the
    speed-up recorded are the trainer's own logged ones."""
    runs = r["online"]["runs"]
    chunks = param(r, "online_chunks") or r["lab10_params"]["online_chunks"]
    assert "0" in runs, "no online run without a buffer"
    for b, run in runs.items():
        events = _stream(r, run)
        pids = {k: {e.get("pid") for e in evs} for k, evs in events.items()}
        trainer = next(v for k, v in pids.items() if k.startswith("trainer"))
        assert run["solvers"] and all(len(v) == 1 for v in pids.values()) and \
            all(not (v & trainer) for k, v in pids.items() if k.startswith("solver")), \
            f"buffer {b}: the solver and the trainer were not separate processes"
        lap = online.overlap(events)
        assert lap["chunks_produced"] == lap["chunks_trained"] == chunks, \
            f"buffer {b}: {lap['chunks_produced']} chunks produced, {lap['chunks_trained']} trained on; the grader " \
            f"set online_chunks={chunks}"
        assert lap["consumed_before_produced"] == 0, f"buffer {b}: a chunk was trained on before it was produced"
        assert lap["trained_before_last_produced"] >= 1, \
            f"buffer {b}: the trainer trained on no chunk before the solver's last one: they did not run at once"
        ev = _evaluated(events)
        t = run["trainer"]
        assert all(math.isclose(a, b_, rel_tol=1e-9) for a, b_ in zip(ev["error"], t["error"])), \
            f"buffer {b}: the recorded errors are not the ones the trainer logged"
        close(t["speedup"], ev["solver_s_per_sample"] / ev["surrogate_s_per_sample"], rel=1e-6,
              what=f"buffer {b} speed-up")


@check(points=3, needs_run=True)
def online_buffer_holds_the_first_regime(r):
    """Exercise 5 in the online run: the trainer's buffer ran your keep(), holds both regimes in proportion to the
    stream, and the first regime's error grew less after the drift than without a buffer (from the trainer's
    logged evaluations)."""
    runs = r["online"]["runs"]
    sizes = sorted(int(b) for b in runs if int(b) > 0)
    assert sizes, "no online run with a buffer: keep in my_buffer.py is not written yet"
    plain = _evaluated(_stream(r, runs["0"]))
    for b in sizes:
        ev = _evaluated(_stream(r, runs[str(b)]))
        assert "my_buffer.py" in (ev.get("code") or {}), f"buffer {b}: the online trainer did not run my_buffer.py"
        _in_proportion(ev["buffer_regimes"], b, f"the online buffer of {b}")
        grew = ev["errors_after"][-1][0] - ev["errors_after"][0][0]
        plain_grew = plain["errors_after"][-1][0] - plain["errors_after"][0][0]
        assert grew < plain_grew, f"buffer {b}: the first regime's error grew by {grew:.3f} after the drift, " \
                                  f"{plain_grew:.3f} without a buffer"


@check(points=6, needs_run=True)
def objective_reports_its_engine_runs(r):
    """Exercise 1: every trial is an engine run of this grading that your objective launched, ran for the grader's
    hpo_steps; every value it reported to optuna is that run's own held-out accuracy at that step (its eval events);
    a complete trial returned its run's final accuracy; and the pruner's verdict stopped at least one run before
    its end."""
    h = r["hpo"]
    steps = param(r, "hpo_steps") or r["lab10_params"]["hpo_steps"]
    stopped = 0
    for t in h["trials"]:
        n = t["number"]
        assert t.get("run_dir"), f"trial {n} has no engine run: the objective must launch the trial's spec"
        found = evidence(r, t["run_dir"], total_steps="hpo_steps")
        evals = {s: a for s, a in found["evals"] if isinstance(s, int)}
        assert t["intermediate"], f"trial {n} reported no accuracy to the pruner"
        for s, v in t["intermediate"].items():
            assert int(s) in evals and math.isclose(v, evals[int(s)], rel_tol=1e-6, abs_tol=1e-9), \
                f"trial {n} reported {v!r} at step {s}; its run's held-out accuracy there is {evals.get(int(s))!r}"
        last = max(found["step_numbers"] or [0])
        if t["state"] == "complete":
            assert last == steps and found["eval_accuracy"] is not None and \
                math.isclose(t["value"], found["eval_accuracy"], rel_tol=1e-6, abs_tol=1e-9), \
                f"trial {n} is complete with {t['value']!r}; its run ended at step {last} with accuracy " \
                f"{found['eval_accuracy']!r}"
        elif t["state"] == "pruned" and last < steps:
            stopped += 1
    assert stopped, "no pruned trial's run was stopped before its end: stop the run when the trial is pruned"


@check(points=0.25, needs_run=True)
def frozen_child_trained_its_head_only(r):
    """The lineage's frozen child was trained for real: its head's tensors changed, every other tensor is its
    parent's (stored once, shared)."""
    lin = r["lineage"]
    trained, shared = set(lin["frozen_trained"]), set(lin["frozen_shared"])
    assert trained, "no tensor of the frozen child changed: its head was not trained"
    heads = {name.rsplit(".", 1)[0] for name in trained}
    assert len(heads) == 1, f"tensors of several layers changed: {sorted(trained)}"
    assert not trained & shared, f"{sorted(trained & shared)} changed yet are shared with the parent"
