"""A straggler slowed in one phase (fault.phase), and the root-cause exercise that finds it from the events
(scalelab/experiments/root_cause.py): real 2-rank DDP engine runs, made once per module beside a CPU burner."""
import subprocess
import sys
import time

import pytest

from scalelab.errors import SpecError
from scalelab.experiments import root_cause as rc
from scalelab.run.field_groups import FaultSpec
from scalelab.run.spec import preset
from scalelab.train import faults

NONCE_A, NONCE_B = "a1" * 8, "b2" * 8


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every rank x every phase of a 2-rank run (the held-out cases outside a grading: all four), made while a
    busy loop keeps one of the 2 cores loaded, as the CI's second test worker does."""
    cases = rc.held_out_cases(4, 2, grading_nonce=None)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t0 = time.perf_counter()
        rows = rc.slow_runs(tmp_path_factory.mktemp("root-cause"), cases)
        print(f"4 slow runs under load: {time.perf_counter() - t0:.1f} s")
    finally:
        burner.kill()
        burner.wait()
    return {(row["case"]["rank"], row["case"]["phase"]): row for row in rows} | {"rows": rows, "cases": cases}


def _table(row):
    return rc.phase_table(rc.read_run(row["run_dir"])[0])


def test_held_out_cases_cover_every_rank_and_phase_and_change_with_the_nonce():
    outside = rc.held_out_cases(4, 2, grading_nonce=None)
    assert sorted((c["rank"], c["phase"]) for c in outside) == [(0, "compute"), (0, "data"), (1, "compute"),
                                                                 (1, "data")]
    assert rc.held_out_cases(4, 2, grading_nonce=None) == outside  # outside a grading: a fixed draw
    a, b = rc.held_out_cases(6, 2, grading_nonce=NONCE_A), rc.held_out_cases(6, 2, grading_nonce=NONCE_B)
    assert a != b and a != rc.held_out_cases(6, 2, grading_nonce=None)
    assert a == rc.held_out_cases(6, 2, grading_nonce=NONCE_A)  # the grader draws the same from the same nonce


def test_a_slow_phase_is_off_by_default_and_the_step_phase_sleeps_outside_the_step(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    assert FaultSpec().phase == "step"
    step_fault = FaultSpec(kind="slow", rank=1, step=1, slow_s=0.25)
    assert faults.phase_delay(step_fault, 1, "data") is None and faults.phase_delay(step_fault, 1, "compute") is None
    faults.maybe_inject(step_fault, 1, 0)
    faults.maybe_inject(step_fault, 1, 3)
    assert slept == [0.25]  # today's straggler: before each step from `step` on
    data_fault = FaultSpec(kind="slow", rank=1, step=1, slow_s=0.25, phase="data")
    faults.maybe_inject(data_fault, 1, 3)  # the loop's own sleeper does it, inside the batch fetch
    assert slept == [0.25]
    assert faults.phase_delay(data_fault, 0, "data") is None and faults.phase_delay(data_fault, 1, "compute") is None
    delay = faults.phase_delay(data_fault, 1, "data")
    delay(0)
    delay(1)
    assert slept == [0.25, 0.25]


def test_a_bad_phase_names_the_field_and_the_choices():
    with pytest.raises(SpecError) as err:
        preset("tiny").with_overrides({"fault.kind": "slow", "fault.phase": "network"})
    assert err.value.field == "fault.phase" and "step, data, compute" in str(err.value)


def test_a_slow_data_phase_lands_in_that_ranks_data_s_and_the_other_ranks_wait_in_the_all_reduce(sweep):
    t = _table(sweep[(1, "data")])
    slow = rc.SLOW_S
    assert 0.8 * slow < t[1]["data_s"] - t[0]["data_s"] < 1.5 * slow, t
    assert t[0]["comm_s"] > 0.5 * slow > t[1]["comm_s"], t  # rank 0 waits for rank 1's gradients
    assert t[0]["compute_s"] - t[0]["comm_s"] < 0.5 * slow, t  # and its compute_s is mostly that wait


def test_a_slow_compute_phase_lands_in_that_ranks_compute_s_with_no_wait_in_its_comm_s(sweep):
    t = _table(sweep[(1, "compute")])
    slow = rc.SLOW_S
    assert t[1]["compute_s"] > 0.8 * slow and abs(t[1]["data_s"] - t[0]["data_s"]) < 0.25 * slow, t
    # both ranks' compute_s grew (one worked, one waited): the waiting one's comm_s tells them apart
    assert t[0]["comm_s"] > 0.5 * slow > t[1]["comm_s"], t
    assert (t[1]["compute_s"] - t[1]["comm_s"]) - (t[0]["compute_s"] - t[0]["comm_s"]) > 0.5 * slow, t


def test_the_reference_diagnosis_finds_every_rank_and_phase_under_load(sweep):
    for row in sweep["rows"]:
        assert rc.reference_diagnose(rc.read_run(row["run_dir"])[0]) == row["case"], _table(row)


def test_evaluate_scores_the_reference_full_and_one_fixed_answer_below(sweep):
    dirs = [row["run_dir"] for row in sweep["rows"]]
    ref = rc.evaluate(rc.reference_diagnose, dirs)
    assert ref["right"] == ref["total"] == 4 and ref["truths"] == sweep["cases"] and not ref["not_implemented"]
    always = rc.evaluate(lambda events: {"rank": 0, "phase": "compute"}, dirs)
    assert always["right"] == 1 and always["score"] == 0.25
    seen = []
    rc.evaluate(lambda events: seen.append(events) or {"rank": 0, "phase": "data"}, dirs[:1])
    assert {e["type"] for e in seen[0]} >= {"start", "step", "end"} and {e["rank"] for e in seen[0]} == {0, 1}


def test_a_diagnosis_that_blames_the_longest_phase_blames_the_rank_that_waits(sweep):
    # lab 11's wrong-code entry: raw compute_s holds the wait for the straggler, so a slow data phase is blamed on
    # the other rank's compute
    def longest(events):
        table = rc.phase_table(events)
        rank, phase = max(((r, p) for r in table for p in rc.PHASES), key=lambda rp: table[rp[0]][rp[1] + "_s"])
        return {"rank": rank, "phase": phase}
    got = rc.evaluate(longest, [row["run_dir"] for row in sweep["rows"]])
    assert got["right"] <= 2, got


def test_an_unwritten_diagnose_from_its_module_is_reported_not_raised(sweep, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_diagnose.py").write_text('def diagnose(events):\n    raise NotImplementedError("exercise")\n')
    got = rc.evaluate("my_diagnose:diagnose", [sweep["rows"][0]["run_dir"]])
    assert got["not_implemented"] and got["answers"] == [] and got["right"] == 0
    assert list(got["code"]) == ["my_diagnose.py"] and len(got["code"]["my_diagnose.py"]) == 64
    (tmp_path / "my_diagnose.py").write_text("from scalelab.experiments.root_cause import reference_diagnose as "
                                             "diagnose\n")  # rewritten: loaded afresh, as after %%writefile
    assert rc.evaluate("my_diagnose:diagnose", [sweep["rows"][0]["run_dir"]])["right"] == 1


def test_bad_input_is_named(sweep, tmp_path):
    with pytest.raises(SpecError, match="at least one held-out case"):
        rc.held_out_cases(0)
    with pytest.raises(SpecError, match="use 2 or more"):
        rc.held_out_cases(4, world=1)
    with pytest.raises(SpecError, match="phase 'network'"):
        rc.slow_runs(tmp_path, [{"rank": 0, "phase": "network"}])
    with pytest.raises(SpecError, match="rank 2"):
        rc.slow_runs(tmp_path, [{"rank": 2, "phase": "data"}])
    with pytest.raises(SpecError, match="no step event"):
        rc.phase_table([{"type": "start", "rank": 0}])
    with pytest.raises(SpecError, match="holds no spec.json"):
        rc.evaluate(rc.reference_diagnose, [tmp_path])
    with pytest.raises(SpecError, match="diagnose.*returned 'rank 1'"):
        rc.evaluate(lambda events: "rank 1", [sweep["rows"][0]["run_dir"]])
    with pytest.raises(SpecError, match="returned .*'phase': 'network'"):
        rc.evaluate(lambda events: {"rank": 1, "phase": "network"}, [sweep["rows"][0]["run_dir"]])


def test_the_graders_verify_holds_the_record_to_the_runs(sweep):
    dirs = [row["run_dir"] for row in sweep["rows"]]
    events = {d: rc.read_run(d)[0] for d in dirs}
    specs = {d: rc.read_run(d)[1] for d in dirs}
    recorded = rc.evaluate(lambda ev: {"rank": 0, "phase": "compute"}, dirs)
    assert rc.verify(recorded, events.get, specs.get, None) == []
    assert "answers recorded right" in " ".join(rc.verify({**recorded, "right": 4}, events.get, specs.get, None))
    # another grading's nonce: other cases, and start events that do not carry it
    assert "held-out case" in " ".join(rc.verify(recorded, events.get, specs.get, NONCE_A)) or \
        "nonce" in " ".join(rc.verify(recorded, events.get, specs.get, NONCE_A))
    # a spec.json rewritten after the run: the events do not show the slowness it claims
    first, second = dirs[0], dirs[1]
    swapped = {**events, first: events[second], second: events[first]}
    problems = rc.verify(recorded, swapped.get, specs.get, None)
    assert any("exceeds the others' by" in p for p in problems), problems
    assert rc.verify_runs(dirs, events.get, specs.get, None) == []
    assert "held-out cases are 5" in rc.verify_runs(dirs, events.get, specs.get, None, n=5)[0]
    assert "answers for 4 runs" in rc.verify({**recorded, "answers": []}, events.get, specs.get, None)[0]
