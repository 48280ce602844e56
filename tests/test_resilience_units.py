"""Resilience pieces without a run: the interval arithmetic and the simulated failure trace, the batch script of a
preemptible job (as text), recovery figures read off events, and the FaultTimeline widget drawn headless."""
from __future__ import annotations

import math
from pathlib import Path

from scalelab.experiments import resilience as m
from scalelab.launch.slurm import batch_script
from scalelab.run.spec import preset


def test_young_and_daly_intervals():
    assert math.isclose(m.young_interval(2.0, 100.0), 20.0)
    assert m.daly_interval(2.0, 100.0) < m.young_interval(2.0, 100.0) + 1.0  # Daly: about Young minus C, plus a bit
    assert m.daly_interval(300.0, 100.0) == 100.0  # C >= 2M: checkpoint every M


def test_simulation_counts_checkpoints_lost_work_and_restarts():
    assert m.simulate(100, 10, 1, 5, []) == 100 + 9 * 1  # no failures: work plus 9 checkpoints (none after the last)
    # a failure at t=15 loses the 4 s done since the checkpoint at t=11, and costs a 5 s restart
    assert m.simulate(20, 10, 1, 5, [15.0]) == 15 + 5 + 10
    trace = m.failure_trace(10.0, 10_000.0, seed=1)
    assert trace == sorted(trace) and 800 < len(trace) < 1200  # a Poisson process with mean gap 10 s
    assert trace == m.failure_trace(10.0, 10_000.0, seed=1)


def test_the_simulated_optimum_sits_near_youngs_interval():
    young = m.young_interval(5.0, 600.0)
    sweep = m.interval_sweep(6000.0, 5.0, 10.0, 600.0, [young * f for f in (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8)])
    best = min(sweep, key=lambda s: s["waste_s"])["interval_s"]
    assert young / 2 <= best <= young * 2
    assert sweep[0]["waste_s"] > min(s["waste_s"] for s in sweep) < sweep[-1]["waste_s"]


def test_a_preemptible_job_traps_the_signal_and_requeues_itself(tmp_path):
    spec = preset("tiny").with_overrides({"launcher": "slurm", "checkpoint.on_signal": True, "slurm.requeue": True,
                                          "slurm.signal": "USR1@90"})
    text = batch_script(spec, tmp_path)
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@90" in text and "--open-mode=append" in text
    assert "trap 'preempt USR1' USR1" in text and 'scancel --signal=USR1 "$SLURM_JOB_ID"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and text.rstrip().endswith('exit "$rc"')
    plain = batch_script(preset("tiny").with_overrides({"launcher": "slurm"}), tmp_path)
    assert "trap '" not in plain and "--requeue" not in plain  # only preemptible runs change



def test_a_requeued_job_is_released_only_once_its_old_credential_is_a_second_behind():
    # slurmd refuses a launch whose credential is from the second the old attempt's was revoked in: released at
    # once, the requeued job FAILS ("Job credential revoked") instead of starting again
    from datetime import datetime

    from scalelab.launch.requeue import REQUEUE_SETTLE_S, release_requeued
    requeued = datetime(2026, 11, 25, 8, 39, 53)
    info = {"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "1", "SubmitTime": requeued.isoformat()}
    env = {"PATH": "/nonexistent"}  # a release would have to run scontrol: none may be tried here
    for after in (0.0, 0.6, REQUEUE_SETTLE_S - 0.1):
        assert release_requeued("625", info, env, now=requeued.timestamp() + after) is False
    assert release_requeued("625", {**info, "SubmitTime": "Unknown"}, env, now=requeued.timestamp() + 60) is False
    assert release_requeued("625", {**info, "Restarts": "0"}, env, now=requeued.timestamp() + 60) is False


def test_a_settled_requeued_job_is_released_with_scontrol(tmp_path):
    # the other side of the rule above: from REQUEUE_SETTLE_S after the requeue on, the job is asked to start now
    # (a stand-in scontrol on PATH records how it was called)
    from datetime import datetime

    from scalelab.launch.requeue import REQUEUE_SETTLE_S, release_requeued
    calls = tmp_path / "calls"
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit "${{SCONTROL_RC:-0}}"\n')
    (tmp_path / "scontrol").chmod(0o755)
    requeued = datetime(2026, 11, 25, 8, 39, 53)
    info = {"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "2", "SubmitTime": requeued.isoformat()}
    env = {"PATH": str(tmp_path)}
    assert release_requeued("625", info, env, now=requeued.timestamp() + REQUEUE_SETTLE_S) is True
    assert calls.read_text().splitlines() == ["update JobId=625 StartTime=now"]
    assert release_requeued("625", info, {**env, "SCONTROL_RC": "1"}, now=requeued.timestamp() + 60) is False
    assert release_requeued("625", {**info, "JobState": "RUNNING"}, env, now=requeued.timestamp() + 60) is False
    assert release_requeued("625", {**info, "Reason": "Priority"}, env, now=requeued.timestamp() + 60) is False
    assert len(calls.read_text().splitlines()) == 2  # the refused call was tried; not-held jobs were left alone

def _events(kind):
    """A 2-rank run: rank 1 killed at step 3; restarted from a step-2 checkpoint, or recovered forward."""
    ev = [{"type": "start", "rank": r, "t": 0.0, "start_step": 0, "pid": 1} for r in (0, 1)]
    ev += [{"type": "step", "rank": r, "t": 0.1 * s, "step": s, "step_s": 0.1} for s in (1, 2) for r in (0, 1)]
    ev.append({"type": "fault", "rank": 1, "t": 0.25, "step": 3, "kind": "kill"})
    if kind == "restart":
        ev += [{"type": "start", "rank": r, "t": 5.0, "start_step": 2, "pid": 2} for r in (0, 1)]
        ev += [{"type": "step", "rank": 0, "t": 5.0 + 0.1 * (s - 2), "step": s, "step_s": 0.1} for s in (3, 4)]
    else:
        ev.append({"type": "recovered", "rank": 0, "t": 0.3, "lost": [1]})
        ev += [{"type": "step", "rank": 0, "t": 0.3 + 0.1 * (s - 2), "step": s, "step_s": 0.1} for s in (3, 4)]
    return ev


def test_recovery_figures_from_events():
    r = m.recovery(_events("restart"))
    assert r["how"] == "restart" and r["steps_redone"] == 1 and math.isclose(r["training_again_s"], 4.85)
    assert math.isclose(r["back_s"], 4.95)
    f = m.recovery(_events("forward"))
    assert f["how"] == "forward" and f["steps_redone"] == 0 and math.isclose(f["training_again_s"], 0.15)
    assert m.last_steps(_events("forward")) == {0: 4, 1: 2}


def test_fault_timeline_draws_headless(tmp_path):
    from scalelab.widgets import FaultTimeline
    widget = FaultTimeline({"restart": _events("restart"), "forward": _events("forward")})
    assert widget.image.value.startswith("<img src='data:image/png;base64,")
    path = widget.save(tmp_path / "faults.png")
    assert Path(path).read_bytes()[:4] == b"\x89PNG"
    rows = m.timeline_rows(_events("restart"))
    assert rows[1]["fault"] == [0.25] and rows[0]["start"] == [0.0, 5.0]


def test_survivors_stop_waiting_for_a_peer_that_dies_while_they_agree(tmp_path):
    # The peer's death broke the collective while its process was still exiting: at detection it looked alive.
    # The leader asks again at each poll, so it writes the member list as soon as the peer is gone, not after the
    # whole JOIN_S (10 s) it leaves a live but silent (hung) peer.
    import threading
    import time
    from scalelab.train import forward
    (tmp_path / "joined-0").write_text("1")
    dead = threading.Event()
    threading.Timer(0.3, dead.set).start()
    t0 = time.monotonic()
    members = forward._agree(tmp_path, 0, lambda: [0] if dead.is_set() else [0, 1])
    took = time.monotonic() - t0
    assert members == [0]
    assert took < forward.JOIN_S / 2, f"waited {took:.1f} s for a dead peer"
    # a live peer that announces itself is waited for and joins
    gen = tmp_path / "gen-2"
    gen.mkdir()
    (gen / "joined-0").write_text("1")
    threading.Timer(0.3, lambda: (gen / "joined-1").write_text("2")).start()
    assert forward._agree(gen, 0, lambda: [0, 1]) == [0, 1]


def test_a_rank_counts_as_alive_only_while_its_process_runs():
    import os
    import subprocess
    import sys
    from scalelab.train import forward
    assert forward._pid_alive(os.getpid()) and not forward._pid_alive(None)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not forward._pid_alive(child.pid)
