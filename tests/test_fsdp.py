"""Strategy fsdp (FSDP2 fully_shard) in the engine: the same losses as DDP at the same global batch and seed, in
every sharding mode, with the state per rank halved by sharding and the collectives of each mode counted."""
from __future__ import annotations

import pytest

from scalelab.errors import SpecError
from scalelab.launch import launch

from helpers import tiny

# a model whose parameters and Adam state dominate what a rank holds: 0.53 M parameters, 8.5 MB of state
STATE_HEAVY = {"model.name": "mlp", "model.width": 256, "optim.name": "adamw", "optim.lr": 0.001, "steps": 5}
MODES = {"ddp": {}, "full": {"strategy": "fsdp"},
         "grad_op": {"strategy": "fsdp", "fsdp.sharding": "grad_op"},
         "none": {"strategy": "fsdp", "fsdp.sharding": "none"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each mode trained once on 2 ranks: (loss curve, rank 0's memory event, rank 1's memory event)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    out = {}
    for name, changes in MODES.items():
        run = launch(tiny(tmp, name, workers=2, **STATE_HEAVY, **changes))
        summary = run.wait(timeout=180)
        memory = {e["rank"]: e for e in run.events() if e["type"] == "memory"}
        out[name] = (summary["loss_curve"], memory[0], memory[1])
    return out


@pytest.mark.parametrize("mode", ["full", "grad_op", "none"])
def test_fsdp_follows_ddps_losses_at_the_same_global_batch_and_seed(runs, mode):
    ddp, fsdp = runs["ddp"][0], runs[mode][0]
    assert len(fsdp) == 5
    assert fsdp == pytest.approx(ddp, rel=1e-5, abs=1e-6), f"{mode}: {fsdp} vs DDP {ddp}"


def test_full_shard_holds_at_most_six_tenths_of_ddps_state_per_rank(runs):
    ddp = runs["ddp"][1]
    for mode in ("full", "grad_op"):
        for mem in runs[mode][1:]:
            assert mem["state_bytes"] <= 0.6 * ddp["state_bytes"], f"{mode}: {mem} vs DDP {ddp}"
            assert mem["optim_bytes"] <= 0.6 * ddp["optim_bytes"] and mem["grad_bytes"] <= 0.6 * ddp["grad_bytes"]
    assert runs["none"][1]["state_bytes"] == ddp["state_bytes"]  # replicated: nothing saved
    # Adam keeps two moments per parameter: its state is twice the parameters', sharded or not
    assert ddp["optim_bytes"] == 2 * ddp["param_bytes"] and ddp["rss_peak_bytes"] > ddp["state_bytes"]


def test_each_mode_issues_its_own_collectives(runs):
    ddp, full, grad_op, none = (runs[m][1]["comm"] for m in ("ddp", "full", "grad_op", "none"))
    param_bytes = runs["ddp"][1]["param_bytes"]
    assert set(ddp) == {"all_reduce"} and ddp["all_reduce"]["bytes"] == param_bytes  # one bucket of gradients
    assert set(full) == {"all_gather", "reduce_scatter"}
    # ZeRO-3 gathers every layer twice (forward, and again for backward); ZeRO-2 keeps the forward's copy
    assert full["all_gather"]["bytes"] == 2 * param_bytes and grad_op["all_gather"]["bytes"] == param_bytes
    assert full["reduce_scatter"]["bytes"] == grad_op["reduce_scatter"]["bytes"] == param_bytes
    assert set(none) == {"all_reduce"} and none["all_reduce"]["bytes"] == param_bytes
    assert all(c["time_s"] > 0 for comm in (ddp, full, grad_op, none) for c in comm.values())  # each waited, timed


@pytest.mark.parametrize("changes, field, hint", [
    ({"strategy": "fsdp", "checkpoint.every_steps": 2}, "checkpoint.mode", "sharded"),
    ({"strategy": "fsdp", "fsdp.sharding": "zero3"}, "fsdp.sharding", "grad_op"),
    ({"fsdp.reshard_after_forward": "yes"}, "fsdp.reshard_after_forward", "true or false"),
])
def test_a_bad_fsdp_setting_names_the_field_and_the_fix(tmp_path, changes, field, hint):
    with pytest.raises(SpecError) as err:
        tiny(tmp_path, **changes)
    assert err.value.field == field and hint in str(err.value)
