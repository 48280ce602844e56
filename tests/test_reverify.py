"""Re-verification by execution (issue 38 item 1), on real engine runs: the grading's nonce changes a run's initial
weights and is written in its start events; a re-run of the first steps with the same nonce gives the run's own
losses, and the grader's comparison tells a run of another nonce (copied, or written by hand) from it."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from scalelab.grade import reverify
from scalelab.grade.evidence import RUNS, run_evidence
from scalelab.launch import launch
from scalelab.run.nonce import NONCE_VAR, REVERIFY_VAR, init_seed, nonce, reverify_steps

from helpers import tiny

NONCE_A, NONCE_B = "0123456789abcdef", "fedcba9876543210"


def _run(tmp_path, name, env_nonce=None, steps=None, **changes):
    import os
    env = {k: v for k, v in os.environ.items() if k not in (NONCE_VAR, REVERIFY_VAR)}
    if env_nonce:
        env[NONCE_VAR] = env_nonce
    if steps:
        env[REVERIFY_VAR] = str(steps)
    spec = tiny(tmp_path, name, **{"steps": 6, **changes})
    run = launch(spec, env=env)
    run.wait(timeout=120)
    return tmp_path / name


def test_the_nonce_mixes_into_the_seed_only_in_a_grading(monkeypatch):
    monkeypatch.delenv(NONCE_VAR, raising=False)
    monkeypatch.delenv(REVERIFY_VAR, raising=False)
    assert nonce() is None and init_seed(7) == 7 and reverify_steps() is None
    monkeypatch.setenv(NONCE_VAR, NONCE_A)
    a = init_seed(7)
    assert nonce() == NONCE_A and a != 7 and 0 <= a < 2**31 and init_seed(7) == a  # a function of both
    assert init_seed(8) != a
    monkeypatch.setenv(NONCE_VAR, NONCE_B)
    assert init_seed(7) != a
    monkeypatch.setenv(NONCE_VAR, "not hex; rm -rf /")  # anything else is no nonce
    assert nonce() is None and init_seed(7) == 7
    monkeypatch.setenv(REVERIFY_VAR, "3")
    assert reverify_steps() == 3
    monkeypatch.setenv(REVERIFY_VAR, "-1")
    assert reverify_steps() is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real 2-rank DDP runs of the tiny preset: without a nonce, with nonce A (whole, and a 3-step re-run of it), and
    with nonce B."""
    tmp = tmp_path_factory.mktemp("reverify")
    return {"plain": _run(tmp, "plain"), "a": _run(tmp, "a", NONCE_A), "a_rerun": _run(tmp, "a_rerun", NONCE_A, 3),
            "b": _run(tmp, "b", NONCE_B)}


def _losses(run_dir):
    return reverify.step_losses(run_dir.parent, reverify.Path(run_dir.name))


def test_a_run_writes_its_nonce_and_a_rerun_stops_after_its_steps(runs):
    starts = [json.loads(line) for line in (runs["a"] / "events" / "rank-1.jsonl").read_text().splitlines()][:1]
    assert starts[0]["type"] == "start" and starts[0]["nonce"] == NONCE_A
    plain = json.loads((runs["plain"] / "events" / "rank-0.jsonl").read_text().splitlines()[0])
    assert plain["nonce"] is None
    rerun = _losses(runs["a_rerun"])
    assert sorted(rerun) == [0, 1] and all(sorted(r) == [1, 2, 3] for r in rerun.values())
    ends = [json.loads(line) for line in (runs["a_rerun"] / "events" / "rank-0.jsonl").read_text().splitlines()
            if '"end"' in line]
    assert ends and ends[-1]["reverify"] is True and ends[-1]["steps"] == 3
    assert not (runs["a_rerun"] / "model.pt").exists()  # a re-run trains its steps and nothing else


def test_the_rerun_with_the_same_nonce_gives_the_runs_own_losses_and_another_nonce_does_not(runs):
    a, again, b, plain = (_losses(runs[k]) for k in ("a", "a_rerun", "b", "plain"))
    assert reverify.compare(a, again, 3) == (reverify.SAME, "")
    verdict, why = reverify.compare(b, again, 3)
    assert verdict == reverify.DIFFERS and "rank 0, step 1" in why  # another initialisation: the first loss differs
    assert reverify.compare(plain, again, 3)[0] == reverify.DIFFERS  # nor does a run made outside the grading
    assert a[0][1] != plain[0][1]  # the nonce changed the initial weights
    # a run that logged none of the re-run's steps is not verified (its points are withheld), not called forged
    sparse = {rank: {s: v for s, v in losses.items() if s > 3} for rank, losses in a.items()}
    verdict, why = reverify.compare(sparse, again, 3)
    assert verdict == reverify.UNVERIFIED and "none of the first 3" in why
    assert reverify.compare(a, {}, 3)[0] == reverify.UNVERIFIED


def test_a_run_that_logs_sparsely_is_rerun_up_to_its_first_logged_step():
    from scalelab.run.spec import preset
    spec = preset("tiny").with_overrides({"steps": 40})
    assert reverify.rerun_steps(spec, 3) == 3
    assert reverify.rerun_steps(spec.replace(log_every=5), 3) == 5
    assert reverify.rerun_steps(spec.replace(log_every=30), 3) == reverify.MAX_RERUN_STEPS
    assert reverify.rerun_steps(spec.replace(steps=2), 3) == 2  # never past the run's own end


def test_evidence_rejects_a_run_that_carries_another_nonce(runs, tmp_path):
    for key in ("a", "b"):
        shutil.copytree(runs[key], tmp_path / "runs" / key)
    found = run_evidence(tmp_path, nonce=NONCE_A)[RUNS]
    assert found["runs/a"]["implausible"] == [] and found["runs/a"]["nonce"] == NONCE_A
    assert any("another grading's nonce" in why for why in found["runs/b"]["implausible"])
    assert all(run["implausible"] == [] for run in run_evidence(tmp_path)[RUNS].values())  # outside a grading


def test_plan_reruns_eligible_runs_and_distrusts_runs_whose_spec_is_missing_or_disagrees(runs, tmp_path):
    work, job = tmp_path / "work", tmp_path / "job"
    for key in ("a", "b"):
        shutil.copytree(runs[key], work / "runs" / key)
    shutil.copytree(runs["a"], work / "runs" / "nospec")
    (work / "runs" / "nospec" / "spec.json").unlink()
    shutil.copytree(runs["a"], work / "runs" / "edited")
    spec = json.loads((work / "runs" / "edited" / "spec.json").read_text())
    spec["optim"]["batch_per_worker"] *= 2  # the spec no longer matches the events' global batch
    (work / "runs" / "edited" / "spec.json").write_text(json.dumps(spec))
    found = run_evidence(work)[RUNS]
    keys = ["runs/a", "runs/nospec", "runs/edited"]
    items, notes, bad = reverify.plan(work, job, found, keys, 2, 3, random.Random(1))
    assert sorted(bad) == ["runs/edited", "runs/nospec"], bad
    assert "no spec.json" in bad["runs/nospec"] and "global_batch" in bad["runs/edited"]
    [item] = items
    assert item["key"] == "runs/a" and item["steps"] == 3
    assert item["spec"]["launcher"] == "local" and item["spec"]["output_dir"] == str(job / "reverify" / "r0")
    assert item["spec"]["world"]["workers_per_node"] == 2 and item["spec"]["fault"]["kind"] == "none"


def test_runs_behind_points_are_the_runs_that_scoring_checks_read():
    from scalelab.grade.checks import CheckResult
    results = [CheckResult("scored", "pass", 1.0, 1.0), CheckResult("failed", "fail", 0.0, 1.0)]
    reads = {"scored": ["runs/x", "runs/y", "runs/x"], "failed": ["runs/z"]}
    runs = {"runs/x": {"implausible": []}, "runs/y": {"implausible": []}, "runs/z": {"implausible": []}}
    assert reverify.runs_behind_points(results, reads, runs) == ["runs/x", "runs/y"]
    # a check gated on a real run scored: every plausible run opened the gate, so each may be drawn
    runs["runs/forged"] = {"implausible": ["rank 0: event times go backwards"]}
    assert reverify.runs_behind_points(results, reads, runs, {"scored"}) == ["runs/x", "runs/y", "runs/z"]
    assert reverify.runs_behind_points(results, reads, runs, {"failed"}) == ["runs/x", "runs/y"]


def test_checks_report_the_runs_they_read():
    from scalelab.grade.checks import check, run_checks, evidence
    from scalelab.grade.evidence import WORKDIR

    @check(points=1)
    def reads_two(r):
        evidence(r, "runs/x")
        evidence(r, "/w/runs/y")

    records = {RUNS: {"runs/x": {"implausible": []}, "runs/y": {"implausible": []}}, WORKDIR: "/w"}
    reads: dict = {}
    [result] = run_checks([reads_two.scalelab_check], records, reads)
    assert result.outcome == "pass" and reads == {"reads_two": ["runs/x", "runs/y"]}
