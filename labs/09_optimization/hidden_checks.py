"""Lab 09 hidden checks: the engine runs against their event files; the races and KAISA's bytes held against
each other and the arithmetic they follow from.

The LARS comparison and the races train in the notebook's own process, so they are held against themselves
(curves against reached points, steps against samples); the engine's K-FAC runs against their events.
"""
import math

from scalelab.grade.checks import check, close, evidence


@check(points=2, needs_run=True)
def engine_runs_are_the_engine_runs(r):
    """The engine K-FAC runs' throughput and world size are what their event files show."""
    for name, run in r["engine_kfac"].items():
        found = evidence(r, run["run_dir"])
        assert found["world_size"] == r["lab09_params"]["workers"], f"{name}: {found['world_size']} ranks ran"
        close(found["samples_per_s"], run["samples_per_s"], what=f"{name} samples/s")


@check(points=1, needs_run=True)
def races_are_consistent(r):
    """Every race row's reached point is on its curve, and steps, samples and batch agree."""
    for row in r["race"] + r["kfac_race"]:
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


@check(points=1, needs_run=True)
def race_used_the_parameters(r):
    """The race ran at the lab's target and batches."""
    p = r["lab09_params"]
    assert {row["target"] for row in r["race"] + r["kfac_race"]} == {p["target"]}
    assert {row["batch"] for row in r["race"]} == set(p["batches"])
    assert {row["batch"] for row in r["kfac_race"]} == {p["kfac_batch"]}


@check(points=2, needs_run=True)
def kaisa_bytes_follow_from_the_layers(r):
    """The decomposition bytes each rank reports follow from the layer shapes and the round-robin assignment."""
    k = r["kaisa"]
    per_layer = [4 * (a + a * a + g + g * g) for a, g in k["dims"]]
    world = len(k["comm"])
    assert all(x["eigen_bytes"] == sum(per_layer) for x in k["comm"]), "every COMM-OPT rank holds every layer"
    for rank, x in enumerate(k["mem"]):
        assert x["eigen_bytes"] == sum(b for i, b in enumerate(per_layer) if i % world == rank), \
            f"MEM-OPT rank {rank} holds the layers it inverts"
    assert all(x["mode"] == "COMM-OPT" for x in k["comm"]) and all(x["mode"] == "MEM-OPT" for x in k["mem"])


@check(points=1, needs_run=True)
def lars_record_is_its_run(r):
    """The LARS comparison ran its steps: one ratio per step per layer, one loss per step per optimizer."""
    lars = r["lars"]
    assert all(len(v) == lars["steps"] for v in lars["ratios"].values())
    assert len(lars["losses"]["mine"]) == len(lars["losses"]["library"]) == lars["steps"]
