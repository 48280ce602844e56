"""Lab 03 (Horovod) runs under papermill at its grading parameters and grades 100 %; its student copy stops at the
first exercise and grades below 100 %; the wrong code of tests/wrong/03.py (a port without the optimizer state's
broadcast, a metric summed instead of averaged, a sweep reading that counts every all-reduce as fused) loses each
exercise's points; forged records fail the checks; the sweep reading of exercise 4 on a made timeline."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from labtests import ROOT, assert_check_notices, assert_full_marks_within, assert_wrong_code_loses, grade, \
    replace_block, wrong_solutions

from scalelab.grade.checks import load_checks

LAB = ROOT / "labs" / "03_horovod"


def graded(test):
    """A test that reads the lab's grading (Horovod with Gloo and MPI, minutes of it)."""
    return pytest.mark.slow(pytest.mark.horovod(pytest.mark.mpi(test)))


@pytest.fixture(scope="module")
def reference(lab_gradings):
    """The run's one grading of this lab (tests/labtests.py: in the sandbox, at lab.yaml's grading parameters,
    under load): the records and evidence its reference's checks ran on, and the seconds it ran."""
    return lab_gradings.reference(LAB)


@graded
def test_reference_solution_grades_full_marks_within_budget(reference):
    # 7 Horovod jobs (the port under 2 launchers, the engine's Horovod run, 4 sweep points) and a DDP run: 97 s
    # graded beside a lighter load, 292 s beside its own student copy and other labs' gradings (2 cores)
    assert_full_marks_within(LAB, reference)


@graded
def test_reference_port_is_exact_and_the_sweep_shows_fusion(reference):
    records, _ = reference
    assert records["comparison"]["max_loss_diff"] < 1e-5
    rows = [r for x in records["port"].values() for r in x["ranks"]]
    assert all(r["reference_max_diff"] < 1e-6 for r in rows)
    assert all(r["state_spread_before"] > 0 for r in rows if r["rank"] > 0)  # the ranks started apart
    fusion = records["hvd_fusion"]
    assert fusion["allreduces"] > fusion["fused_allreduces"] and fusion["cycles"] > fusion["fused_allreduces"]
    by_threshold = defaultdict(list)
    for p in records["fusion_readings"]:
        by_threshold[p["threshold_mb"]].append(p["fused_per_step"])
    assert by_threshold[0] == [p["tensors"] for p in records["fusion_readings"] if p["threshold_mb"] == 0]
    assert max(by_threshold[128]) < min(by_threshold[0]), dict(by_threshold)  # fusion at 128 MiB, none at 0


@graded
def test_student_copy_fails_at_the_first_exercise_and_grades_below_full(lab_gradings):
    error, records = lab_gradings.until_first_error(LAB)  # Run All of the released copy, as graded
    # the %%writefile cells only write the stubs; the port trains without them, records, then says what is missing
    assert error.get("ename") == "NotImplementedError", error
    assert "make_distributed" in error["evalue"] and "average_metric" in error["evalue"], error["evalue"]
    assert set(records) == {"port"}
    assert all(len(r["not_implemented"]) == 2 for x in records["port"].values() for r in x["ranks"])
    points, most, _ = grade(LAB, records)
    assert points == 0 < most


@graded
def test_wrong_code_loses_each_exercises_points(lab_gradings):
    assert_wrong_code_loses(lab_gradings, LAB, {
        "port_reproduces_data_parallel_training": "a port without broadcast_optimizer_state",
        "port_state_is_rank_zeros_on_every_rank": "a port without broadcast_optimizer_state",
        "metric_averaged_over_ranks": "a metric summed over the ranks",
        "averaged_metric_is_the_ranks_mean": "a metric summed over the ranks",
        "fusion_sweep_is_the_timelines": "every ALLREDUCE counted as a fused all-reduce",
    })


def _no_broadcast(r):
    r["port"]["mpirun"]["ranks"][1].update(replica_max_diff=0.64, reference_max_diff=0.64)  # what a bare port gives


def _other_choice(r):
    best = (r["fusion_choice"]["threshold_mb"], r["fusion_choice"]["cycle_ms"])
    other = next(p for p in r["fusion_readings"] if (p["threshold_mb"], p["cycle_ms"]) != best)
    r["fusion_choice"].update(threshold_mb=other["threshold_mb"], cycle_ms=other["cycle_ms"])


def _faster_point(r):
    p = max(r["fusion_readings"], key=lambda p: p["step_ms"])
    p["step_ms"] = 0.5 * min(x["step_ms"] for x in r["fusion_readings"])
    r["fusion_choice"].update(threshold_mb=p["threshold_mb"], cycle_ms=p["cycle_ms"])


def _swapped_timelines(r):
    a, b = r["fusion_readings"][0], r["fusion_readings"][-1]  # 0 MiB / 1 ms and 128 MiB / 10 ms
    a["threshold_mb"], b["threshold_mb"] = b["threshold_mb"], a["threshold_mb"]
    r["fusion_sweep"][0]["threshold_mb"], r["fusion_sweep"][-1]["threshold_mb"] = a["threshold_mb"], b["threshold_mb"]


@graded
@pytest.mark.parametrize("forge, check_name", [
    (_no_broadcast, "port_reproduces_data_parallel_training"),
    (lambda r: r["port"]["mpirun"]["ranks"][1].update(state_spread_after=0.025), "port_reproduces_data_parallel_training"),
    (lambda r: r["port"]["mpirun"]["ranks"][1].update(state_sha256="0" * 64), "port_state_is_rank_zeros_on_every_rank"),
    (lambda r: r["port"]["horovodrun"]["ranks"][1].update(losses=r["port"]["horovodrun"]["ranks"][0]["losses"]),
     "ranks_trained_on_their_own_shards"),
    (lambda r: r["port"].pop("mpirun"), "port_ran_under_both_controllers"),
    (lambda r: r["port"].pop("mpirun"), "ranks_trained_on_their_own_shards"),
    (lambda r: r["port"]["mpirun"]["ranks"][1].update(controller="gloo"), "port_state_is_rank_zeros_on_every_rank"),
    (lambda r: r["port"]["horovodrun"]["ranks"][0].update(
        averaged_losses=r["port"]["horovodrun"]["ranks"][0]["losses"]), "metric_averaged_over_ranks"),
    (lambda r: r["port"]["horovodrun"]["ranks"][0].update(
        averaged_losses=r["port"]["horovodrun"]["ranks"][0]["losses"]), "averaged_metric_is_the_ranks_mean"),
    (lambda r: r["port"]["horovodrun"].update(run_dir=r["port"]["mpirun"]["run_dir"]),
     "port_state_is_rank_zeros_on_every_rank"),
    (lambda r: r["comparison"].update(hvd_over_ddp=r["comparison"]["hvd_over_ddp"] * 1.1), "comparison_recomputed"),
    (lambda r: r["comparison"].update(max_loss_diff=0.5), "comparison_computed"),
    (lambda r: r["engine_runs"][1].update(loss_curve=[x + 0.01 for x in r["engine_runs"][1]["loss_curve"]]),
     "same_run_two_ways"),
    (lambda r: r["timeline"].update(ok=False, error="skipped"), "timeline_recorded"),
    (lambda r: r["engine_runs"][1].update(samples_per_s=1.0), "throughput_is_the_sum_of_ranks"),
    (lambda r: r["engine_runs"][1].update(samples_per_s=2 * r["engine_runs"][1]["samples_per_s"]),
     "engine_runs_are_the_engine_runs"),
    (lambda r: r["hvd_fusion"].update(fused_allreduces=r["hvd_fusion"]["fused_allreduces"] + 1,
                                      tensors_per_fused=r["hvd_fusion"]["allreduces"]
                                      / (r["hvd_fusion"]["fused_allreduces"] + 1)), "horovod_fusion_is_the_timeline"),
    (lambda r: r["hvd_fusion"].update(fused_allreduces=r["hvd_fusion"]["allreduces"], tensors_per_fused=1.0),
     "horovod_fusion_drawn"),
    (lambda r: r["hvd_fusion"].update(run_dir=r["engine_runs"][0]["run_dir"]), "horovod_fusion_drawn"),
    (lambda r: r["hvd_fusion"].update(run_dir=r["engine_runs"][0]["run_dir"]), "horovod_fusion_is_the_timeline"),
    (_other_choice, "fusion_sweep_read"),
    (_other_choice, "fusion_sweep_is_the_timelines"),
    (_faster_point, "fusion_sweep_is_the_timelines"),
    (_swapped_timelines, "fusion_sweep_is_the_timelines"),
    (lambda r: r["fusion_readings"].pop(), "fusion_sweep_read"),
])
def test_checks_catch_a_wrong_or_forged_record(reference, forge, check_name):
    assert_check_notices(LAB, reference[0], forge, check_name)


# -- exercise 4 on a made timeline (no Horovod): the solution, the grader's reading and the mistake ------------------
def _made_timeline(fused: bool, steps: int = 3, tensors: int = 4, step_s: float = 0.020) -> dict:
    """horovod_timeline's shape: every step, each tensor negotiates from t0 + 0.1 ms i to t0 + 2 ms, then all of
    them all-reduce together (fused) or one after another; one tensor's last step is missing (a cut file)."""
    spans = []
    for k in range(steps):
        t0 = 0.1 + k * step_s
        for i in range(tensors):
            name = f"allreduce.layer{i}.weight"
            spans.append(("NEGOTIATE_ALLREDUCE", t0 + 1e-4 * i, t0 + 0.002, name))
            if k == steps - 1 and i == 0:
                continue
            start = t0 + 0.003 if fused else t0 + 0.003 + 0.0005 * i
            spans.append(("ALLREDUCE", start, start + (0.001 if fused else 0.0004), name))
        spans.append(("BROADCAST", t0, t0 + 0.01, "broadcast.layer0.weight"))
    return {"spans": sorted(spans, key=lambda s: s[1]), "cycles": [0.001 * c for c in range(100)]}


def _notebook_functions(cell_anchor: str, wrong: bool = False) -> dict:
    """The exercise 4 cell of the notebook (the reference, or with tests/wrong/03.py's mistake), executed."""
    nb = json.loads((LAB / "lab.ipynb").read_text())
    text = next("".join(c["source"]) for c in nb["cells"] if cell_anchor in "".join(c["source"]))
    if wrong:
        for anchor, code in wrong_solutions(LAB):
            text, _ = replace_block(text, anchor, code)
    scope: dict = {}
    exec(compile(text, "exercise 4", "exec"), scope)  # noqa: S102 - the lab's own code
    return scope


def test_sweep_reading_counts_fused_all_reduces_and_complete_steps():
    hidden = {c.name: c for c in load_checks(LAB / "hidden_checks.py")}
    reading = hidden["fusion_sweep_is_the_timelines"].func.__globals__["sweep_reading"]
    ours = _notebook_functions("def read_sweep_point")
    for fused in (True, False):
        timeline = _made_timeline(fused)
        expected = {"steps": 2, "tensors": 4, "fused_per_step": 1.0 if fused else 4.0,
                    "tensors_per_fused": 4.0 if fused else 1.0, "step_ms": pytest.approx(20.0)}
        assert reading(timeline) == expected
        assert ours["read_sweep_point"](timeline) == expected
    points = [{"name": n, "step_ms": ms} for n, ms in (("a", 12.0), ("b", 9.5), ("c", 30.0))]
    assert ours["pick_setting"](points)["name"] == "b"


def test_the_wrong_sweep_reading_misses_the_fusion():
    wrong = _notebook_functions("def read_sweep_point", wrong=True)["read_sweep_point"](_made_timeline(True))
    assert wrong["fused_per_step"] == 4.0 and wrong["tensors_per_fused"] == 1.0
    assert wrong["step_ms"] == pytest.approx(20.0)  # only the fusion is missed
