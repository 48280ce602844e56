"""K-FAC written in the project (scalelab/train/kfac.py): its Kronecker factors and preconditioned gradient
against a small dense computation, convolutions through unfold, and KAISA's distribution over 2 gloo ranks equal
to one process on the union of their batches, whatever the gradient-worker fraction."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scalelab import run_spmd
from scalelab.errors import RunFailed, SpecError
from scalelab.launch import launch
from helpers import tiny
from scalelab.train.kfac import KFAC, eigen, factor, grad_matrix, layer_inputs, output_grads, precondition

T = "scalelab.experiments.optimization:"


def test_the_factors_are_the_expectations_of_inputs_and_output_gradients_computed_densely():
    torch.manual_seed(0)
    layer, x = nn.Linear(5, 3), torch.randn(8, 5)
    y = layer(x)
    y.retain_grad()
    F.mse_loss(y, torch.zeros_like(y)).backward()  # a mean over the batch: G undoes the 1/batch
    a = torch.cat([x, torch.ones(8, 1)], dim=1)
    dense_a = sum(torch.outer(r, r) for r in a) / 8
    per_sample = y.grad * 8  # dl_i/dy_i
    dense_g = sum(torch.outer(r, r) for r in per_sample) / 8
    assert torch.allclose(factor(layer_inputs(layer, x)), dense_a, atol=1e-6)
    assert torch.allclose(factor(output_grads(layer, y.grad, 8)), dense_g, atol=1e-6)
    # the layer's gradient, bias last, is the mean of the outer products g_i a_i^T
    assert torch.allclose(grad_matrix(layer), sum(torch.outer(g, r) for g, r in zip(per_sample, a)) / 8, atol=1e-6)


def test_the_preconditioned_gradient_solves_the_damped_kronecker_system():
    torch.manual_seed(1)
    ma, mg = torch.randn(4, 4), torch.randn(3, 3)
    A, G = ma @ ma.t() / 4, mg @ mg.t() / 3
    grad, damping = torch.randn(3, 4), 0.01
    v = precondition(grad, eigen(A), eigen(G), damping)
    # row-major vec(G V A) = (G (x) A) vec(V): solve the 12 x 12 system directly
    dense = torch.linalg.solve(torch.kron(G, A).double() + damping * torch.eye(12, dtype=torch.float64),
                               grad.flatten().double())
    assert torch.allclose(v.flatten().double(), dense, rtol=1e-4, atol=1e-5)
    # and it is not the identity: a badly conditioned factor changes the direction
    assert not torch.allclose(v / v.norm(), grad / grad.norm(), atol=1e-2)


def test_convolution_inputs_are_the_receptive_fields_of_every_output_position():
    torch.manual_seed(2)
    conv, x = nn.Conv2d(2, 3, 3, padding=1), torch.randn(2, 2, 4, 4)
    rows = layer_inputs(conv, x)
    assert rows.shape == (2 * 16, 2 * 9 + 1)
    padded = F.pad(x, (1, 1, 1, 1))
    n, i, j = 1, 2, 3  # sample 1, output position (2, 3)
    field = padded[n, :, i:i + 3, j:j + 3].reshape(-1)
    assert torch.allclose(rows[n * 16 + i * 4 + j, :-1], field) and rows[n * 16 + i * 4 + j, -1] == 1
    # the output gradient rows line up with the same positions
    y = conv(x)
    y.retain_grad()
    y.sum().backward()
    g = output_grads(conv, y.grad, 2)
    assert g.shape == (32, 3) and torch.allclose(g[n * 16 + i * 4 + j], y.grad[n, :, i, j] * 2)


def test_kfac_converges_faster_than_sgd_on_a_badly_scaled_problem():
    """Logistic regression on features scaled 1 .. 100: SGD's step must stay small for the large ones, K-FAC's A
    undoes the scaling. Same 30 steps and data; SGD at the best of four learning rates; compared within one run."""
    def run(make):
        torch.manual_seed(3)
        z = torch.randn(512, 16)
        x, y = z * torch.logspace(0, 2, 16), (z @ torch.randn(16, 4)).argmax(1)
        model = nn.Linear(16, 4)
        opt = make(model)
        for _ in range(30):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            return float(F.cross_entropy(model(x), y))
    sgd = min(run(lambda m, lr=lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
              for lr in (3e-4, 1e-3, 3e-3, 1e-2))
    kfac = run(lambda m: KFAC(m, lr=1.0, momentum=0.9, damping=1e-2, kl_clip=0, inv_every=1))
    assert kfac < 0.25 * sgd, (kfac, sgd)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_kaisa_on_two_ranks_equals_one_process_on_both_batches(fraction):
    single = run_spmd(T + "kfac_trajectory", world=1, kwargs={"steps": 4, "fraction": 1.0})[0]
    ranks = run_spmd(T + "kfac_trajectory", world=2, kwargs={"steps": 4, "fraction": fraction}, timeout=120)
    assert ranks[0]["params"] == pytest.approx(ranks[1]["params"], abs=1e-6)  # replicas stay identical
    assert ranks[0]["params"] == pytest.approx(single["params"], rel=1e-4, abs=1e-5)
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-4)
    modes = {r["stats"]["mode"] for r in ranks}
    assert modes == {"COMM-OPT" if fraction == 1.0 else "MEM-OPT"}
    held = [r["stats"]["eigen_bytes"] for r in ranks]
    if fraction == 1.0:  # every rank holds every layer's decomposition
        assert held[0] == held[1] == single["stats"]["eigen_bytes"]
    else:  # each holds only the layers it is the inverse worker of
        assert sum(held) == single["stats"]["eigen_bytes"] and max(held) < single["stats"]["eigen_bytes"]
        assert all(r["stats"]["sent_bytes"] > 0 for r in ranks)


def test_kfac_in_the_engine_trains_the_same_in_mem_opt_and_comm_opt(tmp_path):
    """optim.name=kfac through launch() on 2 DDP ranks: KAISA's fraction changes who computes, not the
    trajectory; and the preconditioning is active (the curve is not plain SGD's)."""
    base = {"optim.lr": 0.05, "optim.kfac_inv_every": 2, "model.name": "cnn", "steps": 5}
    curves = {}
    for name, changes in {"mem": {"optim.name": "kfac", "optim.kfac_grad_worker_fraction": 0.5},
                          "comm": {"optim.name": "kfac", "optim.kfac_grad_worker_fraction": 1.0},
                          "sgd": {"optim.name": "sgd"}}.items():
        curves[name] = launch(tiny(tmp_path, name, workers=2, **base, **changes)).wait(timeout=180)["loss_curve"]
    assert len(curves["mem"]) == 5 and all(map(math.isfinite, curves["mem"]))
    assert curves["mem"] == pytest.approx(curves["comm"], rel=1e-4, abs=1e-5)
    assert curves["mem"][1:] != pytest.approx(curves["sgd"][1:], rel=1e-3)  # step 0 is the same model and batch


def test_a_factor_of_ones_own_runs_on_every_rank_and_a_wrong_one_changes_the_trajectory(tmp_path, monkeypatch):
    """optim.kfac_factor = module:function: every rank forms the factors with it (lab 09's exercise 5); the dense
    one gives the library's losses exactly, one without the mean's 1/n other losses, a wrong shape a clear error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dense_kfac.py").write_text("def factor(rows):\n    return rows.t() @ rows / rows.shape[0]\n")
    (tmp_path / "sum_kfac.py").write_text("def factor(rows):\n    return rows.t() @ rows\n")
    (tmp_path / "bad_kfac.py").write_text("def factor(rows):\n    return rows @ rows.t()\n")
    base = {"optim.name": "kfac", "optim.lr": 0.05, "optim.kfac_inv_every": 2, "model.name": "cnn", "steps": 4}
    curves, runs = {}, {}
    for name in ("dense", "library", "sum"):
        factor = "dense" if name == "library" else f"{name}_kfac:factor"
        runs[name] = launch(tiny(tmp_path, name, workers=2, **base, **{"optim.kfac_factor": factor}))
        curves[name] = runs[name].wait(timeout=180)["loss_curve"]
    assert curves["dense"] == curves["library"]
    assert curves["sum"][1:] != pytest.approx(curves["library"][1:], rel=1e-3)
    start = json.loads((runs["dense"].run_dir / "events" / "rank-1.jsonl").read_text().splitlines()[0])
    assert "dense_kfac.py" in start["code"]  # every rank imported the student's module from the run's code/
    with pytest.raises(RunFailed, match=r"optim.kfac_factor.*must return the \(\d+, \d+\) factor"):
        launch(tiny(tmp_path, "bad", workers=2, **base, **{"optim.kfac_factor": "bad_kfac:factor"})).wait(timeout=180)


def test_bad_kfac_settings_name_the_field_and_the_fix(tmp_path):
    spec = tiny(tmp_path, workers=4, **{"optim.name": "kfac"})
    with pytest.raises(SpecError, match=r"optim.kfac_grad_worker_fraction.*k/4"):
        spec.with_overrides({"optim.kfac_grad_worker_fraction": 0.75})
    with pytest.raises(SpecError, match=r"optim.name.*strategy=ddp"):
        spec.with_overrides({"strategy": "fsdp"})
