"""Lab 08 hidden checks: the engine runs against their event files; answers recomputed from other records.

The reference, preempted, elastic and forward-recovery runs are held against their event files (checkpoints and
their cost, launches and resume steps, steps reached); the preempted run's per-rank events show where each rank
stopped and that it ran the submitted my_preempt.py; the interval runs' logs (faults.jsonl) are accounted again
here and hold the measured optimum against Young's and Daly's. The cluster sections (use_slurm, use_nodes) count
only where they ran: the grader's sandbox has no cluster. The points sit with the exercises and the student's own
runs: the checks that any run of the cells passes are worth little (an untouched student copy earns ~15 %).
"""
import hashlib
import json
import math

from scalelab.experiments.interval_runs import costs, predicted_fraction
from scalelab.experiments.profiling import read_run_file
from scalelab.grade.checks import check, close, evidence, partial
from scalelab.grade.evidence import RUNS, WORKDIR
from scalelab.grade.untrusted import UntrustedFileError, read_beneath


def _read_jsonl(r, path: str) -> list[dict]:
    """A JSON-lines file the run wrote, re-read from the working copy (as data that may be hostile)."""
    r[RUNS]  # noqa: B018 - absent outside the grader: the check ends as missing
    try:
        events = [json.loads(line) for line in read_run_file(r[WORKDIR], path).splitlines() if line.strip()]
    except Exception as e:  # missing, a link, too big, not JSON: all the student's files
        raise AssertionError(f"{path} could not be read ({type(e).__name__}: {e})") from None
    assert events and all(isinstance(e, dict) and isinstance(e.get("t"), (int, float)) for e in events), \
        f"{path}: not a run's log"
    return events


def _accounted(events: list[dict]) -> dict:
    """The grader's own accounting of a faulty run's log (the reference of exercise 3)."""
    useful = lost = checkpoint = restart = unsaved = 0.0
    fault_t = None
    for e in events:
        if e["type"] == "step":
            unsaved += e["step_s"]
        elif e["type"] == "checkpoint":
            useful, unsaved, checkpoint = useful + unsaved, 0.0, checkpoint + e["blocked_s"]
        elif e["type"] in ("fault", "end"):  # a fault, or the time limit: what no checkpoint saved is lost
            lost, unsaved = lost + unsaved, 0.0
            fault_t = e["t"] if e["type"] == "fault" and fault_t is None else fault_t
        elif e["type"] == "start" and fault_t is not None:
            restart, fault_t = restart + e["t"] - fault_t, None
    return {"wall_s": events[-1]["t"] - events[0]["t"], "useful_s": useful, "lost_s": lost,
            "checkpoint_s": checkpoint, "restart_s": restart}


def _plausible(events: list[dict], window_s: float, path: str) -> None:
    """A log that a faulty run can have written: steps one after another from each start, to the end of its
    window of `window_s` seconds."""
    assert events[0]["type"] == "start" and events[-1].get("type") == "end", \
        f"{path}: does not run from a start to an end"
    assert events[-1]["t"] - events[0]["t"] >= 0.9 * window_s, \
        f"{path}: ends {events[-1]['t'] - events[0]['t']:.3f} s after its start, before its {window_s} s window"
    step, ts = 0, [e["t"] for e in events]
    assert ts == sorted(ts), f"{path}: time runs backwards"
    for e in events:
        if e["type"] == "start":
            step = e["start_step"]
        elif e["type"] == "step":
            assert e["step"] == step + 1 and 0 <= e["step_s"] < 60, f"{path}: step {e['step']} after step {step}"
            step = e["step"]
    assert events[-1]["step"] == step, f"{path}: ends after step {step}, its end says {events[-1]['step']}"


def _interval_rows(r):
    """Per recorded interval: (the row, the grader's accounting of each of its runs, their logs)."""
    s = r["interval_runs"]
    out = []
    for row in s["rows"]:
        logs = [_read_jsonl(r, f"{run}/faults.jsonl") for run in row["runs"]]
        for run, events in zip(row["runs"], logs):
            _plausible(events, s["window_s"], run)
        out.append((row, [_accounted(e) for e in logs], logs))
    return out


@check(points=5, needs_run=True)
def useful_work_is_accounted_from_the_logs(r):
    """Exercise 3: each interval's useful-work fraction is what the grader's own accounting of the runs' logs gives
    (useful work: the steps a checkpoint saved; the steps since the last checkpoint are lost at a fault and at the
    end), to 1e-6."""
    rows = _interval_rows(r)
    assert any(e["type"] == "fault" for _, _, logs in rows for log in logs for e in log), "no fault struck the runs"
    for row, parts, logs in rows:
        again = sum(p["useful_s"] for p in parts) / sum(p["wall_s"] for p in parts)
        assert row["fraction"] is not None and math.isclose(row["fraction"], again, rel_tol=1e-6), \
            f"interval {row['interval_s']:.3g} s: your accounting gives a useful-work fraction of " \
            f"{row['fraction']!r}, the runs' logs {again:.4f} (lost work {sum(p['lost_s'] for p in parts):.3f} s)"


FACTOR = 2.0
"""How far (either way) the sweep's best interval may lie from Young's: the lab's stated factor."""


@check(points=4, needs_run=True)
def measured_optimum_is_near_young(r):
    """The runs' own optimum (accounted by the grader from their logs) is within a factor 2 of Young's interval
    sqrt(2 C M) (C: the median checkpoint of the calibration run's log, M: the parameter sweep_mtbf_s): the sweep
    reaches beyond Young's / 2 and x 2 on both sides (so a best outside the factor could show), every interval ran
    the same trials, and the interval of the most useful work (its trials' useful seconds over their wall seconds)
    lies between Young's / 2 and x 2. At the interval nearest Young's the runs kept within 0.25 of Daly's predicted
    fraction for their own C and R (a 1.5 s window holds ~8 faults: their luck moves a fraction by 0.1 or more)."""
    s, m = r["interval_runs"], r["lab08_params"]["sweep_mtbf_s"]
    ckpt_s = costs(_read_jsonl(r, s["calibration"]))["ckpt_median_s"]
    assert ckpt_s > 0, "the calibration run's log shows no checkpoint"
    young = math.sqrt(2 * ckpt_s * m)
    rows = _interval_rows(r)
    taus = sorted(row["interval_s"] for row, _, _ in rows)
    assert taus[0] < young / FACTOR and taus[-1] > FACTOR * young, \
        f"the sweep spans {taus[0]:.3g}-{taus[-1]:.3g} s: it must reach beyond Young's {young:.3g} s / {FACTOR:g} " \
        f"and x {FACTOR:g}"
    trials = {len(parts) for _, parts, _ in rows}
    assert len(trials) == 1 and trials.pop() >= r["lab08_params"].get("sweep_trials", 1), \
        f"the intervals ran {sorted(len(p) for _, p, _ in rows)} trials: the same number for every interval"
    measured = {row["interval_s"]: sum(p["useful_s"] for p in parts) / sum(p["wall_s"] for p in parts)
                for row, parts, _ in rows}
    best = max(measured, key=measured.get)
    assert young / FACTOR * (1 - 1e-9) <= best <= FACTOR * young * (1 + 1e-9), \
        f"the most useful work ({measured[best]:.3f}) came at {best:.3g} s = {best / young:.2g} x Young's " \
        f"{young:.3g} s: not within a factor {FACTOR:g} " \
        f"({', '.join(f'{t:.3g} s: {f:.3f}' for t, f in measured.items())})"
    near = min(measured, key=lambda tau: abs(math.log(tau / young)))
    row, _, logs = next(x for x in rows if x[0]["interval_s"] == near)
    c = [costs(log) for log in logs]
    predicted = predicted_fraction(near, sum(x["ckpt_s"] for x in c) / len(c),
                                   sum(x["restart_s"] for x in c) / len(c), m)
    assert abs(measured[near] - predicted) <= 0.25, \
        f"at {near:.3g} s the runs kept {measured[near]:.3f} of their time useful, Daly predicts {predicted:.3f}"


@check(points=5, needs_run=True)
def handler_stopped_every_rank_after_one_step(r):
    """Exercise 4: the preempted run's own events: it ran the submitted my_preempt.py, every rank stopped after the
    same step (rank 1 on its SIGTERM, the others through the vote), a checkpoint of that step is on record, and the
    relaunch resumed from it."""
    p, workers = r["preempt"], r["lab08_params"]["workers"]
    assert p["status"] == "preempted" or not p.get("error"), f"the preempted run ended {p['status']}: {p['error']}"
    first, later = {}, {}
    for rank in range(workers):
        events = _read_jsonl(r, f"{p['run_dir']}/events/rank-{rank}.jsonl")
        starts = [i for i, e in enumerate(events) if e["type"] == "start"]
        assert starts, f"rank {rank} never started"
        first[rank] = events[:starts[1]] if len(starts) > 1 else events
        later[rank] = events[starts[1]:] if len(starts) > 1 else []
    start = first[0][0]
    try:
        sha = hashlib.sha256(read_beneath(r[WORKDIR], "my_preempt.py", 1 << 20)).hexdigest()
    except UntrustedFileError as e:
        raise AssertionError(f"my_preempt.py could not be read from the submission ({e})") from None
    assert (start.get("code") or {}).get("my_preempt.py") == sha, \
        f"the preempted run did not run the submitted my_preempt.py (its record of the code: {start.get('code')})"
    stops = {rank: next((e for e in ev if e["type"] == "preempted"), None) for rank, ev in first.items()}
    missing = [rank for rank, e in stops.items() if e is None]
    assert not missing, f"rank(s) {missing} never stopped as preempted (a rank that stops alone leaves the others " \
                        f"in a collective)"
    steps = {rank: e["step"] for rank, e in stops.items()}
    assert len(set(steps.values())) == 1, f"the ranks stopped after different steps: {steps}"
    step = steps[0]
    assert stops[1]["signal"] == "SIGTERM" and all(stops[k]["signal"] == "peer" for k in stops if k != 1), \
        f"signals: {({k: e['signal'] for k, e in stops.items()})}"
    assert any(e["type"] == "checkpoint" and e["step"] == step for e in first[0]), f"no checkpoint of step {step}"
    again = [e for e in later[0] if e["type"] == "start"]
    assert again and again[0]["start_step"] == step, f"the relaunch did not resume from step {step}"


@check(points=0.5, needs_run=True)
def checkpoint_cost_is_the_runs(r):
    """ckpt_s is the reference run's blocked time per checkpoint, as its events show."""
    found = evidence(r, r["reference_run_dir"])
    assert found["checkpoints"] > 0, "the reference run's events show no checkpoint"
    assert found["world_size"] == r["lab08_params"]["workers"], "the reference ran another number of ranks"
    close(found["blocked_s"] / found["checkpoints"], r["ckpt_s"], rel=1e-4, what="checkpoint cost")  # summed in another order


@check(points=2, needs_run=True)
def preempted_run_is_the_engine_run(r):
    """The preempted run's events show two launches, the second from the recorded emergency step, to the end."""
    p = r["preempt"]
    found = evidence(r, p["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == p["step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] and found["loss_curve"] == p["resumed_losses"]


@check(points=0.5, needs_run=True)
def recoveries_are_the_engine_runs(r):
    """The elastic run's events show the restart from the recorded step; the forward run reached the last step."""
    e, f, steps = r["elastic"], r["forward"], r["lab08_params"]["steps"]
    found = evidence(r, e["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == e["start_steps"][-1], \
        f"elastic events: {found['launches']} launches from step {found['start_step']}"
    assert found["steps"] == steps
    found = evidence(r, f["run_dir"])
    assert found["launches"] == 1 and found["steps"] == steps, "the forward run restarted or stopped early"
    close(found["final_loss"], f["final_loss"], rel=1e-9, what="forward final loss")


@check(points=0.5, needs_run=True)
def fault_runs_named_the_right_ranks(r):
    """The crash and hang records agree with the fault the runs injected, and the hang's errors came from rank 0."""
    assert r["crash"]["fault_rank"] == 1 and r["hang"]["fault_rank"] == 1
    assert set(r["hang"]["errors"]) == {"0"}, f"errors by rank: {r['hang']['errors']}"


@check(points=0.25, needs_run=True)
def multilevel_run_is_the_engine_run(r):
    """The multilevel run's events show two launches, the second from the recorded step, to its last step."""
    m = r["multilevel"]
    found = evidence(r, m["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == m["start_step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] + 2 * r["lab08_params"]["every"]


@check(points=0.25, needs_run=True)
def slurm_job_is_the_engine_run(r):
    """With use_slurm: the job's events show two launches, the second from the preempted step, to the last step."""
    if not r["lab08_params"].get("use_slurm", False):
        return partial(1, "not run here (use_slurm = False)")
    s = r["slurm_preempt"]
    found = evidence(r, s["run_dir"])
    assert found["launches"] == 2 and found["start_step"] == s["start_steps"][-1] == s["preempted"][0]["step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] and found["world_size"] == r["lab08_params"]["workers"]


@check(points=0.25, needs_run=True)
def node_loss_run_is_the_engine_run(r):
    """With use_nodes: the run's events show three launches, the last from the recorded shared-tier step, to the
    last step, with the lab's world size."""
    if not r["lab08_params"].get("use_nodes", False):
        return partial(1, "not run here (use_nodes = False)")
    n = r["node_loss"]
    found = evidence(r, n["run_dir"])
    assert found["launches"] == 3 and found["start_step"] == n["attempts"][-1]["start_step"], \
        f"events: {found['launches']} launches, the last from step {found['start_step']}"
    assert found["steps"] == r["lab08_params"]["steps"] and found["world_size"] == r["lab08_params"]["workers"]


@check(points=0.25, needs_run=True)
def horovod_elastic_report_is_consistent(r):
    """The elastic run's report adds up: the rolled-back steps, the lost worker, detection before recovery."""
    h = r["hvd_elastic"]
    assert h["rolled_back_steps"] == h["failed_step"] - h["resumed_step"], "rolled_back_steps"
    assert h["lost"] == [1] and h["resets"] >= 1, f"lost {h['lost']}: the fault was on worker 1"
    assert 0 <= h["detect_s"] <= h["recovery_s"], f"detected {h['detect_s']} s, training again {h['recovery_s']} s"
    assert h["fault_step"] is not None and h["resumed_step"] < h["fault_step"] + 1
