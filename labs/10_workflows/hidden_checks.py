"""Lab 10 hidden checks: the performance-model runs against their event files; the search, the stream and the
model held against their own records and the arithmetic they follow from.

HPO, NAS, continual learning and the queue run in the notebook's process or its workers, so they are held
against themselves: trial steps against the budget, the lineage against the models, the ranks' replicas against
each other, the model's coefficients refitted from its training rows.
"""
import math

from scalelab.grade.checks import check, close, evidence


@check(points=2, needs_run=True)
def perf_rows_are_the_engine_runs(r):
    """Each performance-model row's samples/s and ranks are what its run's event files show."""
    for row in r["perf"]["rows"]:
        found = evidence(r, row["run_dir"])
        assert found["world_size"] == row["ranks"], f"{row['run_dir']}: {found['world_size']} ranks ran"
        close(found["samples_per_s"], row["samples_per_s"], what=f"{row['run_dir']} samples/s")


@check(points=1, needs_run=True)
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


@check(points=1, needs_run=True)
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


@check(points=1, needs_run=True)
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


@check(points=1, needs_run=True)
def ranks_share_one_buffer(r):
    """On several ranks each holds its share of the buffer, and the replicas stay one model."""
    ranks, p = r["continual_ranks"], r["lab10_params"]
    assert len(ranks) == p["workers"]
    assert all(x["buffer_per_rank"] == max(p["buffers"]) // p["workers"] for x in ranks)
    assert all(x["acc"] == ranks[0]["acc"] for x in ranks), "the ranks' models differ"


@check(points=1, needs_run=True)
def stream_records_are_consistent(r):
    """Old-task accuracy and forgetting follow from each run's accuracy matrix."""
    for b, x in r["continual"].items():
        acc, tasks = x["acc"], len(x["acc"])
        old = [acc[-1][j] for j in range(tasks - 1)]
        assert math.isclose(x["old_accuracy"], sum(old) / len(old), abs_tol=1e-9), f"buffer {b}: old accuracy"
        assert int(b) == x["buffer"]
