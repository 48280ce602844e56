"""The 3D-parallelism planner: its memory arithmetic equals what the engine measures for FSDP at fp32, its group
placement follows Megatron's rank order, the 70B example needs several nodes, and the widget recomputes headless."""
from __future__ import annotations

import pytest

from scalelab.experiments.planner import ClusterShape, ModelShape, group_links, layouts, plan, state_bytes_per_gpu


def test_fp32_zero3_state_equals_what_fsdp_measures_in_the_engine():
    # tests/test_fsdp.py's model: 132,612 parameters; the engine measured 1,060,896 bytes per rank at 2 ranks
    assert state_bytes_per_gpu(132_612, dp=2, zero=3, param_bytes=4, grad_bytes=4, optim_bytes=8) == 1_060_896
    assert state_bytes_per_gpu(132_612, dp=2, zero=0, param_bytes=4, grad_bytes=4, optim_bytes=8) == 2_121_792
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3"):
        state_bytes_per_gpu(1, 1, zero=4)


def test_tensor_groups_stay_inside_a_node_and_data_groups_cross_them():
    assert group_links(dp=2, tp=8, pp=1, gpus_per_node=8) == {"tp": "intra", "pp": "intra", "dp": "inter"}
    assert group_links(dp=1, tp=4, pp=4, gpus_per_node=8)["pp"] == "inter"
    assert group_links(dp=4, tp=16, pp=1, gpus_per_node=8)["tp"] == "inter"


def test_a_70b_model_does_not_fit_one_node_but_fits_eight_with_tp_and_pp():
    one = plan(ModelShape.named("70b"), ClusterShape(nodes=1), dp=8, tp=1, pp=1)
    assert not one["feasible"] and any("GB per GPU" in p for p in one["problems"])
    big = ClusterShape(nodes=8)
    good = plan(ModelShape.named("70b"), big, dp=2, tp=8, pp=4)
    assert good["feasible"] and good["links"]["tp"] == "intra", good
    assert good["bubble"] == pytest.approx(3 / 11)
    best = layouts(ModelShape.named("70b"), big)[0]
    assert best["feasible"] and best["world"] == 64
    bad = plan(ModelShape.named("7b"), big, dp=3, tp=8, pp=1)
    assert any("dp x tp x pp = 24" in p for p in bad["problems"])


def test_planner_widget_recomputes_when_a_control_changes():
    from scalelab.widgets import ParallelismPlanner
    planner = ParallelismPlanner(model="70b", nodes=8)
    assert planner.result["dp"] == 64 and "does not work" in planner.table.value
    planner.tp.value = 8
    planner.pp.value = 4
    assert planner.result["dp"] == 2 and planner.result["feasible"] and "fits" in planner.table.value
    assert planner.best()["feasible"] and planner.tp.value * planner.pp.value * planner.result["dp"] == 64
