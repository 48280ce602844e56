"""Lab 09 hidden checks: the engine runs against their event files (the K-FAC runs, and the step-time runs on 1
and 2 ranks behind the time to accuracy on N ranks); the races and KAISA's bytes held against each other and the
arithmetic they follow from.

The LARS comparison and the races train in the notebook's own process, so they are held against themselves
(curves against reached points, steps against samples); the engine's K-FAC runs against their events.
"""
import json
import math

from scalelab.experiments.optimization import engine_step_s
from scalelab.experiments.profiling import read_run_file
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import WORKDIR


@check(points=0.25, needs_run=True)
def engine_runs_are_the_engine_runs(r):
    """The engine K-FAC runs' throughput and world size are what their event files show."""
    for name, run in r["engine_kfac"].items():
        found = evidence(r, run["run_dir"], total_steps="engine_steps")
        assert found["world_size"] == r["lab09_params"]["workers"], f"{name}: {found['world_size']} ranks ran"
        close(found["samples_per_s"], run["samples_per_s"], what=f"{name} samples/s")


def _race(r, name: str) -> list:
    """The rows of race `name` ("race", "kfac_race" or "conv_race"), each run over the grader's samples (the conv
    net's over conv_samples)."""
    key = "conv_samples" if name == "conv_race" else "samples"
    samples = param(r, key)
    for row in r[name]:
        if samples is not None:
            assert row["steps"] == samples // row["batch"], \
                f"{row['label']}: {row['steps']} steps of {row['batch']}, the grader set {key}={samples}: " \
                "parameters were changed after injection"
    return r[name]


def _kaisa(r) -> dict:
    """KAISA's measurement, at the grader's kaisa_steps and kaisa_width."""
    k = r["kaisa"]
    for name in ("steps", "width"):
        want = param(r, f"kaisa_{name}")
        assert want is None or k[name] == want, f"KAISA ran at {name} {k[name]}, the grader set kaisa_{name}=" \
                                                f"{want}: parameters were changed after injection"
    return k


@check(points=0.25, needs_run=True)
def races_are_consistent(r):
    """Every race row's reached point is on its curve, and steps, samples and batch agree."""
    for row in _race(r, "race") + _race(r, "kfac_race") + _race(r, "conv_race"):
        curve, hit = row["curve"], row["reached"]
        assert all(a["samples"] < b["samples"] for a, b in zip(curve, curve[1:])), f"{row['label']}: curve order"
        assert math.isclose(row["final_accuracy"], curve[-1]["accuracy"]), f"{row['label']}: final accuracy"
        first = next((c for c in curve if c["accuracy"] >= row["target"]), None)
        if hit is None:
            assert first is None, f"{row['label']}: the curve reaches the target but 'reached' is empty"
            continue
        assert first is not None and first["samples"] == hit["samples"], f"{row['label']}: reached point"
        assert hit["samples"] == hit["steps"] * row["batch"], f"{row['label']}: samples = steps x batch"
        assert math.isclose(first["seconds"], hit["seconds"], rel_tol=1e-9), f"{row['label']}: reached seconds"
        assert hit["seconds"] <= row["seconds_per_step"] * row["steps"] * (1 + 1e-9), f"{row['label']}: seconds"


@check(points=0.25, needs_run=True)
def race_used_the_parameters(r):
    """The race ran at the lab's target and batches."""
    p = r["lab09_params"]
    assert {row["target"] for row in r["race"] + r["kfac_race"] + r["conv_race"]} == {p["target"]}
    assert {row["batch"] for row in r["race"]} == set(p["batches"])
    assert {row["batch"] for row in r["kfac_race"] + r["conv_race"]} == {p["kfac_batch"]}


@check(points=0.25, needs_run=True)
def kaisa_bytes_follow_from_the_layers(r):
    """The decomposition bytes each rank reports follow from the layer shapes and the round-robin assignment."""
    k = _kaisa(r)
    per_layer = [4 * (a + a * a + g + g * g) for a, g in k["dims"]]
    world = len(k["comm"])
    assert all(x["eigen_bytes"] == sum(per_layer) for x in k["comm"]), "every COMM-OPT rank holds every layer"
    for rank, x in enumerate(k["mem"]):
        assert x["eigen_bytes"] == sum(b for i, b in enumerate(per_layer) if i % world == rank), \
            f"MEM-OPT rank {rank} holds the layers it inverts"
    assert all(x["mode"] == "COMM-OPT" for x in k["comm"]) and all(x["mode"] == "MEM-OPT" for x in k["mem"])


@check(points=2, needs_run=True)
def lars_record_is_its_run(r):
    """The LARS comparison ran its steps: one ratio per step per layer, one loss per step per optimizer."""
    lars = r["lars"]
    if param(r, "lars_steps") is not None:
        assert lars["steps"] == param(r, "lars_steps"), \
            f"the LARS comparison ran {lars['steps']} steps, the grader set lars_steps={param(r, 'lars_steps')}: " \
            "parameters were changed after injection"
    assert all(len(v) == lars["steps"] for v in lars["ratios"].values())
    assert len(lars["losses"]["mine"]) == len(lars["losses"]["library"]) == lars["steps"]


# The exercises, held against what ran: the grader's sizes, the runs' own rows (points for the student's own work;
# the checks above hold records to runs that an untouched copy makes as well).

@check(points=5, needs_run=True)
def lars_by_hand_is_the_librarys(r):
    """Exercise 1: with your trust ratio, LARS by hand follows pytorch-optimizer's LARS step for step over the
    grader's lars_steps: the same losses, the same parameters, one trust ratio per step per weight matrix."""
    lars = r["lars"]
    steps = param(r, "lars_steps") or lars["steps"]
    assert lars["steps"] == steps, f"the LARS comparison ran {lars['steps']} steps, the grader set lars_steps=" \
                                   f"{steps}: parameters were changed after injection"
    mine, library = lars["losses"]["mine"], lars["losses"]["library"]
    assert len(mine) == len(library) == steps, f"{len(mine)} and {len(library)} losses for {steps} steps"
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(mine, library)), \
        "your LARS's losses leave the library's"
    assert lars["max_param_diff"] < 1e-5, f"parameters {lars['max_param_diff']:.2e} apart"
    assert len(lars["ratios"]) >= 2 and all(len(v) == steps for v in lars["ratios"].values())


@check(points=3, needs_run=True)
def best_large_batch_is_the_races_fastest(r):
    """Exercise 2: the run named is, among the large-batch runs of the race that reached the target, the one with
    the fewest seconds to it."""
    race = _race(r, "race")
    big = max(row["batch"] for row in race)
    hits = [row for row in race if row["batch"] == big and row["reached"]]
    want = min(hits, key=lambda row: row["reached"]["seconds"])["label"] if hits else None
    assert r["best_large_batch"] == want, f"{r['best_large_batch']!r} named; the race's fastest is {want!r}"


@check(points=4, needs_run=True)
def kfac_trade_is_the_races(r):
    """Exercise 3: the iteration saving, step cost and wall speedup are the K-FAC race's own ratios, and the wall
    speedup is the iteration saving over the step cost."""
    runs = {row["label"]: row for row in _race(r, "kfac_race")}
    sgd, kfac = runs["sgd"], runs["kfac"]
    assert sgd["reached"] and kfac["reached"], "both SGD and K-FAC must reach the target"
    want = {"iteration_saving": sgd["reached"]["steps"] / kfac["reached"]["steps"],
            "step_cost": kfac["seconds_per_step"] / sgd["seconds_per_step"],
            "wall_speedup": sgd["reached"]["seconds"] / kfac["reached"]["seconds"]}
    for key, value in want.items():
        assert math.isclose(r[key], value, rel_tol=1e-6), f"{key} {r[key]!r} is not the race's {value:.4g}"


@check(points=3, needs_run=True)
def comm_opt_bytes_is_what_a_rank_holds(r):
    """Exercise 4: the prediction is 4 bytes x (a + a^2 + g + g^2) summed over the layers of the grader's width, and
    it is what every COMM-OPT rank of the measurement held."""
    k = _kaisa(r)
    want = sum(4 * (a + a * a + g + g * g) for a, g in k["dims"])
    assert r["comm_opt_bytes"] == want, f"comm_opt_bytes {r['comm_opt_bytes']}, the layers give {want}"
    assert all(x["eigen_bytes"] == want for x in k["comm"]), "a COMM-OPT rank held other bytes"


@check(points=4, needs_run=True)
def your_factor_trains_as_the_dense_one(r):
    """Exercise 5: the engine run whose ranks formed every Kronecker factor with your my_kfac.factor follows the
    dense factor's COMM-OPT run loss for loss (same seed, same data: any other factor changes the steps)."""
    mine = evidence(r, r["engine_kfac_yours"]["run_dir"], total_steps="engine_steps")
    dense = evidence(r, r["engine_kfac"]["comm"]["run_dir"], total_steps="engine_steps")
    assert "my_kfac.py" in (mine.get("code") or {}), "the run did not use my_kfac.py (optim.kfac_factor)"
    assert mine["world_size"] == dense["world_size"] == r["lab09_params"]["workers"], \
        f"{mine['world_size']} ranks ran yours, {dense['world_size']} the dense one"
    a, b = mine["loss_curve"], dense["loss_curve"]
    assert len(a) == len(b) and a, f"{len(a)} and {len(b)} losses"
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6), \
            f"step {step}: loss {x:.6f} with your factor, {y:.6f} with the dense one"


@check(points=0.5, needs_run=True)
def time_on_ranks_is_the_engine_runs(r):
    """Time to accuracy on N ranks: every race run of SGD (small batch), LARS, LAMB (large batch) and K-FAC that
    reached the target has one engine run per rank count (1 and 2, 4 where workers allow) of engine_steps steps, at
    its optimizer and global batch, made in this grading (its events carry the grading's nonce); its step time is
    the one the run's events give (rank 0's mean step_s - data_s, first step left out, within 1e-6), and
    its seconds to the target are the race's steps to it times that step time."""
    p, on = r["lab09_params"], r["on_ranks"]
    want_ranks = [n for n in (1, 2, 4) if n <= p["workers"]]
    assert on["ranks"] == want_ranks, f"ranks {on['ranks']}, with {p['workers']} workers: {want_ranks}"
    small, big = min(p["batches"]), max(p["batches"])
    labels = (f"sgd b{small}", f"lars b{big}", f"lamb b{big}", "kfac")
    race = {row["label"]: row for row in _race(r, "race") + _race(r, "kfac_race") if row["label"] in labels}
    rows = {(x["label"], x["ranks"]): x for x in on["rows"]}
    want = {(label, n) for label, row in race.items() if row["reached"] for n in want_ranks}
    assert set(rows) == want and len(rows) == len(on["rows"]), \
        f"step times for {sorted(rows)}; the race's runs that reached the target need {sorted(want)}"
    assert len({x["run_dir"] for x in on["rows"]}) == len(on["rows"]), "one engine run per row"
    for (label, n), x in rows.items():
        row, what = race[label], f"{label} on {n} ranks"
        found = evidence(r, x["run_dir"], total_steps="engine_steps")
        assert found["world_size"] == n and found["global_batch"] == row["batch"], \
            f"{what}: the run had {found['world_size']} ranks at global batch {found['global_batch']}"
        try:
            spec = json.loads(read_run_file(r[WORKDIR], f"{x['run_dir']}/spec.json"))
        except Exception as e:  # missing, a link, too big, not JSON: all the student's files
            raise AssertionError(f"{what}: the run's spec.json could not be read ({type(e).__name__})") from None
        assert spec["optim"]["name"] == row["optimizer"], f"{what}: the run trained with {spec['optim']['name']}"
        try:
            text = read_run_file(r[WORKDIR], f"{x['run_dir']}/events/rank-0.jsonl")
            step_s = engine_step_s([json.loads(line) for line in text.splitlines() if line.strip()])
        except Exception as e:  # missing, a link, too big, not events: all the student's files
            raise AssertionError(f"{what}: the run's rank-0 events could not be read ({type(e).__name__})") from None
        close(step_s, x["step_s"], what=f"{what} step time")
        assert x["steps"] == row["reached"]["steps"], \
            f"{what}: {x['steps']} steps, the race took {row['reached']['steps']}"
        assert math.isclose(x["seconds"], x["steps"] * x["step_s"], rel_tol=1e-9), f"{what}: seconds"
