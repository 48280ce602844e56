"""Lab 10's workflows (scalelab/experiments/workflows.py): the lineage store keeps a tensor a child shares with
its parent once; a drifting stream makes a model forget and a rehearsal buffer (also spread over 2 ranks) brings
the old task back; a performance model fitted on real engine runs predicts held-out runs better than their mean."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scalelab import run_spmd
from scalelab.launch import launch
from scalelab.experiments import workflows as wf

from helpers import tiny


def test_the_lineage_store_keeps_shared_tensors_once_and_gives_every_model_back(tmp_path):
    store = wf.LineageStore(tmp_path / "lineage")
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    first = store.put("parent", parent.state_dict())
    child = nn.Sequential(*[m for m in parent])  # transferred layers, frozen; a new head trained
    child[4] = nn.Linear(64, 4)
    second = store.put("child", child.state_dict(), parent="parent", meta={"mutation": "new head"})
    assert first["shared"] == [] and sorted(second["shared"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert second["new_bytes"] < 0.1 * first["new_bytes"]  # only the head's 260 numbers
    for name, t in child.state_dict().items():
        assert torch.equal(store.get("child")[name], t)
    assert store.lineage("child") == ["child", "parent"]
    sizes = store.sizes()
    assert sizes["models"] == 2 and sizes["dedup_ratio"] > 1.8  # two models in about one model's bytes
    with pytest.raises(KeyError, match="parent 'nobody' is not in the store"):
        store.put("orphan", child.state_dict(), parent="nobody")
    with pytest.raises(ValueError, match="model id '../x'"):
        store.put("../x", child.state_dict())


def test_a_drifting_stream_is_forgotten_and_a_rehearsal_buffer_brings_it_back():
    plain = wf.continual_run(tasks=2, buffer=0, steps_per_task=150)
    replay = wf.continual_run(tasks=2, buffer=200, steps_per_task=150)
    assert plain["acc"][0][0] > 0.8  # task 0 was learnt ...
    assert plain["old_accuracy"] < 0.15 and plain["forgetting"][0] > 0.7  # ... and forgotten after task 1
    assert replay["old_accuracy"] > plain["old_accuracy"] + 0.2


def test_the_rehearsal_buffer_spread_over_two_ranks_keeps_the_replicas_alike():
    ranks = run_spmd("scalelab.experiments.workflows:continual_run", world=2, timeout=180,
                     kwargs={"tasks": 2, "buffer": 200, "steps_per_task": 150})
    assert [r["buffer_per_rank"] for r in ranks] == [100, 100]
    assert ranks[0]["acc"] == ranks[1]["acc"]  # averaged gradients: one model on both ranks
    assert ranks[0]["old_accuracy"] > 0.2


def test_run_rows_reads_each_engine_runs_shape_and_throughput(tmp_path):
    shapes = [(8, 16, 1), (64, 64, 2)]
    for width, batch, ranks in shapes:
        spec = tiny(tmp_path, f"w{width}-b{batch}-r{ranks}", workers=ranks, **{
            "model.name": "mlp", "model.width": width, "optim.batch_per_worker": batch, "steps": 6,
            "world.threads_per_worker": 1, "data.samples": 1024})
        summary = launch(spec).wait(timeout=180)
        row = next(r for r in wf.run_rows(tmp_path, links={str(spec.output_dir): "100mbit"})
                   if r["run_dir"] == spec.output_dir)
        model = nn.Sequential(nn.Flatten(), nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 4))
        assert row["params"] == sum(p.numel() for p in model.parameters())
        assert (row["batch"], row["ranks"], row["nodes"], row["link_mbit"]) == (batch, ranks, 1, 100.0)
        assert row["samples_per_s"] == pytest.approx(summary["samples_per_s"])
    assert len(wf.run_rows(tmp_path)) == 2 and wf.run_rows(tmp_path)[0]["link_mbit"] == 1e4
    again = launch(spec.with_overrides({"optim.batch_per_worker": 2 * batch})).wait(timeout=180)  # same folder
    row = next(r for r in wf.run_rows(tmp_path) if r["run_dir"] == spec.output_dir)
    assert row["batch"] == 2 * batch and row["samples_per_s"] == pytest.approx(again["samples_per_s"])


def test_the_performance_model_recovers_a_power_law_and_predicts_held_out_shapes():
    """Rows from samples/s = 3e6 * params^-0.5 * batch^0.3 * ranks^0.9 (x 5 % noise): the fit finds the exponents
    and predicts shapes it did not see within the noise, far better than the training mean does."""
    gen = torch.Generator().manual_seed(0)
    def row(params, batch, ranks):
        noise = 1 + 0.05 * float(torch.randn(1, generator=gen))
        return {"params": params, "batch": batch, "ranks": ranks, "nodes": 1, "link_mbit": 1e4,
                "samples_per_s": 3e6 * params ** -0.5 * batch ** 0.3 * ranks ** 0.9 * noise}
    train = [row(p, b, r) for p in (1e4, 1e5, 1e6) for b in (16, 128) for r in (1, 2)]
    held = [row(3e5, 64, 2), row(3e4, 32, 1)]
    model = wf.fit_perf_model(train)
    coef = dict(zip(model["features"], model["coef"]))
    assert coef["log_params"] == pytest.approx(-0.5, abs=0.05) and coef["log_ranks"] == pytest.approx(0.9, abs=0.15)
    err = wf.holdout_error(model, held)
    mean = sum(r["samples_per_s"] for r in train) / len(train)
    naive = sum(abs(mean - r["samples_per_s"]) / r["samples_per_s"] for r in held) / len(held)
    assert err["mean_rel_error"] < 0.12 and err["mean_rel_error"] < naive / 5
    with pytest.raises(ValueError, match="at least 3"):
        wf.fit_perf_model(train[:2])
