"""Lab 04 public checks: scaling sweeps, Amdahl/Karp-Flatt, learning-rate scaling and schedule, LARS/LAMB, noise scale,
critical batch, batch growth."""
import math

from scalelab.grade.checks import check


def _rows(r, name):
    rows = r[name]
    assert len(rows) >= 2 and rows[0]["workers"] == 1, f"{name}: sweep from 1 worker to more, got " \
                                                       f"{[x['workers'] for x in rows]}"
    assert all(x["samples_per_s"] > 0 for x in rows)
    return rows


@check(points=1, needs_run=True)
def weak_sweep_ran(r):
    """The weak sweep kept the per-rank batch and grew the global batch with the workers."""
    rows = _rows(r, "weak_rows")
    assert len({x["batch_per_worker"] for x in rows}) == 1, "weak scaling keeps batch_per_worker fixed"
    assert all(x["global_batch"] == x["workers"] * rows[0]["batch_per_worker"] for x in rows)


@check(points=1, needs_run=True)
def strong_sweep_ran(r):
    """The strong sweep kept the global batch and split it over the workers."""
    rows = _rows(r, "strong_rows")
    assert len({x["global_batch"] for x in rows}) == 1, "strong scaling keeps the global batch fixed"


@check(points=1, needs_run=True)
def breakdown_recorded(r):
    """Every sweep row says where its step time went (fractions adding up to 1)."""
    for x in r["weak_rows"] + r["strong_rows"]:
        assert math.isclose(sum(x["time_fraction"].values()), 1.0, abs_tol=1e-6), x["time_fraction"]


@check(points=2, needs_run=True)
def serial_fraction_estimated(r):
    """Exercise 1: Amdahl's projection on 64 ranks follows from the Karp-Flatt serial fraction."""
    e, s64 = r["karp_flatt"], r["amdahl_64"]
    assert isinstance(e, (int, float)) and math.isfinite(e), f"karp_flatt={e!r}: (1/S - 1/N) / (1 - 1/N)"
    assert math.isclose(s64, 1 / (e + (1 - e) / 64), rel_tol=1e-6), "amdahl_64 = 1 / (e + (1 - e) / 64)"


@check(points=2, needs_run=True)
def learning_rates_scaled(r):
    """Exercise 2: the study's learning rates follow the none / linear / sqrt rules."""
    rows = r["lr_study"]
    base = min(x["batch"] for x in rows)
    lr0 = next(x["lr"] for x in rows if x["batch"] == base and x["rule"] == "none")
    for x in rows:
        ratio = x["batch"] / base
        want = lr0 * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[x["rule"]]
        assert math.isclose(x["lr"], want, rel_tol=1e-6), f"batch {x['batch']} {x['rule']}: lr {x['lr']} != {want}"


@check(points=1, needs_run=True)
def large_batch_degrades_without_scaling(r):
    """At a fixed sample budget, the largest batch with the base learning rate ends far worse than the smallest."""
    rows = {(x["batch"], x["rule"]): x for x in r["lr_study"]}
    small, big = min(b for b, _ in rows), max(b for b, _ in rows)
    assert rows[(big, "none")]["eval_loss"] > rows[(small, "none")]["eval_loss"] + 0.3


@check(points=1, needs_run=True)
def scaling_the_lr_helps_at_a_moderate_batch(r):
    """A scaled learning rate beats the unscaled one at a batch between the smallest and the largest."""
    rows = {(x["batch"], x["rule"]): x for x in r["lr_study"]}
    batches = sorted({b for b, _ in rows})
    mid = batches[len(batches) // 2]
    assert min(rows[(mid, "linear")]["eval_loss"], rows[(mid, "sqrt")]["eval_loss"]) < rows[(mid, "none")]["eval_loss"]


@check(points=2, needs_run=True)
def lars_or_lamb_recover_the_large_batch(r):
    """At the largest batch, LARS or LAMB beats SGD with the linearly scaled learning rate."""
    rows = {x["label"]: x for x in r["optimizers"]}
    adaptive = min(rows["lars"]["eval_loss"], rows["lamb"]["eval_loss"])
    assert adaptive < rows["sgd linear"]["eval_loss"] - 0.2, \
        f"LARS/LAMB reach {adaptive:.3f}, SGD-linear {rows['sgd linear']['eval_loss']:.3f}"


@check(points=2, needs_run=True)
def noise_scale_estimated(r):
    """Exercise 4: the gradient noise scale is a positive, finite batch size."""
    b = r["b_noise"]
    assert isinstance(b, (int, float)) and math.isfinite(b) and b > 0, f"b_noise={b!r}"


@check(points=2, needs_run=True)
def schedule_warms_up_then_decays(r):
    """Exercise 3: your schedule rises linearly to the peak over the warm-up, then falls to 0 at the last step."""
    p = r["schedule_preview"]
    lr, peak, warm = p["lr"], p["peak_lr"], p["warmup_steps"]
    assert len(lr) == p["total_steps"], f"{len(lr)} rates for {p['total_steps']} steps"
    rising, got = [round(peak * (s + 1) / warm, 6) for s in range(warm)], [round(x, 6) for x in lr[:warm]]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, rising)), \
        f"warm-up: steps 0..{warm - 1} should be {rising}, got {got}"
    assert max(lr) <= peak * (1 + 1e-9), f"the rate goes above the peak: {max(lr)}"
    assert all(b <= a + 1e-12 for a, b in zip(lr[warm - 1:], lr[warm:])), "after the warm-up the rate must only fall"
    assert abs(lr[-1]) < 1e-6 * peak, f"the last step's rate is {lr[-1]}, not 0"


@check(points=1, needs_run=True)
def schedule_runs_made(r):
    """The schedule runs: yours and a constant rate, with the same steps, peak and warm-up."""
    rows = {x["label"]: x for x in r["schedule_runs"]}
    assert set(rows) == {"yours", "constant"}, f"runs {sorted(rows)}"
    assert rows["yours"]["schedule"] == "my_schedule:lr_at" and rows["constant"]["schedule"] == "constant"
    for key in ("steps", "peak_lr", "warmup_steps"):
        assert rows["yours"][key] == rows["constant"][key], f"the runs differ in {key}"


@check(points=1, needs_run=True)
def critical_batch_measured(r):
    """Steps to the target at four batch sizes or more, and a finite, positive fitted critical batch."""
    best = r["target_study"]["best"]
    assert len(best) >= 4, f"only {len(best)} batch sizes reached the target: {[p['batch'] for p in best]}"
    b = r["critical_batch"]["b_crit"]
    assert isinstance(b, (int, float)) and math.isfinite(b) and b > 0, f"b_crit={b!r}"


@check(points=1, needs_run=True)
def batch_growth_compared(r):
    """Constant, step decay and batch growth, on the same samples: growth takes fewer steps."""
    rows = {x["label"]: x for x in r["growth_vs_decay"]}
    assert set(rows) == {"constant", "decay", "growth"}, f"runs {sorted(rows)}"
    seen = {k: sum(p["share"] for p in x["phases"]) for k, x in rows.items()}
    assert len(set(seen.values())) == 1, f"the runs' shares of the samples differ: {seen}"
    assert rows["growth"]["steps"] < rows["decay"]["steps"], "growing the batch must take fewer steps"
