"""Lab 01 hidden checks: the engine baseline against its event files, and recorded values against each other.

The engine baseline and the two traced runs (before and after the fix) are what events and traces back: the
grader re-reads each traced run's trace from the working copy (no link followed) and re-derives the phase shares.
The rest (split, loader sweep, precisions, compile, profile, ladder) are measured in the notebook's own process and
are held against each other (the in-process rate is not held against the engine's: two means over a few dozen
millisecond steps, taken seconds apart, differed 56-fold on a busy machine). Every check needs a real run
(`needs_run`).
"""
import json
import math

from scalelab.experiments.profiling import read_run_file
from scalelab.experiments.single_device import phase_shares
from scalelab.grade.checks import check, close, evidence
from scalelab.grade.evidence import WORKDIR


def _close(a, b, rel):
    return math.isclose(a, b, rel_tol=rel)


@check(points=2, needs_run=True)
def prediction_is_the_serial_formula(r):
    """predicted_full_sps is exactly 1 / (1/data + 1/compute) of the recorded split."""
    s = r["split"]
    want = 1 / (1 / s["data"] + 1 / s["compute"])
    assert _close(r["predicted_full_sps"], want, 1e-3), "the prediction does not follow from the recorded split"


@check(points=1, needs_run=True)
def full_step_cannot_beat_its_slowest_stage(r):
    """A serial step is no faster than its slower stage (plus a wide margin for a noisy machine)."""
    s = r["split"]
    assert s["full"] <= 1.5 * min(s["data"], s["compute"]), "full step faster than its slowest stage"


@check(points=3, needs_run=True)
def baseline_is_the_engine_run(r):
    """The baseline's samples/s is what its run's event files show, for one process."""
    found = evidence(r, r["baseline_run_dir"])
    assert found["world_size"] == 1, f"the baseline ran {found['world_size']} processes, not 1"
    close(found["samples_per_s"], r["baseline_samples_per_s"], what="baseline samples/s")


@check(points=2, needs_run=True)
def chosen_workers_is_the_smallest(r):
    """chosen_workers is the smallest count within 90 % of the best."""
    rows = {row["workers"]: row["samples_per_s"] for row in r["loader_sweep"]}
    best = max(rows.values())
    assert r["chosen_workers"] == min(w for w, v in rows.items() if v >= 0.9 * best), "not the smallest such count"


@check(points=2, needs_run=True)
def conv_fraction_follows_the_profile(r):
    """conv_fraction is recomputed from the recorded operator table."""
    p = r["profile"]
    want = sum(op["self_ms"] for op in p["ops"] if "conv" in op["name"]) / p["self_ms_total"]
    assert _close(r["conv_fraction"], want, 1e-6), "conv_fraction does not follow from the recorded profile"


@check(points=1, needs_run=True)
def ladder_is_consistent(r):
    """Each rung's speedup and gain follow from the recorded samples/s."""
    rows = r["ladder"]
    base = rows[0]["samples_per_s"]
    for prev, row in zip([rows[0]] + rows[:-1], rows):
        assert _close(row["speedup"], row["samples_per_s"] / base, 1e-6), f"rung {row['name']}: speedup"
        assert _close(row["gain"], row["samples_per_s"] / prev["samples_per_s"], 1e-6), f"rung {row['name']}: gain"


@check(points=1, needs_run=True)
def precision_speedups_are_consistent(r):
    """Each precision's speedup is its samples/s over fp32's."""
    rows = r["precision"]
    for row in rows:
        assert _close(row["speedup"], row["samples_per_s"] / rows[0]["samples_per_s"], 1e-6), row["precision"]


@check(points=3, needs_run=True)
def trace_shares_are_the_runs_traces(r):
    """Before and after the fix: the phase shares are what the run's own trace shows (re-read by the grader), and
    the runs' event files agree that the data wait fell when the trace says so (the events cover every step, the
    trace the profiled ones: on a loaded machine their shares differ, their order does not)."""
    data = {}
    for name in ("trace_before", "trace_after"):
        t = r[name]
        found, work = evidence(r, t["run_dir"]), r[WORKDIR]
        assert found["world_size"] == 1, f"{name}: the run had {found['world_size']} processes, not 1"
        try:
            trace = json.loads(read_run_file(work, f"{t['run_dir']}/traces/rank-0.json"))
            again = phase_shares(t["run_dir"], trace=trace)
        except Exception as e:  # missing, a link, too big, not a trace: all the student's files
            raise AssertionError(f"{name}: the run's trace could not be read ({type(e).__name__}: {e})") from None
        for phase, share in again["shares"].items():
            close(share, t["shares"].get(phase), what=f"{name} {phase} share")
        data[name] = (again["shares"]["data"], found["time_fraction"]["data"])
    (trace_b, events_b), (trace_a, events_a) = data["trace_before"], data["trace_after"]
    if trace_a < 0.8 * trace_b:
        assert events_a < events_b, f"the traces show the data wait falling ({trace_b:.2f} -> {trace_a:.2f}), " \
                                    f"the runs' events do not ({events_b:.2f} -> {events_a:.2f})"
