"""Tensor and pipeline parallelism by hand, and a sharded checkpoint resharded 2 -> 1 -> 2, on real gloo ranks:
the column/row-parallel MLP equals the serial layers in outputs and gradients; a 2-stage pipeline trains to the
unsplit batch's losses under GPipe and 1F1B, with the bubble shrinking as micro-batches grow and 1F1B holding
fewer activations; an FSDP model and its Adam state come back exactly at another world size."""
from __future__ import annotations

import pytest

from scalelab.launch.spmd import SpmdPool, run_spmd
from scalelab.train.pipeline import bubble_formula, replay_bubble, schedule_ops, split_layers

T = "scalelab.experiments.model_parallel:"


@pytest.fixture(scope="module")
def pool():
    with SpmdPool(world=2, threads=1) as p:
        yield p


def test_column_and_row_parallel_mlp_equals_the_serial_layers(pool):
    for r in pool.run(T + "tensor_parallel_check", width=64, batch=8):
        assert r["out_diff"] < 1e-5 and r["input_grad_diff"] < 1e-5, r
        assert max(r["grad_diffs"].values()) < 1e-5, r["grad_diffs"]
        assert set(r["grad_diffs"]) == {"first.weight", "first.bias", "second.weight", "second.bias"}
        # each rank holds half of both weight matrices (the second bias whole), and the layer costs exactly two
        # all-reduces: the output forward (g), the input's gradient backward (f)
        assert r["param_elements"] < 0.51 * r["serial_elements"]
        assert set(r["comm"]) == {"all_reduce"} and r["comm"]["all_reduce"]["calls"] == 2
        assert r["comm"]["all_reduce"]["bytes"] == r["output_bytes"] + r["input_bytes"]
        assert r["comm"]["all_reduce"]["time_s"] > 0


def test_dtensor_parallelize_module_splits_the_same_layers_exactly(pool):
    for r in pool.run(T + "dtensor_parallel_check", width=64, batch=8):
        assert r["out_diff"] < 1e-5 and max(r["grad_diffs"].values()) < 1e-5, r
        assert r["local_elements"] < 0.51 * r["serial_elements"]
        assert r["comm"]["all_reduce"]["calls"] == 1  # the row-parallel partial sums (x needs no gradient)


def test_a_layer_without_the_backward_all_reduce_gets_wrong_input_gradients(pool, tmp_path, monkeypatch):
    broken = tmp_path / "broken_tp.py"
    broken.write_text("import torch\nfrom scalelab.train.tensor_parallel import ReduceFromParallel\n"
                      "class CopyToParallel(torch.autograd.Function):\n"
                      "    @staticmethod\n    def forward(ctx, x, group=None):\n        return x.view_as(x)\n"
                      "    @staticmethod\n    def backward(ctx, grad):\n        return grad, None\n")
    r = run_spmd(T + "tensor_parallel_check", world=2, kwargs={"module": "broken_tp"},
                 env={"PYTHONPATH": str(tmp_path)})[0]
    assert r["out_diff"] < 1e-5 and r["input_grad_diff"] > 1e-3  # forward right, dL/dx is one rank's part only


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trains_to_the_unsplit_losses_and_its_bubble_shrinks_with_micro_batches(pool, schedule):
    runs = {m: pool.run(T + "pipeline_measure", schedule=schedule, micro=m, steps=3) for m in (1, 8)}
    for m, (first, last) in runs.items():
        assert first["losses"] == last["losses"]  # every stage reports the last stage's loss
        assert first["losses"] == pytest.approx(first["serial_losses"], rel=1e-5)
        assert first["formula"] == bubble_formula(2, m)
    assert runs[1][0]["measured_bubble"] == pytest.approx(0.5, abs=1e-9)  # one micro-batch: stages take turns
    # 8 micro-batches: the formula says 0.11; the replay takes each stage's fastest operations and the best step,
    # and a margin stays for stages a loaded 2-core machine slowed all through (4 busy loops beside: 0.14)
    assert runs[8][0]["measured_bubble"] < 0.3
    peaks = [r["peak_in_flight"] for r in runs[8]]
    assert peaks == ([8, 8] if schedule == "gpipe" else [2, 1])  # 1F1B: at most p - s micro-batches held


def test_schedules_and_the_replay_follow_the_textbook():
    assert schedule_ops("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert schedule_ops("gpipe", 1, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for p, m in ((2, 4), (4, 8)):  # uniform stages, F = 1, B = 2: the replay gives exactly the formula
        timelines = [[(op, i, 0.0, 1.0 if op == "F" else 2.0) for op, i in schedule_ops("1f1b", s, p, m)]
                     for s in range(p)]
        assert replay_bubble(timelines)["bubble"] == pytest.approx(bubble_formula(p, m))
    # load from other processes stretches some of stage 1's operations 3x: not schedule, the replay ignores it
    slowed = [[(op, i, 0.0, (1.0 if op == "F" else 2.0) * (3 if s == 1 and i % 2 else 1))
               for op, i in schedule_ops("gpipe", s, 2, 8)] for s in range(2)]
    assert replay_bubble(slowed)["bubble"] == pytest.approx(bubble_formula(2, 8))
    assert replay_bubble(slowed, typical=False)["bubble"] > bubble_formula(2, 8) + 0.1
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedule_ops("zigzag", 0, 2, 2)
    import torch.nn as nn
    parts = split_layers(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)), 2)
    assert [len(p) for p in parts] == [2, 2]
    with pytest.raises(ValueError, match="cannot cut 1 layers into 2"):
        split_layers(nn.Sequential(nn.Linear(2, 2)), 2)


def test_a_2x2_mesh_holds_what_the_planner_estimates_and_trains_like_the_unsplit_pair():
    from scalelab.experiments.planner import state_bytes_per_gpu
    ranks = run_spmd(T + "mesh_2d_state", world=4, threads=1, timeout=180)
    want = state_bytes_per_gpu(ranks[0]["params"], dp=2, tp=2, zero=3, param_bytes=4, grad_bytes=4, optim_bytes=8)
    for r in ranks:  # FSDP on dp x DTensor on tp: a quarter of 16 bytes per parameter, the replicated bias aside
        assert r["state_bytes"] == pytest.approx(want, rel=0.01), (r, want)
        assert r["loss"] == pytest.approx(r["serial_loss"], rel=1e-5)


def test_sharded_checkpoint_reshards_two_to_one_to_two_exactly(tmp_path):
    saved = run_spmd(T + "reshard_save", world=2, kwargs={"ckpt_dir": str(tmp_path / "two")})[0]
    one = run_spmd(T + "reshard_restore", world=1, kwargs={"ckpt_dir": str(tmp_path / "two"),
                                                           "save_dir": str(tmp_path / "one")})[0]
    two = run_spmd(T + "reshard_restore", world=2, kwargs={"ckpt_dir": str(tmp_path / "one")})[0]
    assert saved["world"] == 2 and one["world"] == 1 and two["world"] == 2 and one["step"] == two["step"] == 3
    assert any(k.startswith("optim.") for k in saved["state"])  # Adam's moments travel too
    assert one["state"] == saved["state"] and two["state"] == saved["state"]  # bit-identical sums and elements
