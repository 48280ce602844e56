"""Lab 10 hidden checks: the performance-model runs against their event files; the search, the stream and the
model held against their own records and the arithmetic they follow from.

HPO, NAS, continual learning and the queue run in the notebook's process or its workers, so they are held
against themselves: trial steps against the budget, the lineage against the models, the ranks' replicas against
each other, the model's coefficients refitted from its training rows.
"""
import math

from scalelab.grade.checks import check, close, evidence, param


@check(points=0.25, needs_run=True)
def perf_rows_are_the_engine_runs(r):
    """Each performance-model row's samples/s and ranks are what its run's event files show."""
    for row in r["perf"]["rows"]:
        found = evidence(r, row["run_dir"], total_steps="perf_steps")
        assert found["world_size"] == row["ranks"], f"{row['run_dir']}: {found['world_size']} ranks ran"
        close(found["samples_per_s"], row["samples_per_s"], what=f"{row['run_dir']} samples/s")


@check(points=0.25, needs_run=True)
def perf_model_is_fitted_on_its_rows(r):
    """The model's coefficients are the ridge least-squares fit of the rows that were not held out."""
    import numpy as np
    p = r["perf"]
    train = [x for x in p["rows"] if x["run_dir"] not in p["held_out"]]
    a = np.array([[1.0, math.log(x["params"]), math.log(x["batch"]), math.log(x["ranks"]), math.log(x["nodes"]),
                   math.log(x["link_mbit"])] for x in train])
    b = np.log([x["samples_per_s"] for x in train])
    coef = np.linalg.solve(a.T @ a + 1e-3 * np.eye(a.shape[1]), a.T @ b)
    assert np.allclose(coef, p["model"]["coef"], rtol=1e-6, atol=1e-9), "the model is not the fit of its rows"


@check(points=0.25, needs_run=True)
def hpo_trials_are_consistent(r):
    """Complete trials ran the full budget, pruned ones less; the totals add up."""
    h, steps = r["hpo"], r["lab10_params"]["hpo_steps"]
    for t in h["trials"]:
        if t["state"] == "complete":
            assert t["steps"] == steps, f"trial {t['number']} complete after {t['steps']} of {steps} steps"
        elif t["state"] == "pruned":
            assert 0 < t["steps"] < steps, f"trial {t['number']} pruned after {t['steps']} steps"
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
    """Exercise 1: the saving is the share of the grader's budget (hpo_trials x hpo_steps) that the pruned trials
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
    """Exercise 2: the seconds saved are each child's steps saved at its own seconds per step, over the children
    the lineage names."""
    n = r["nas"]
    children = {int(k) for k in n["lineage"]}
    want = sum(m["steps_saved"] * m["s_per_step"] for m in n["models"] if m["id"] in children)
    assert children and math.isclose(r["seconds_saved"], want, rel_tol=1e-6, abs_tol=1e-12), \
        f"seconds_saved {r['seconds_saved']!r}; the lineage's children saved {want:.4g}"


@check(points=5, needs_run=True)
def forgetting_is_the_streams(r):
    """Exercise 3: task 0's forgetting is its accuracy right after it minus at the end, in the stream without a
    buffer."""
    acc = r["continual"]["0"]["acc"]
    want = acc[0][0] - acc[-1][0]
    assert math.isclose(r["forgetting_first"], want, abs_tol=1e-9), \
        f"forgetting_first {r['forgetting_first']!r}; the stream without a buffer gives {want:.4f}"


@check(points=7, needs_run=True)
def perf_error_is_the_held_out_runs(r):
    """Exercise 4: the error is the model's mean relative error on the held-out runs, whose samples/s are their
    event files' (each ran the grader's perf_steps)."""
    p = r["perf"]
    held = [x for x in p["rows"] if x["run_dir"] in p["held_out"]]
    assert held, "no held-out run"
    errors = []
    for x in held:
        found = evidence(r, x["run_dir"], total_steps="perf_steps")
        close(found["samples_per_s"], x["samples_per_s"], what=f"{x['run_dir']} samples/s")
        f = [1.0, math.log(x["params"]), math.log(x["batch"]), math.log(x["ranks"]), math.log(x["nodes"]),
             math.log(x["link_mbit"])]
        predicted = math.exp(sum(c * v for c, v in zip(p["model"]["coef"], f)))
        errors.append(abs(predicted - found["samples_per_s"]) / found["samples_per_s"])
    want = sum(errors) / len(errors)
    assert math.isclose(r["perf_error"], want, rel_tol=1e-6), f"perf_error {r['perf_error']!r}; the held-out " \
                                                              f"runs give {want:.4f}"
