"""Lab 11 public checks: a performance model's held-out error, the slow runs' diagnosis, a job chain on a queue, the
provisioning policy."""
import math

from scalelab.grade.checks import check


@check(points=2, needs_run=True)
def perf_error_computed(r):
    """Exercise 1: the held-out mean relative error of the fitted model."""
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


@check(points=1, needs_run=True)
def provisioning_policy_ran(r):
    """Exercise 3: your submit_now ran on the held-out traces and left less idle time between links than reactive
    submission."""
    m = r["mirage"]
    assert "yours" in m["totals"], "submit_now is not implemented yet (it raised NotImplementedError)"
    yours, reactive = m["totals"]["yours"]["idle_h"], m["totals"]["reactive"]["idle_h"]
    assert yours < reactive, f"your policy idled {yours:.2f} h between links, reactive submission {reactive:.2f} h"


@check(points=1, needs_run=True)
def slow_runs_were_diagnosed(r):
    """Exercise 2: every slow run was made (one per held-out case) and diagnose gave each an answer."""
    rc_, n = r["root_cause"], r["lab11_params"]["root_cause_runs"]
    assert not rc_["not_implemented"], "diagnose in my_diagnose.py is not written yet (it raised NotImplementedError)"
    assert len(rc_["run_dirs"]) == n == len(rc_["answers"]), \
        f"{len(rc_['run_dirs'])} runs, {len(rc_['answers'])} answers; expected {n} of each"
    assert all(a["phase"] in ("data", "compute") for a in rc_["answers"]), "a phase is data or compute"
