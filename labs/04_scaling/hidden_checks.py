"""Lab 04 hidden checks: the sweeps against their runs' event files; the exercises recomputed from the raw records.

The weak and strong sweeps are engine runs with events: their samples/s are held against them, and speedup,
efficiency and Karp-Flatt follow from those. The learning-rate study, LARS/LAMB and the noise scale train in the
notebook's own process, so they are held against each other only. Every check needs a real run (`needs_run`).
"""
import math

from scalelab.grade.checks import check, close, evidence


@check(points=3, needs_run=True)
def sweeps_are_the_engine_runs(r):
    """Every sweep row's world size and samples/s (global and per rank) are what its run's event files show."""
    for name in ("weak", "strong"):
        rows, dirs = r[f"{name}_rows"], r[f"{name}_run_dirs"]
        assert len(rows) == len(dirs), f"{name}: {len(rows)} rows but {len(dirs)} run dirs"
        for x, run_dir in zip(rows, dirs):
            found = evidence(r, run_dir)
            what = f"{name} sweep, {x['workers']} workers"
            assert found["world_size"] == x["workers"], f"{what}: {found['world_size']} ranks ran"
            close(found["samples_per_s"], x["samples_per_s"], what=f"{what} samples/s")
            for a, b in zip(found["per_rank_samples_per_s"], x["per_rank_samples_per_s"]):
                close(a, b, what=f"{what} per-rank samples/s")


@check(points=2, needs_run=True)
def karp_flatt_recomputed(r):
    """karp_flatt follows from the last strong-scaling row."""
    last = r["strong_rows"][-1]
    s, n = last["speedup"], last["ideal_speedup"]
    assert math.isclose(r["karp_flatt"], (1 / s - 1 / n) / (1 - 1 / n), rel_tol=1e-6, abs_tol=1e-9)


@check(points=1, needs_run=True)
def sweep_rows_are_consistent(r):
    """Speedup, efficiency and step time of every row follow from its samples/s."""
    for name in ("weak_rows", "strong_rows"):
        rows = r[name]
        for x in rows:
            assert math.isclose(x["speedup"], x["samples_per_s"] / rows[0]["samples_per_s"], rel_tol=1e-6), name
            assert math.isclose(x["efficiency"], x["speedup"] / x["ideal_speedup"], rel_tol=1e-6), name
            assert math.isclose(x["step_s"], x["global_batch"] / x["samples_per_s"], rel_tol=1e-6), name
            assert math.isclose(x["samples_per_s"], sum(x["per_rank_samples_per_s"]), rel_tol=1e-6), name


@check(points=1, needs_run=True)
def shared_run_is_one_measurement(r):
    """A point that both sweeps contain (same workers and per-rank batch) has the same throughput in both."""
    weak = {(x["workers"], x["batch_per_worker"]): x["samples_per_s"] for x in r["weak_rows"]}
    shared = [(x["workers"], x["batch_per_worker"]) for x in r["strong_rows"]
              if (x["workers"], x["batch_per_worker"]) in weak]
    for key in shared:
        assert any(math.isclose(weak[key], x["samples_per_s"], rel_tol=1e-9) for x in r["strong_rows"]
                   if (x["workers"], x["batch_per_worker"]) == key), key


@check(points=1, needs_run=True)
def steps_follow_the_sample_budget(r):
    """Every run of the study saw the same samples: steps x batch is constant (up to one batch)."""
    seen = [x["steps"] * x["batch"] for x in r["lr_study"]]
    assert max(seen) - min(seen) < max(x["batch"] for x in r["lr_study"])


@check(points=2, needs_run=True)
def noise_scale_recomputed(r):
    """b_noise follows from the recorded gradient norms."""
    n = r["noise_norms"]
    bs, bb, gs, gb = n["b_small"], n["b_big"], n["g2_small"], n["g2_big"]
    g2 = (bb * gb - bs * gs) / (bb - bs)
    trace = (gs - gb) / (1 / bs - 1 / bb)
    assert math.isclose(r["b_noise"], trace / g2, rel_tol=1e-6)


@check(points=1, needs_run=True)
def small_batch_gradients_are_noisier(r):
    """|g_B|^2 is larger for the smaller batch (the noise term tr(Sigma)/B)."""
    n = r["noise_norms"]
    assert n["g2_small"] > n["g2_big"]
