"""Lab 09 public checks: LARS by hand, time to accuracy, K-FAC's iterations against wall time, KAISA's memory."""
import math

from scalelab.grade.checks import check


def _reached(rows, label):
    run = next((r for r in rows if r["label"] == label), None)
    assert run is not None, f"no run labelled {label!r} in the race"
    assert run["reached"], f"{label} did not reach the target accuracy"
    return run


@check(points=2, needs_run=True)
def lars_matches_the_library(r):
    """Exercise 1: your trust ratio gives pytorch-optimizer's LARS, parameter for parameter."""
    lars = r["lars"]
    assert lars["max_param_diff"] < 1e-5, f"your LARS ends {lars['max_param_diff']:.2e} away from the library's: " \
                                         "ratio = eta |w| / (|g| + weight_decay |w|)"
    assert len(lars["ratios"]) >= 2, "one trust ratio per weight matrix"


@check(points=1, needs_run=True)
def trust_ratios_differ_per_layer(r):
    """Layers get different trust ratios: the reason for LARS."""
    last = [v[-1] for v in r["lars"]["ratios"].values()]
    assert all(0 < x < 1 for x in last), f"trust ratios {last}: expected between 0 and 1 with eta = 0.001"
    assert max(last) > 1.2 * min(last), f"trust ratios {last} are all alike"


@check(points=1, needs_run=True)
def small_batch_sgd_reaches_the_target(r):
    """The baseline: SGD at the small batch reaches the target accuracy."""
    small = min(r["lab09_params"]["batches"])
    _reached(r["race"], f"sgd b{small}")


@check(points=2, needs_run=True)
def fastest_large_batch_run_named(r):
    """Exercise 2: best_large_batch is the large-batch run that reached the target in the fewest seconds."""
    big = max(r["lab09_params"]["batches"])
    hits = [x for x in r["race"] if x["batch"] == big and x["reached"]]
    want = min(hits, key=lambda x: x["reached"]["seconds"])["label"] if hits else None
    assert r["best_large_batch"] == want, f"best_large_batch {r['best_large_batch']!r}; compare reached seconds"


@check(points=1, needs_run=True)
def kfac_needs_fewer_steps(r):
    """K-FAC reaches the target in fewer steps than SGD at the same batch."""
    sgd, kfac = _reached(r["kfac_race"], "sgd"), _reached(r["kfac_race"], "kfac")
    assert kfac["reached"]["steps"] < sgd["reached"]["steps"], "K-FAC took as many steps as SGD"


@check(points=2, needs_run=True)
def kfac_trade_computed(r):
    """Exercise 3: iteration saving, step cost and wall speedup from the race."""
    runs = {x["label"]: x for x in r["kfac_race"]}
    sgd, kfac = runs["sgd"], runs["kfac"]
    want = {"iteration_saving": sgd["reached"]["steps"] / kfac["reached"]["steps"],
            "step_cost": kfac["seconds_per_step"] / sgd["seconds_per_step"],
            "wall_speedup": sgd["reached"]["seconds"] / kfac["reached"]["seconds"]}
    for key, value in want.items():
        assert math.isclose(r[key], value, rel_tol=1e-6), f"{key} = {r[key]!r}; expected {value:.4g}"


@check(points=2, needs_run=True)
def comm_opt_memory_predicted(r):
    """Exercise 4: comm_opt_bytes is what each COMM-OPT rank holds."""
    measured = r["kaisa"]["comm"][0]["eigen_bytes"]
    assert r["comm_opt_bytes"] == measured, f"comm_opt_bytes {r['comm_opt_bytes']} but a rank holds {measured}: " \
                                            "4 bytes x (a + a*a + g + g*g) per layer"


@check(points=1, needs_run=True)
def mem_opt_holds_less(r):
    """MEM-OPT splits the decompositions over the ranks: each holds less than a COMM-OPT rank."""
    comm, mem = r["kaisa"]["comm"], r["kaisa"]["mem"]
    assert max(x["eigen_bytes"] for x in mem) < comm[0]["eigen_bytes"]
    assert sum(x["eigen_bytes"] for x in mem) == comm[0]["eigen_bytes"]


@check(points=1, needs_run=True)
def kaisa_modes_train_alike(r):
    """The engine's COMM-OPT and MEM-OPT K-FAC runs follow the same loss curve."""
    a, b = r["engine_kfac"]["comm"]["loss_curve"], r["engine_kfac"]["mem"]["loss_curve"]
    assert len(a) == len(b) > 0
    assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5) for x, y in zip(a, b)), f"{a} vs {b}"


@check(points=1, needs_run=True)
def your_factor_ran(r):
    """Exercise 5: the run with your factor ran its steps and ended near the dense factor's run."""
    a, b = r["engine_kfac_yours"]["loss_curve"], r["engine_kfac"]["comm"]["loss_curve"]
    assert len(a) == len(b), f"{len(a)} losses with your factor, {len(b)} with the dense one"
    assert abs(a[-1] - b[-1]) < 1e-3, f"final loss {a[-1]:.4f} with your factor, {b[-1]:.4f} with the dense one"


@check(points=0.5, needs_run=True)
def kfac_on_a_conv_net_needs_fewer_steps(r):
    """K-FAC, with convolution factors, reaches the target on the small CNN in fewer steps than SGD."""
    sgd, kfac = _reached(r["conv_race"], "sgd"), _reached(r["conv_race"], "kfac")
    assert kfac["reached"]["steps"] < sgd["reached"]["steps"], "K-FAC took as many steps as SGD on the CNN"


@check(points=0.5, needs_run=True)
def time_on_ranks_measured(r):
    """Every race run that reached the target has a step time on every rank count, and its seconds to the target
    are its steps times that step time."""
    rows = r["on_ranks"]["rows"]
    assert {x["ranks"] for x in rows} == set(r["on_ranks"]["ranks"]) >= {1, 2}, "step times on 1 and 2 ranks"
    for x in rows:
        assert x["step_s"] > 0 and math.isclose(x["seconds"], x["steps"] * x["step_s"], rel_tol=1e-9), \
            f"{x['label']} on {x['ranks']} ranks: seconds {x['seconds']} is not steps x step time"
