"""Lab 04 public checks: scaling sweeps, Amdahl/Karp-Flatt, learning-rate scaling, LARS/LAMB, noise scale."""
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
    """Exercise 3: the gradient noise scale is a positive, finite batch size."""
    b = r["b_noise"]
    assert isinstance(b, (int, float)) and math.isfinite(b) and b > 0, f"b_noise={b!r}"
