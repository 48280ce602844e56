"""Lab 01 hidden checks: the engine baseline against its event files, and recorded values against each other.

The two code exercises are judged by what their code did, from the files it left: the timer probe's log
(`probe.jsonl`: every call and every piece of the probe device's work, with its times) and the two step runs'
event files (what autograd kept for backward, by dtype; the weights' dtypes; the GradScaler's calls; the losses),
each next to a copy of the module that ran, whose SHA-256 must be that of the student's submitted file. The step
runs' event files pass the grader's plausibility check like any run's; the probe's log, like a trace, has no check
of its own: a hand-written log that agrees with a hand-written timer passes (docs/grading.md, "Forged records").

The engine baseline and the two traced runs (before and after the fix) are what events and traces back: the
grader re-reads each traced run's trace from the working copy (no link followed) and re-derives the phase shares.
The rest (split, loader sweep, precisions, compile, profile, ladder) are measured in the notebook's own process and
are held against each other (the in-process rate is not held against the engine's: two means over a few dozen
millisecond steps, taken seconds apart, differed 56-fold on a busy machine). Every check needs a real run
(`needs_run`).
"""
import hashlib
import json
import math

from scalelab.experiments.own_step import low_precision_share
from scalelab.experiments.profiling import read_run_file
from scalelab.experiments.single_device import phase_shares
from scalelab.experiments.timing import LOG, probe_verdict, read_log
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import RUNS, WORKDIR
from scalelab.grade.untrusted import UntrustedFileError, read_beneath


def _close(a, b, rel):
    return math.isclose(a, b, rel_tol=rel)


@check(points=3, needs_run=True)
def prediction_is_the_serial_formula(r):
    """predicted_full_sps is exactly 1 / (1/data + 1/compute) of the recorded split."""
    s = r["split"]
    want = 1 / (1 / s["data"] + 1 / s["compute"])
    assert _close(r["predicted_full_sps"], want, 1e-3), "the prediction does not follow from the recorded split"


@check(points=0.5, needs_run=True)
def full_step_cannot_beat_its_slowest_stage(r):
    """A serial step is no faster than its slower stage (plus a wide margin for a noisy machine)."""
    s = r["split"]
    assert s["full"] <= 1.5 * min(s["data"], s["compute"]), "full step faster than its slowest stage"


@check(points=1, needs_run=True)
def baseline_is_the_engine_run(r):
    """The baseline's samples/s is what its run's event files show, for one process."""
    steps = param(r, "steps")
    found = evidence(r, r["baseline_run_dir"], total_steps=steps + 5 if steps is not None else None)
    assert found["world_size"] == 1, f"the baseline ran {found['world_size']} processes, not 1"
    close(found["samples_per_s"], r["baseline_samples_per_s"], what="baseline samples/s")


@check(points=3, needs_run=True)
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


@check(points=0.5, needs_run=True)
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


def _ran_the_submitted(r, code: dict, name: str) -> None:
    """The run's record of the code it ran names `name` with the SHA-256 of the working copy's `name`."""
    try:
        sha = hashlib.sha256(read_beneath(r[WORKDIR], name, 1 << 20)).hexdigest()
    except UntrustedFileError as e:
        raise AssertionError(f"{name} could not be read from the submission ({e})") from None
    assert code.get(name) == sha, f"the run did not run the submitted {name} (its record of the code: {code})"


def _events(r, run_dir: str) -> list:
    """Rank 0's events of a run, re-read from the working copy (as data that may be hostile)."""
    try:
        return read_log(read_run_file(r[WORKDIR], f"{run_dir}/events/rank-0.jsonl"))
    except Exception as e:  # missing, a link, too big: all the student's files
        raise AssertionError(f"the event file of {run_dir} could not be read ({type(e).__name__}: {e})") from None


@check(points=6, needs_run=True)
def timer_probe_is_its_log(r):
    """Exercise 1: the probe's own log, re-read, gives the recorded reading and an honest verdict, and the timer that
    ran is the submitted my_timer.py."""
    r[RUNS]  # no grader evidence, no verdict (a notebook that ran nothing ends here as missing)
    p = r["timer_probe"]
    try:
        log = read_log(read_run_file(r[WORKDIR], f"{p['run_dir']}/{LOG}"))
        again = probe_verdict(log)
    except Exception as e:  # noqa: BLE001 - missing, a link, too big, not a probe log: all the student's files
        raise AssertionError(f"the probe's log could not be read ({type(e).__name__}: {e})") from None
    for key in ("measured_ms", "honest_ms", "calls"):
        close(again[key], p[key], what=f"timer probe {key}")
    _ran_the_submitted(r, again["code"], "my_timer.py")
    assert again["honest"], "the timer's reading is not the work of the timed steps"


@check(points=6, needs_run=True)
def own_step_runs_are_their_events(r):
    """Exercise 4: both step runs are real runs whose losses were recorded; the one at 16 bits ran the submitted
    my_step.py, kept mostly 16-bit activations for backward, fp32 weights, called the GradScaler once per step
    (fp16), and ended within 0.05 of the fp32 run's loss, which kept fp32 activations (the lab's own step)."""
    own = r["own_step"]
    found = {name: evidence(r, own[name]["run_dir"], in_process=True) for name in ("fp32", "yours")}
    assert own["fp32"]["run_dir"] != own["yours"]["run_dir"], "the two steps must run as two runs"
    for name, run in found.items():
        assert run["world_size"] == 1, f"{name}: {run['world_size']} processes, not 1"
        curve = own[name]["losses"]
        assert len(run["loss_curve"]) == len(curve) and all(math.isclose(a, b, rel_tol=1e-6) for a, b in
                                                            zip(run["loss_curve"], curve)), f"{name}: losses"
    _ran_the_submitted(r, found["yours"]["code"], "my_step.py")
    shares = {}
    for name in ("fp32", "yours"):
        events = _events(r, own[name]["run_dir"])
        memory = [e for e in events if e.get("type") == "memory"][-1:]
        end = [e for e in events if e.get("type") == "end"][-1:]
        assert memory and end, f"{name}: the run wrote no memory or end event"
        shares[name] = low_precision_share(memory[0]["saved_bytes"])
        assert end[0]["param_dtypes"] == ["torch.float32"], f"{name}: weights {end[0]['param_dtypes']}"
        precision = next(e for e in events if e.get("type") == "start").get("precision")
        if name == "yours" and precision == "fp16":
            steps = len(own[name]["losses"])
            assert end[0]["scaler_calls"] == {"scale": steps, "step": steps, "update": steps}, "GradScaler calls"
    assert shares["fp32"] == 0 and shares["yours"] >= 0.5, f"16-bit share of saved activations {shares}"
    assert abs(found["yours"]["final_loss"] - found["fp32"]["final_loss"]) < 0.05, "final losses too far apart"


@check(points=0.25, needs_run=True)
def gpt_ladder_rows_follow_from_their_numbers(r):
    """Section 5b (measured in the notebook's process, so held against itself): rungs in order, each changing one
    thing, every rung from the same weights and batches (the same first loss), speedup and gain the ratios of the
    recorded tokens/s."""
    rows = [row for row in r["gpt_ladder"] if "error" not in row]
    names = [row["name"] for row in r["gpt_ladder"]]
    assert len(rows) >= 2 and names[0] == rows[0]["name"], f"rungs that ran: {names}"
    first, before = rows[0], rows[0]
    for row in rows:
        assert math.isclose(row["loss_first"], first["loss_first"], rel_tol=1e-2, abs_tol=1e-2), \
            f"{row['name']}: first loss {row['loss_first']} against {first['loss_first']}: not the same start"
        for key, over in (("speedup", first), ("gain", before)):
            want = row["tokens_per_s"] / over["tokens_per_s"]
            assert math.isclose(row[key], want, rel_tol=1e-6), \
                f"{row['name']}: {key} {row[key]!r} is not its tokens/s over {over['name']}'s ({want:.4g})"
        before = row
