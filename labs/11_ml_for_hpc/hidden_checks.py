"""Lab 11 hidden checks: the performance-model runs against their event files, the model refitted from its rows;
the slow runs held to this grading's cases and the diagnosis scored against each run's spec and events; the
queue-wait model refitted from the training traces; the provisioning policy replayed: the grader simulates the
grading's own held-out traces (seeded from its nonce) with the submission times the student's policy chose, and
simulates the baselines itself.
"""
import hashlib
import json
import math
from pathlib import Path

from scalelab.experiments import root_cause
from scalelab.experiments.profiling import read_run_file
from scalelab.grade.checks import check, close, evidence, grading_nonce, param, partial
from scalelab.grade.evidence import WORKDIR


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


@check(points=7, needs_run=True)
def perf_error_is_the_held_out_runs(r):
    """Exercise 1: the model was fitted on the grid's runs and tested on the runs between its points (the grader's
    perf_widths x perf_batches x perf_ranks: 12 and 4 at its sizes); the error is its mean relative error on those
    held-out runs, whose samples/s are their event files' (each ran the grader's perf_steps)."""
    from scalelab.experiments.workflows import perf_shapes
    p, lp = r["perf"], r["lab11_params"]
    grid, between = perf_shapes(*(param(r, k) or lp[k] for k in ("perf_widths", "perf_batches", "perf_ranks")))
    shape = {x["run_dir"]: Path(x["run_dir"]).name for x in p["rows"]}
    tag = "w{}-b{}-r{}".format
    held = [x for x in p["rows"] if x["run_dir"] in p["held_out"]]
    assert sorted(shape[x["run_dir"]] for x in held) == sorted(tag(*s) for s in between), \
        f"the held-out runs are {sorted(shape[x['run_dir']] for x in held)}; the shapes between the grid's points " \
        f"are {sorted(tag(*s) for s in between)}"
    fitted = sorted(shape[x["run_dir"]] for x in p["rows"] if x["run_dir"] not in p["held_out"])
    assert fitted == sorted(tag(*s) for s in grid) and p["model"]["runs"] == len(grid), \
        f"the model was fitted on {fitted}; the grid is {sorted(tag(*s) for s in grid)}"
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


@check(points=0.25, needs_run=True)
def wait_model_is_fitted_on_the_training_traces(r):
    """The queue-wait model is the least-squares fit of the training traces' jobs."""
    from scalelab.experiments import queue_policy as qp
    model = qp.fit_wait_model(qp.wait_samples(qp.TRAIN_SEEDS))
    said = r["mirage"]["model"]["coef"]
    assert len(said) == len(model.coef) and all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
                                                for a, b in zip(said, model.coef)), \
        "the wait model is not the fit of the training traces"


@check(points=6, needs_run=True)
def provisioning_policy_replays(r):
    """Exercise 3: replayed on this grading's held-out traces, the submissions your policy chose leave less idle
    time between links than reactive submission (at most 90 % of it: over 24 traces the learned-wait policy leaves
    <= 80 % in every draw, submitting only when a link ends >= 100 %), and hold at most half the node-hours idle
    that the queue-blind average policy holds (both baselines simulated here; the learned-wait policy holds ~4 %,
    submitting at once ~170 %, over 300 traces)."""
    from scalelab.experiments import queue_policy as qp
    m = r["mirage"]
    n = param(r, "queue_test_traces") or r["lab11_params"]["queue_test_traces"]
    seeds = qp.held_out_seeds(n, grading_nonce(r))
    assert m["seeds"] == seeds, "the policies ran on other traces than this grading's held-out ones"
    yours = {x["seed"]: x for x in m["runs"] if x["policy"] == "yours"}
    assert sorted(yours) == sorted(seeds), "submit_now did not run on every held-out trace (not implemented yet?)"
    base = qp.evaluate({"average": qp.average_policy(qp.wait_samples(qp.TRAIN_SEEDS))}, seeds)["totals"]
    idle = held = 0.0
    for seed in seeds:
        again = qp.verify(yours[seed])
        for key in ("total_idle_h", "overlap_node_h"):
            assert math.isclose(again[key], yours[seed][key], rel_tol=1e-6, abs_tol=1e-6), \
                f"trace {seed}: the recorded {key} {yours[seed][key]!r} is not what its submissions give " \
                f"({again[key]:.4f})"
        idle += again["total_idle_h"]
        held += again["overlap_node_h"]
    assert idle < 0.9 * base["reactive"]["idle_h"], \
        f"your policy idles {idle:.2f} h between links, reactive submission {base['reactive']['idle_h']:.2f} h: " \
        "submitting ahead should save at least a tenth of it"
    assert held <= 0.5 * base["average"]["overlap_node_h"] + 1e-6, \
        f"your policy holds {held:.2f} node-h idle waiting for checkpoints, the queue-blind average policy " \
        f"{base['average']['overlap_node_h']:.2f}: reading the queue should halve that (submit later when it is short)"


def _run_file(r, run_dir: str, name: str) -> str:
    """A file of a slow run, re-read from the working copy (as data that may be hostile)."""
    try:
        return read_run_file(r[WORKDIR], f"{run_dir}/{name}")
    except Exception as e:  # missing, a link, too big: all the student's files
        raise AssertionError(f"{run_dir}/{name} could not be read ({type(e).__name__}: {e})") from None


def _slow_runs(r) -> tuple[dict, int]:
    """The recorded result, its runs held to 2 ranks and root_cause.STEPS steps (evidence: real runs of this
    grading, its nonce in every start event), and the grader's number of held-out cases."""
    rec = r["root_cause"]
    n = param(r, "root_cause_runs") or r["lab11_params"]["root_cause_runs"]
    for d in rec["run_dirs"]:
        evidence(r, d, world_size=2, total_steps=root_cause.STEPS)
    return rec, n


def _events_of(r):
    def read(run_dir):
        return [json.loads(line) for rank in range(2)
                for line in _run_file(r, run_dir, f"events/rank-{rank}.jsonl").splitlines() if line.strip()]
    return read


def _spec_of(r):
    return lambda run_dir: json.loads(_run_file(r, run_dir, "spec.json"))


@check(points=0.5, needs_run=True)
def slow_runs_are_this_gradings_cases(r):
    """The slow runs are engine runs of this grading, one per held-out case drawn from its nonce, each slowed as its
    spec says: the slowed rank's own time in that phase exceeds the other's by at least half of slow_s (0.08 s; the
    runs show ~0.07-0.08 s against <= 0.015 s of noise on a loaded 2-core machine)."""
    rec, n = _slow_runs(r)
    problems = root_cause.verify_runs(rec["run_dirs"], _events_of(r), _spec_of(r), grading_nonce(r), n=n)
    assert not problems, "; ".join(problems[:3])


@check(points=5, needs_run=True)
def diagnosis_names_each_slow_rank_and_phase(r):
    """Exercise 2: on this grading's held-out slow runs your diagnose named the slowed rank and phase, scored here
    against each run's spec and events; partial credit per run (the reference is right on every run under load;
    blaming the longest raw phase, the rank that waits, gets at most half)."""
    rec, n = _slow_runs(r)
    assert not rec["not_implemented"], "diagnose in my_diagnose.py is not written yet"
    problems = root_cause.verify(rec, _events_of(r), _spec_of(r), grading_nonce(r), n=n)
    assert not problems, "; ".join(problems[:3])
    sha = hashlib.sha256(_run_file(r, ".", "my_diagnose.py").encode()).hexdigest()
    assert rec.get("code", {}).get("my_diagnose.py") == sha, \
        "the answers did not come from the my_diagnose.py submitted (run its cell, then the evaluation cell)"
    cases = root_cause.held_out_cases(n, 2, grading_nonce(r))
    wrong = [f"{c} (you said {a})" for c, a in zip(cases, rec["answers"]) if a != c]
    if wrong:
        return partial(1 - len(wrong) / n, f"{len(wrong)} of {n} runs misdiagnosed: {'; '.join(wrong[:3])}")
