"""The plausibility check on run events, without a kernel: events paced like a real run pass; events written at
once, from before the run or from the future, with steps that do not rise, a world size or final loss that does not
match, or samples/s that do not follow from the step time are implausible (what keeps hand-written event files, as
in test_grade_forgery, from passing as a real run)."""
from __future__ import annotations

import time
from pathlib import Path

from scalelab.grade.evidence import RUNS, run_evidence
from scalelab.run.events import EventWriter


def _engine_like(run_dir: Path, world=2, steps=5, step_s=0.002, start_step=0, pace=True, **end):
    """Events as the training loop writes them: paced by real step time when `pace`."""
    writers = [EventWriter(run_dir, rank) for rank in range(world)]
    for w in writers:
        w.emit("start", world_size=world, start_step=start_step, total_steps=start_step + steps)
    for step in range(start_step + 1, start_step + steps + 1):
        if pace:
            time.sleep(step_s)
        for w in writers:
            w.emit("step", step=step, loss=1.0 / step, samples=8, step_s=step_s, data_s=0.0, compute_s=step_s,
                   comm_s=0.0, samples_per_s=8 / step_s)
    for w in writers:
        w.emit("end", **{"steps": start_step + steps, "final_loss": 1.0 / (start_step + steps),
                         "elapsed_s": (steps + 1) * step_s + 0.01, **end})
        w.close()


def _verdict(tmp_path, **kw) -> list[str]:
    return run_evidence(tmp_path, **kw)[RUNS]["run"]["implausible"]


def test_events_paced_like_a_real_run_are_plausible_and_a_resume_appends_a_launch(tmp_path):
    _engine_like(tmp_path / "run")
    _engine_like(tmp_path / "run", steps=3, start_step=4)  # a resume from step 4
    found = run_evidence(tmp_path, started=time.time() - 60)[RUNS]["run"]
    assert found["implausible"] == []
    assert (found["launches"], found["start_step"], found["steps"], found["world_size"]) == (2, 4, 7, 2)
    assert found["loss_curve"] == [1 / 5, 1 / 6, 1 / 7]  # the last launch, as Run.wait() reported it


def test_events_written_at_once_are_implausible(tmp_path):
    _engine_like(tmp_path / "run", step_s=0.05, pace=False)
    assert any("passed since the event before" in r for r in _verdict(tmp_path))


def test_events_from_before_the_run_or_from_the_future_are_implausible(tmp_path):
    _engine_like(tmp_path / "run")
    assert any("before this run started" in r for r in _verdict(tmp_path, started=time.time() + 600))
    assert any("in the future" in r for r in _verdict(tmp_path, now=time.time() - 600))


def test_steps_that_do_not_rise_or_a_world_size_that_does_not_match_are_implausible(tmp_path):
    _engine_like(tmp_path / "run")
    rank0 = tmp_path / "run" / "events" / "rank-0.jsonl"
    lines = rank0.read_text().splitlines()
    rank0.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n")  # step 2 before step 1
    assert any("step 1 after step 2" in r for r in _verdict(tmp_path))
    _engine_like(tmp_path / "run", world=1)  # rank-1.jsonl stays from before: 2 files, a start saying 1
    assert any("world size" in r for r in _verdict(tmp_path))


def test_a_final_loss_that_is_not_the_mean_of_the_ranks_is_implausible(tmp_path):
    _engine_like(tmp_path / "run", final_loss=0.01)
    assert any("not the mean" in r for r in _verdict(tmp_path))


def test_samples_per_s_that_do_not_follow_from_the_step_are_implausible(tmp_path):
    w = EventWriter(tmp_path / "run", 0)
    w.emit("start", world_size=1, start_step=0, total_steps=1)
    time.sleep(0.01)
    w.emit("step", step=1, loss=1.0, samples=8, step_s=0.01, data_s=0.0, compute_s=0.01, samples_per_s=8000.0)
    w.close()
    assert any("samples/s is not samples over step time" in r for r in _verdict(tmp_path))


def test_a_folder_of_many_empty_folders_is_looked_at_only_so_far(tmp_path, monkeypatch):
    # A student's working copy with a million empty folders stalled the grader and the instructors' dashboard,
    # which walked it all; the walk now stops after MAX_ENTRIES names, and finds runs before that as it did.
    import scalelab.grade.evidence as ev
    _engine_like(tmp_path / "a-run", world=1, steps=2, pace=False)
    for i in range(300):
        (tmp_path / "b-flood" / f"d{i:03d}").mkdir(parents=True)
    assert set(run_evidence(tmp_path)[RUNS]) == {"a-run"}
    listed = []
    real = ev.os.scandir
    monkeypatch.setattr(ev.os, "scandir", lambda p: listed.append(p) or real(p))
    monkeypatch.setattr(ev, "MAX_ENTRIES", 50)
    assert set(run_evidence(tmp_path)[RUNS]) == {"a-run"}  # sorted: a-run comes before the flood
    assert len(listed) < 10, f"{len(listed)} folders listed past the budget"
    _engine_like(tmp_path / "c" / "1" / "2" / "3" / "4" / "5" / "6" / "7" / "8" / "run", world=1, steps=2,
                 pace=False)
    monkeypatch.setattr(ev, "MAX_ENTRIES", 10_000)
    assert "c/1/2/3/4/5/6/7/8/run" not in run_evidence(tmp_path)[RUNS]  # deeper than MAX_DEPTH: not read
