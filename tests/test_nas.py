"""scalelab.experiments.nas: children made wider or deeper start from their parent's weights computing exactly
the parent's function, and beat the same architecture trained from scratch for the same steps."""
from __future__ import annotations

import pytest
import torch

from scalelab.errors import SpecError
from scalelab.experiments import nas


@pytest.fixture(scope="module")
def data():
    return nas.Digits(0)


@pytest.fixture(scope="module")
def parent(data):
    model = nas.new_model(2, 16, 0)
    data.train_model(model, 40, 0.05, 20, batch_seed=0)
    return model


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    return nas.evolve(generations=3, steps=60, seed=0, out_dir=tmp_path_factory.mktemp("nas"))


@pytest.mark.parametrize("make, arch", [(lambda p: nas.widen(p, 40, "zero", 1), {"depth": 2, "width": 40}),
                                        (lambda p: nas.widen(p, 40, "duplicate", 1), {"depth": 2, "width": 40}),
                                        (lambda p: nas.deepen(p, 1), {"depth": 3, "width": 16})])
def test_a_mutated_child_computes_its_parents_function(data, parent, make, arch):
    child = make(parent)
    assert nas.arch_of(child) == arch and type(child) is type(parent)
    with torch.no_grad():
        assert torch.allclose(child(data.x_eval), parent(data.x_eval), atol=1e-5)
    assert data.accuracy(child) == data.accuracy(parent)


def test_new_units_of_a_zero_widened_child_learn(data, parent):
    child = nas.widen(parent, 32, "zero", 1)
    out = nas.linears(child)[-1]
    assert out.weight[:, 16:].abs().max() == 0  # the new units start switched off...
    data.train_model(child, 5, 0.05, 5, batch_seed=1)
    assert out.weight[:, 16:].abs().max() > 0  # ...and get gradients at once


def test_transferred_children_start_at_the_parents_accuracy_and_beat_scratch(search):
    models = {m["id"]: m for m in search["models"]}
    children = [m for m in search["models"] if m["parent"] is not None]
    assert search["children"] == len(children) == 3 and search["lineage"] == {m["id"]: m["parent"] for m in children}
    for m in children:
        parent = models[m["parent"]]
        assert m["start_accuracy"] == parent["accuracy"]  # function preserved through the mutation
        assert m["arch"] != parent["arch"] and m["mutation"] in nas.MUTATIONS
        assert m["accuracy"] > m["scratch_accuracy"]  # same steps, same architecture, from scratch
        assert m["steps_saved"] > 0 and (m["scratch_steps_to_match"] or 4 * 60) == m["steps"] + m["steps_saved"]
    assert search["transferred_wins"] == 3 and search["steps_saved"] == sum(m["steps_saved"] for m in children)


def test_every_model_is_kept_as_a_state_dict_that_reloads(search, data):
    for m in search["models"]:
        saved = torch.load(m["path"])
        assert saved.keys() == m["state_dict"].keys()
        model = nas.new_model(m["arch"]["depth"], m["arch"]["width"], seed=123)
        model.load_state_dict(saved)
        assert data.accuracy(model) == m["accuracy"]


@pytest.mark.parametrize("call, field", [(lambda p: nas.mutate(p, "shallower"), "mutation"),
                                         (lambda p: nas.widen(p, 8), "width"),
                                         (lambda p: nas.widen(p, 32, "noise"), "mode"),
                                         (lambda p: nas.evolve(generations=0), "generations")])
def test_a_bad_argument_names_itself(parent, call, field):
    with pytest.raises(SpecError) as e:
        call(parent)
    assert e.value.field == field
