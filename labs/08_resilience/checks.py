"""Lab 08 public checks: what a student can self-check on the numbers the notebook recorded."""
from scalelab.grade.checks import check, partial


@check(points=0.5, needs_run=True)
def crash_is_named_at_once(r):
    """The injected exception fails the run naming rank 1, within a few seconds of the fault."""
    c = r["crash"]
    assert c["failed_rank"] == 1, f"the crash run named rank {c['failed_rank']}, the fault was on rank 1"
    assert "injected fault" in (c["error"] or ""), "the error does not carry the rank's own message"
    assert c["detect_s"] < 30, f"the crash took {c['detect_s']:.1f} s to notice"


@check(points=0.5, needs_run=True)
def hang_is_noticed_after_the_timeout(r):
    """A hang is noticed only once the waiting rank's collective times out."""
    h, timeout = r["hang"], r["lab08_params"]["hang_timeout_s"]
    assert h["status"] == "failed", f"the hang run ended {h['status']}"
    assert h["detect_s"] >= 0.9 * timeout, f"noticed after {h['detect_s']:.1f} s, before the {timeout} s timeout"
    assert h["detect_s"] > r["crash"]["detect_s"], "the hang was noticed sooner than the crash"


@check(points=3, needs_run=True)
def hung_rank_found(r):
    """Exercise 1: suspect is the rank that hung."""
    assert r["suspect"] == r["hang"]["fault_rank"], f"suspect {r['suspect']!r}; look for the rank with no error"


@check(points=2, needs_run=True)
def young_interval_computed(r):
    """Exercise 2: young_s is sqrt(2 C M) for the measured C and the parameter M."""
    want = (2 * r["ckpt_s"] * r["lab08_params"]["mtbf_s"]) ** 0.5
    assert abs(r["young_s"] - want) <= 1e-9 * want, f"young_s {r['young_s']!r}, expected sqrt(2 C M)"


@check(points=2, needs_run=True)
def interval_runs_measured(r):
    """Exercise 3: the interval sweep ran on at least 5 intervals, each with a useful-work fraction in [0, 1] (0: no
    checkpoint outlived the faults), some interval's above 0."""
    s = r["interval_runs"]
    rows = s["rows"]
    assert len(rows) >= 5, f"{len(rows)} intervals: run the sweep as the notebook does"
    for row in rows:
        f = row["fraction"]
        assert f is not None and 0 <= f <= 1, f"interval {row['interval_s']:.3g} s: useful-work fraction {f!r}"
    assert max(row["fraction"] for row in rows) > 0, "no interval kept any work: useful_s counts what checkpoints saved"
    assert s["best_interval_s"] == max(rows, key=lambda row: row["fraction"])["interval_s"], "best_interval_s"


@check(points=2, needs_run=True)
def preemption_saved_and_left_cleanly(r):
    """Exercise 4: the signalled run ended 'preempted', every rank after the same step (rank 0 through the vote),
    and its relaunch resumed from that step and finished."""
    p = r["preempt"]
    assert p["status"] == "preempted", f"the signalled run ended {p['status']}: {p.get('error')}"
    assert p["signal_rank0"] == "peer", "rank 0 should have stopped through the vote, not a signal of its own"
    steps = set(p["preempted"].values())
    assert len(p["preempted"]) == r["lab08_params"]["workers"] and len(steps) == 1, \
        f"the ranks stopped after steps {p['preempted']} (rank: step): they must agree"
    assert p["start_step"] == p["step"] > 0, f"resumed at {p['start_step']}, stopped after {p['step']}"
    assert p["resumed"] == "succeeded", f"the relaunch ended {p['resumed']}"


@check(points=3, needs_run=True)
def preempted_resume_is_exact(r):
    """Exercise 5: the preempted and resumed run ends with exactly the uninterrupted run's parameters."""
    assert r["max_param_diff"] == 0.0, f"parameters differ by up to {r['max_param_diff']}"


@check(points=0.5, needs_run=True)
def both_recoveries_finish(r):
    """Elastic restart resumed from a checkpoint and matches the reference; forward recovery went on with 1 rank."""
    e, f = r["elastic"], r["forward"]
    assert e["status"] == "succeeded" and f["status"] == "succeeded", (e["status"], f["status"])
    assert len(e["start_steps"]) == 2 and e["start_steps"][1] > 0, f"elastic starts {e['start_steps']}"
    assert e["identical"] is True, "the elastic run's parameters differ from the uninterrupted run's"
    assert f["lost"] == [1] and f["recovery"]["steps_redone"] == 0, f"forward: lost {f['lost']}"


@check(points=2, needs_run=True)
def recovery_compared(r):
    """Exercise 6: forward recovery trains again sooner; the restart redid the steps since its checkpoint."""
    e, f = r["elastic"]["recovery"], r["forward"]["recovery"]
    assert abs(r["recovery_speedup"] - e["training_again_s"] / f["training_again_s"]) < 1e-9 * r["recovery_speedup"]
    assert r["recovery_speedup"] > 1, "forward recovery was not faster than the restart"
    assert r["redone_steps"] == e["steps_redone"] > 0, f"redone_steps {r['redone_steps']!r}"


@check(points=0.5, needs_run=True)
def multilevel_restart_reads_the_shared_tier(r):
    """Both tiers held every checkpoint; with the node-local tier gone the restart resumed from the shared one."""
    m = r["multilevel"]
    assert m["local"] == m["shared"] and m["shared"], f"local tier {m['local']}, shared tier {m['shared']}"
    assert "node-local" not in m["resumed_from"] and m["start_step"] == m["shared"][-1], \
        f"resumed from {m['resumed_from']} at step {m['start_step']}"


def _ran(r, section: str):
    """Whether the notebook ran a cluster section (use_slurm / use_nodes): the grader's sandbox has no cluster."""
    return r["lab08_params"].get(section, False)


@check(points=0.25, needs_run=True)
def slurm_job_requeued_and_resumed_exactly(r):
    """With use_slurm: the signalled Slurm job requeued itself (same job id, two attempts) and resumed exactly."""
    if not _ran(r, "use_slurm"):
        return partial(1, "not run here (use_slurm = False): nothing to judge")
    s = r["slurm_preempt"]
    assert s["status"] == "succeeded", f"the Slurm job ended {s['status']}"
    assert s["restarts"] == 1 and len(s["start_steps"]) == 2, \
        f"Slurm counts {s['restarts']} restart(s), the ranks {len(s['start_steps'])} attempt(s): expected 1 and 2"
    assert s["start_steps"][1] == s["preempted"][0]["step"] > 0, \
        f"the second attempt started at {s['start_steps'][1]}, the first stopped after {s['preempted'][0]['step']}"
    assert s["max_param_diff"] == 0.0, f"parameters differ from the uninterrupted run by {s['max_param_diff']}"


@check(points=0.25, needs_run=True)
def node_loss_restarts_read_the_right_tier(r):
    """With use_nodes: after a rank crash the restart read the node-local tier; after the node loss the restart on
    the survivor read the shared tier's newest checkpoint, and the run ended exactly."""
    if not _ran(r, "use_nodes"):
        return partial(1, "not run here (use_nodes = False): nothing to judge")
    n = r["node_loss"]
    crash, lost, finish = n["attempts"]
    shared = n["run_dir"] + "/checkpoints/"
    assert not lost["resumed_from"].startswith(shared) and lost["start_step"] == crash["saved_local"][-1], \
        f"after the rank crash the restart read {lost['resumed_from']} (step {lost['start_step']})"
    assert finish["resumed_from"] == f"{shared}step-{n['shared_at_loss'][-1]:08d}.pt" \
        and finish["start_step"] == n["shared_at_loss"][-1], \
        f"after the node loss the restart read {finish['resumed_from']} (step {finish['start_step']})"
    assert n["lost_node"] not in n["survivor_hosts"] and lost["host"] == n["lost_node"], \
        f"lost {n['lost_node']}, rank 0 was on {lost['host']}, the finish ran on {n['survivor_hosts']}"
    assert finish["status"] == "succeeded" and n["max_param_diff"] == 0.0, \
        f"the finish ended {finish['status']}, parameters differ by {n['max_param_diff']}"


@check(points=0.5, needs_run=True)
def horovod_elastic_goes_on_with_the_survivors(r):
    """Horovod elastic: one worker lost, the others rolled back to their last commit and finished the run."""
    h = r["hvd_elastic"]
    assert h["finished"], f"the Horovod elastic run ended {h['status']}"
    assert h["world_sizes"][0] == h["workers"] and h["final_world_size"] == h["workers"] - 1, \
        f"workers {h['world_sizes']} -> {h['final_world_size']}: expected {h['workers']} -> {h['workers'] - 1}"
    assert h["resumed_step"] <= h["failed_step"] and h["resumed_step"] % h["commit_every"] == 0, \
        f"resumed from step {h['resumed_step']}: not a commit (every {h['commit_every']}) before step {h['failed_step']}"
    assert h["replay_max_diff"] is not None and h["replay_max_diff"] < 1e-4, \
        f"the final model is {h['replay_max_diff']} away from the one-process replay"
