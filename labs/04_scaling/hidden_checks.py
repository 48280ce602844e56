"""Lab 04 hidden checks: the sweeps against their runs' event files; the exercises recomputed from the raw records.

The weak and strong sweeps are engine runs with events: their samples/s are held against them, and speedup,
efficiency and Karp-Flatt follow from those. The schedule exercise's runs are DDP runs too: the rate every step
used is in their step events, and the correct schedule is recomputed from them (the peak and the warm-up read off
the constant run's own engine warm-up). The batch script's job is graded from its ranks' start events (hosts,
world size); it counts only where it ran: the grader's sandbox has no multi-node Slurm. The learning-rate study,
LARS/LAMB, the noise scale, the critical batch and batch growth train in the notebook's own process, so they are
held against each other only. Every check needs a real run (`needs_run`).
"""
import math

from scalelab.grade.checks import check, close, evidence, param, partial


@check(points=0.25, needs_run=True)
def sweeps_are_the_engine_runs(r):
    """Every sweep row's world size and samples/s (global and per rank) are what its run's event files show."""
    for name in ("weak", "strong"):
        rows, dirs = r[f"{name}_rows"], r[f"{name}_run_dirs"]
        assert len(rows) == len(dirs), f"{name}: {len(rows)} rows but {len(dirs)} run dirs"
        if param(r, "workers") is not None:
            ran = sorted(x["workers"] for x in rows)
            assert ran == sorted(param(r, "workers")), \
                f"{name} sweep: ran {ran} workers, the grader set workers={param(r, 'workers')}: parameters were " \
                "changed after injection"
        for x, run_dir in zip(rows, dirs):
            found = evidence(r, run_dir, total_steps="sweep_steps")
            what = f"{name} sweep, {x['workers']} workers"
            assert found["world_size"] == x["workers"], f"{what}: {found['world_size']} ranks ran"
            close(found["samples_per_s"], x["samples_per_s"], what=f"{what} samples/s")
            for a, b in zip(found["per_rank_samples_per_s"], x["per_rank_samples_per_s"]):
                close(a, b, what=f"{what} per-rank samples/s")


@check(points=5, needs_run=True)
def karp_flatt_recomputed(r):
    """karp_flatt follows from the last strong-scaling row."""
    last = r["strong_rows"][-1]
    s, n = last["speedup"], last["ideal_speedup"]
    assert math.isclose(r["karp_flatt"], (1 / s - 1 / n) / (1 - 1 / n), rel_tol=1e-6, abs_tol=1e-9)


@check(points=0.25, needs_run=True)
def sweep_rows_are_consistent(r):
    """Speedup, efficiency and step time of every row follow from its samples/s."""
    for name in ("weak_rows", "strong_rows"):
        rows = r[name]
        for x in rows:
            assert math.isclose(x["speedup"], x["samples_per_s"] / rows[0]["samples_per_s"], rel_tol=1e-6), name
            assert math.isclose(x["efficiency"], x["speedup"] / x["ideal_speedup"], rel_tol=1e-6), name
            assert math.isclose(x["step_s"], x["global_batch"] / x["samples_per_s"], rel_tol=1e-6), name
            assert math.isclose(x["samples_per_s"], sum(x["per_rank_samples_per_s"]), rel_tol=1e-6), name


@check(points=0.25, needs_run=True)
def shared_run_is_one_measurement(r):
    """A point that both sweeps contain (same workers and per-rank batch) has the same throughput in both."""
    weak = {(x["workers"], x["batch_per_worker"]): x["samples_per_s"] for x in r["weak_rows"]}
    shared = [(x["workers"], x["batch_per_worker"]) for x in r["strong_rows"]
              if (x["workers"], x["batch_per_worker"]) in weak]
    for key in shared:
        assert any(math.isclose(weak[key], x["samples_per_s"], rel_tol=1e-9) for x in r["strong_rows"]
                   if (x["workers"], x["batch_per_worker"]) == key), key


@check(points=3, needs_run=True)
def steps_follow_the_sample_budget(r):
    """Every run of the study saw the same samples: steps x batch is constant (up to one batch)."""
    seen = [x["steps"] * x["batch"] for x in r["lr_study"]]
    assert max(seen) - min(seen) < max(x["batch"] for x in r["lr_study"])


@check(points=5, needs_run=True)
def noise_scale_recomputed(r):
    """b_noise follows from the recorded gradient norms."""
    n = r["noise_norms"]
    bs, bb, gs, gb = n["b_small"], n["b_big"], n["g2_small"], n["g2_big"]
    g2 = (bb * gb - bs * gs) / (bb - bs)
    trace = (gs - gb) / (1 / bs - 1 / bb)
    assert math.isclose(r["b_noise"], trace / g2, rel_tol=1e-6)


@check(points=0.25, needs_run=True)
def small_batch_gradients_are_noisier(r):
    """|g_B|^2 is larger for the smaller batch (the noise term tr(Sigma)/B)."""
    n = r["noise_norms"]
    assert n["g2_small"] > n["g2_big"]


def _cosine(step, total, peak, warm):
    """The exercise's schedule: linear warm-up to the peak, then cosine decay to 0 at the last step."""
    if step < warm:
        return peak * (step + 1) / warm
    progress = min((step - warm) / max(total - 1 - warm, 1), 1.0)
    return 0.5 * peak * (1 + math.cos(math.pi * progress))


def _schedule_evidence(r):
    """(your run's evidence, the constant run's evidence, peak, warm-up) of the schedule runs."""
    rows = {x["label"]: x for x in r["schedule_runs"]}
    yours, constant = evidence(r, rows["yours"]["run_dir"]), evidence(r, rows["constant"]["run_dir"])
    # the constant run's engine warm-up says the peak and the warm-up: lr = peak (s + 1) / W, then peak
    lrs = constant["lr_curve"]
    assert constant["schedule"] == "constant" and lrs, "the constant run's events show another schedule"
    peak = lrs[-1]
    warm = next(i for i, x in enumerate(lrs) if math.isclose(x, peak, rel_tol=1e-9)) + 1
    return yours, constant, peak, warm


@check(points=12, needs_run=True)
def schedule_is_yours_and_right(r):
    """Exercise 3: your run imported my_schedule.py, and the rate each of its steps used is the warm-up-then-cosine
    schedule recomputed from the run's steps, peak and warm-up (half the points for each part)."""
    yours, constant, peak, warm = _schedule_evidence(r)
    assert yours["schedule"] == "my_schedule:lr_at", f"your run used schedule {yours['schedule']!r}"
    assert "my_schedule.py" in yours["code"], "your run's start event names no my_schedule.py among its code"
    steps, lrs = yours["step_numbers"], yours["lr_curve"]
    total = len(steps)
    assert steps == list(range(1, total + 1)) and steps == constant["step_numbers"], \
        "your run's step events do not cover every step of the constant run's (log_every = 1)"
    assert warm >= 2 and total > warm + 2, f"warm-up {warm} of {total} steps: the runs need both parts"
    want = [_cosine(s - 1, total, peak, warm) for s in steps]
    wrong = [i for i, (a, b) in enumerate(zip(lrs, want)) if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9 * peak)]
    if not wrong:
        return None
    first = wrong[0]
    where = "warm-up" if first < warm else "decay"
    parts = ({"warm-up"} if any(i < warm for i in wrong) else set()) | ({"decay"} if any(i >= warm for i in wrong)
                                                                      else set())
    message = (f"{where}: step {first} (0-based) used lr {lrs[first]:.6g}, the schedule gives {want[first]:.6g} "
               f"(peak {peak:g}, warm-up {warm} steps, {total} steps); wrong in: {', '.join(sorted(parts))}")
    if len(parts) == 2:
        raise AssertionError(message)
    return partial(0.5, message)


@check(points=2, needs_run=True)
def decay_ends_below_constant(r):
    """The recorded tail losses are the runs' (last tenth of rank 0's loss curve), and the decayed run ends lower."""
    rows = {x["label"]: x for x in r["schedule_runs"]}
    tails = {}
    for label, row in rows.items():
        curve = evidence(r, row["run_dir"])["loss_curve"]
        k = max(1, len(curve) // 10)
        tails[label] = sum(curve[-k:]) / k
        close(tails[label], row["tail_loss"], rel=1e-9, what=f"{label} tail loss")
    assert tails["yours"] < tails["constant"], f"decayed {tails['yours']:.3f}, constant {tails['constant']:.3f}"


@check(points=0.25, needs_run=True)
def critical_batch_fit_recomputed(r):
    """Each batch's best is its fewest steps among the rates tried, and the fit follows from those points."""
    study, fit = r["target_study"], r["critical_batch"]
    for p in study["best"]:
        tried = [x["steps"] for x in study["rows"] if x["batch"] == p["batch"] and x["steps"] is not None]
        assert p["steps"] == min(tried), f"batch {p['batch']}: best {p['steps']}, but the rows reach {min(tried)}"
    xs, ys = [1 / p["batch"] for p in study["best"]], [p["steps"] for p in study["best"]]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    e_min = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    s_min = my - e_min * mx
    assert math.isclose(fit["e_min"], e_min, rel_tol=1e-6) and math.isclose(fit["s_min"], s_min, rel_tol=1e-6)
    assert math.isclose(fit["b_crit"], e_min / s_min, rel_tol=1e-6)


@check(points=0.25, needs_run=True)
def small_batches_need_more_steps(r):
    """Steps to the target fall with the batch below the critical batch: the smallest batch needs far more."""
    best = sorted(r["target_study"]["best"], key=lambda p: p["batch"])
    assert best[0]["steps"] > 1.5 * min(p["steps"] for p in best), [(p["batch"], p["steps"]) for p in best]


@check(points=0.25, needs_run=True)
def growth_matches_decay_in_fewer_steps(r):
    """Each run's steps follow from its phases; batch growth ends near step decay in far fewer steps."""
    rows = {x["label"]: x for x in r["growth_vs_decay"]}
    assert len({x["samples"] for x in rows.values()}) == 1, "the runs saw different sample budgets"
    for x in rows.values():
        want = sum(max(1, int(p["share"] * x["samples"]) // p["batch"]) for p in x["phases"])
        assert x["steps"] == want, f"{x['label']}: {x['steps']} steps, its phases give {want}"
    g, d, c = rows["growth"], rows["decay"], rows["constant"]
    assert g["steps"] < 0.7 * d["steps"], f"growth {g['steps']} steps, decay {d['steps']}"
    assert g["eval_loss"] < min(d["eval_loss"] + 0.15, c["eval_loss"]), \
        f"eval loss: growth {g['eval_loss']:.3f}, decay {d['eval_loss']:.3f}, constant {c['eval_loss']:.3f}"


@check(points=2, needs_run=True)
def batch_job_ran_on_two_nodes(r):
    """Exercise 6: the job of your batch script ran 2 ranks on 2 hosts, as its ranks' start events show."""
    if r["lab04_nodes"] < 2:
        return partial(1, "not run here (nodes = 1: no multi-node Slurm); this exercise is not counted")
    job = r["job_run"]
    found = evidence(r, job["run_dir"])
    assert len(found["hosts"]) == 2, f"the ranks started on {found['hosts']}: ask Slurm for 2 nodes"
    assert found["world_size"] == 2, f"{found['world_size']} ranks ran: ask for 1 task on each of the 2 nodes"
    assert found["strategy"] == "ddp" and found["steps"] == r["job_run"]["steps"]
    close(found["samples_per_s"], job["samples_per_s"], what="job samples/s")
