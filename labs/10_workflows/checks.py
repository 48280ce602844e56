"""Lab 10 public checks: HPO with pruning, NAS with model transfer and its lineage, continual learning with
rehearsal, a performance model's held-out error, a job chain on a queue."""
import math

from scalelab.grade.checks import check


@check(points=1, needs_run=True)
def hpo_ran_on_every_worker(r):
    """The search ran its trials, spread over its workers."""
    h, p = r["hpo"], r["lab10_params"]
    assert len(h["trials"]) == p["hpo_trials"], f"{len(h['trials'])} trials, expected {p['hpo_trials']}"
    assert len(h["trials_per_worker"]) == min(p["hpo_workers"], p["hpo_trials"]), \
        f"trials per worker {h['trials_per_worker']}: every worker should have pulled trials"
    assert h["best"] is not None and h["best"]["value"] > 0.5, "no completed trial reached 50 % accuracy"


@check(points=2, needs_run=True)
def pruning_saving_computed(r):
    """Exercise 1: the share of the full budget that pruned trials did not run."""
    trials, steps = r["hpo"]["trials"], r["lab10_params"]["hpo_steps"]
    want = (steps * len(trials) - sum(t["steps"] for t in trials)) / (steps * len(trials))
    assert math.isclose(r["pruning_saving"], want, rel_tol=1e-6, abs_tol=1e-9), \
        f"pruning_saving = {r['pruning_saving']!r}; expected {want:.4f}"


@check(points=1, needs_run=True)
def children_start_where_their_parents_ended(r):
    """Model transfer is function-preserving: a child's starting accuracy is its parent's final accuracy."""
    models = {m["id"]: m for m in r["nas"]["models"]}
    children = [m for m in models.values() if m["parent"] is not None]
    assert children, "the search produced no child"
    for m in children:
        assert math.isclose(m["start_accuracy"], models[m["parent"]]["accuracy"], abs_tol=1e-6), \
            f"model {m['id']} starts at {m['start_accuracy']}, its parent ended at {models[m['parent']]['accuracy']}"


@check(points=2, needs_run=True)
def seconds_saved_computed(r):
    """Exercise 2: steps saved x seconds per step, summed over the children."""
    want = sum(m["steps_saved"] * m["s_per_step"] for m in r["nas"]["models"] if m["parent"] is not None)
    assert math.isclose(r["seconds_saved"], want, rel_tol=1e-6, abs_tol=1e-12), \
        f"seconds_saved = {r['seconds_saved']!r}; expected {want:.4g}"


@check(points=1, needs_run=True)
def frozen_child_shares_its_parents_tensors(r):
    """The lineage store kept the frozen child's unchanged tensors once."""
    lin = r["lineage"]
    assert lin["frozen_shared"], "the frozen child shared no tensor with its parent"
    assert lin["final"]["stored_bytes"] - lin["after_search"]["stored_bytes"] < \
        0.5 * (lin["final"]["full_copy_bytes"] - lin["after_search"]["full_copy_bytes"])


@check(points=1, needs_run=True)
def rehearsal_fights_forgetting(r):
    """Without a buffer the old tasks are forgotten; the largest buffer keeps more of them."""
    cl = r["continual"]
    sizes = sorted(int(b) for b in cl)
    assert sizes[0] == 0, "compare with no buffer (0)"
    assert cl[str(sizes[-1])]["old_accuracy"] > cl["0"]["old_accuracy"] + 0.1


@check(points=2, needs_run=True)
def forgetting_measured(r):
    """Exercise 3: task 0's accuracy right after it, minus at the end, without a buffer."""
    acc = r["continual"]["0"]["acc"]
    want = acc[0][0] - acc[-1][0]
    assert math.isclose(r["forgetting_first"], want, abs_tol=1e-9), \
        f"forgetting_first = {r['forgetting_first']!r}; expected {want:.4f}"


@check(points=2, needs_run=True)
def perf_error_computed(r):
    """Exercise 4: the held-out mean relative error of the fitted model."""
    import numpy as np
    p = r["perf"]
    held = [x for x in p["rows"] if x["run_dir"] in p["held_out"]]
    assert held, "no held-out run"
    def predict(x):
        f = [1.0, math.log(x["params"]), math.log(x["batch"]), math.log(x["ranks"]), math.log(x["nodes"]),
             math.log(x["link_mbit"])]
        return math.exp(float(np.dot(p["model"]["coef"], f)))
    want = sum(abs(predict(x) - x["samples_per_s"]) / x["samples_per_s"] for x in held) / len(held)
    assert math.isclose(r["perf_error"], want, rel_tol=1e-6), f"perf_error = {r['perf_error']!r}; expected {want:.4f}"


@check(points=1, needs_run=True)
def early_submission_closes_the_gaps(r):
    """Submitting the chain ahead (afterok) leaves less idle time between links than submitting reactively."""
    q = r["queue"]
    assert q["afterok"]["total_idle_h"] < q["reactive"]["total_idle_h"]
