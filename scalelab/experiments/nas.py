"""Lab 10: architecture search where a child starts from its parent's weights (model transfer), against scratch.

    r = evolve(generations=4, steps=60, seed=0, out_dir="runs/nas")
    r["models"][2]   # {"id", "parent", "arch": {"depth", "width"}, "mutation", "accuracy", "start_accuracy",
                     #  "scratch_accuracy", "steps", "scratch_steps_to_match", "steps_saved", "seconds_saved",
                     #  "model", "state_dict", "path", "curve", "scratch_curve"}
    r["lineage"]     # {child id: parent id}: what a lineage store keeps, with each model's state_dict

The search space is the engine's MLP (`scalelab.train.models.MLP`) on the digits set: `depth` hidden layers of
`width` units. A child is its parent made wider (width x 2) or deeper (one more hidden layer), and starts from its
parent's weights, function-preserving in the style of Net2Net (Chen, Goodfellow, Shlens 2016):

- widen, mode "zero": the parent's units keep their weights; each new unit gets fresh incoming weights and zero
  outgoing weights, so the network computes exactly what the parent did and the new units still learn (their
  outgoing weights get a gradient at once).
- widen, mode "duplicate" (Net2WiderNet): each new unit copies a random existing unit, and the outgoing weights
  of a unit copied c times are divided by c. Also exact, but copies receive identical gradients and stay
  copies under plain SGD unless something breaks the symmetry (Net2Net adds noise): "zero" is the default.
- deepen: a new hidden layer with identity weights and zero bias before the output layer; it follows a ReLU,
  whose outputs are >= 0, so ReLU(I h) = h exactly.

Each transferred child is compared with the same architecture trained from scratch (the engine's initialisation)
for the same number of steps, and the scratch run continues until it matches the transferred child's accuracy:
"steps saved" is how many more steps scratch needed (a lower bound when it never got there in its budget), and
"seconds_saved" those steps at the measured time per step (GPU-hours saved, on a GPU).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..data import build_dataset
from ..data.loader import build_eval_set
from ..errors import SpecError
from ..train.models import build_model
from ..train.optim import build_optimizer
from .large_batch import _batches, one_thread

MUTATIONS = ("wider", "deeper")
WIDEN_MODES = ("zero", "duplicate")
BATCH = 64


def nas_spec(depth: int, width: int, seed: int = 0, lr: float = 0.05):
    """The RunSpec of one architecture: the engine's MLP on digits, SGD with momentum."""
    from ..run.spec import preset
    return preset("tiny").with_overrides({
        "name": "nas", "data.source": "digits", "model.name": "mlp", "model.depth": depth, "model.width": width,
        "optim.name": "sgd", "optim.lr": lr, "optim.batch_per_worker": BATCH, "seed": seed})


def new_model(depth: int, width: int, seed: int = 0) -> nn.Module:
    """A freshly initialised MLP of this shape (the engine's builder: 1x8x8 digits in, 10 classes out)."""
    return build_model(nas_spec(depth, width, seed).model, 1, 8, 10, seed)


def arch_of(model: nn.Module) -> dict:
    """{"depth", "width"} of an engine MLP."""
    hidden = linears(model)[:-1]
    return {"depth": len(hidden), "width": hidden[0].out_features}


def linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers of an engine MLP, input to output."""
    return [m for m in model.net if isinstance(m, nn.Linear)]


@torch.no_grad()
def widen(parent: nn.Module, width: int, mode: str = "zero", seed: int = 0) -> nn.Module:
    """A copy of `parent` with every hidden layer `width` units wide that computes the same function."""
    if mode not in WIDEN_MODES:
        raise SpecError("mode", f"unknown widen mode {mode!r}; choose one of: {', '.join(WIDEN_MODES)}")
    old = arch_of(parent)
    if width < old["width"]:
        raise SpecError("width", f"{width} is narrower than the parent's {old['width']}: widen only grows")
    child = new_model(old["depth"], width, seed)  # new units keep this fresh initialisation in mode "zero"
    src, dst = linears(parent), linears(child)
    gen = torch.Generator().manual_seed(seed)
    prev, prev_count = None, None  # the previous layer's unit map (new unit -> the old unit it copies) and counts
    for i, (a, b) in enumerate(zip(src, dst)):
        last = i == len(src) - 1
        if mode == "zero":
            n_out = a.out_features
            b.weight[:n_out, :a.in_features] = a.weight
            b.weight[:n_out, a.in_features:] = 0  # old units ignore the new ones: the function is unchanged
            b.bias[:n_out] = a.bias
            continue
        w = a.weight if prev is None else a.weight[:, prev] / prev_count[prev]
        if last:
            b.weight.copy_(w)
            b.bias.copy_(a.bias)
            continue
        units = torch.cat([torch.arange(a.out_features),
                           torch.randint(a.out_features, (width - a.out_features,), generator=gen)])
        b.weight.copy_(w[units])
        b.bias.copy_(a.bias[units])
        prev, prev_count = units, torch.bincount(units, minlength=a.out_features).float()
    return child


@torch.no_grad()
def deepen(parent: nn.Module, seed: int = 0) -> nn.Module:
    """A copy of `parent` with one more hidden layer, identity-initialised, before the output layer."""
    old = arch_of(parent)
    child = new_model(old["depth"] + 1, old["width"], seed)
    src, dst = linears(parent), linears(child)
    for a, b in zip(src[:-1], dst[:-2]):
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)
    dst[-2].weight.copy_(torch.eye(old["width"]))
    dst[-2].bias.zero_()
    dst[-1].weight.copy_(src[-1].weight)
    dst[-1].bias.copy_(src[-1].bias)
    return child


def mutate(parent: nn.Module, mutation: str, mode: str = "zero", seed: int = 0) -> nn.Module:
    """The child for a mutation name: "wider" (width x 2) or "deeper" (one more layer)."""
    if mutation == "wider":
        return widen(parent, 2 * arch_of(parent)["width"], mode, seed)
    if mutation == "deeper":
        return deepen(parent, seed)
    raise SpecError("mutation", f"unknown mutation {mutation!r}; choose one of: {', '.join(MUTATIONS)}")


class Digits:
    """The training batches and held-out set every model in a search sees (built once)."""

    def __init__(self, seed: int = 0):
        spec = nas_spec(1, 8, seed)
        self.train = build_dataset(spec.data, seed)
        self.x_eval, self.y_eval = build_eval_set(spec.data, seed)
        self.seed = seed

    @torch.no_grad()
    def accuracy(self, model: nn.Module) -> float:
        """Held-out accuracy."""
        return float((model(self.x_eval).argmax(1) == self.y_eval).float().mean())

    def train_model(self, model: nn.Module, steps: int, lr: float, eval_every: int, batch_seed: int) -> list:
        """Train in place for `steps` steps; returns [(step, held-out accuracy)] every `eval_every` steps."""
        opt = build_optimizer(nas_spec(1, 8, lr=lr).optim, model, lr)
        batches, curve = _batches(self.train, BATCH, batch_seed), [(0, self.accuracy(model))]
        for step in range(1, steps + 1):
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % eval_every == 0 or step == steps:
                curve.append((step, self.accuracy(model)))
        return curve


def compare_child(data: Digits, parent: nn.Module, mutation: str, steps: int, seed: int, lr: float = 0.05,
                  mode: str = "zero", match_budget: int = 4, eval_every: int = 5) -> dict:
    """One child trained `steps` steps from its parent's weights and from scratch; scratch goes on (up to
    `match_budget` x steps) until it reaches the transferred child's accuracy."""
    child = mutate(parent, mutation, mode, seed)
    start_accuracy = data.accuracy(child)
    t0 = time.perf_counter()
    curve = data.train_model(child, steps, lr, eval_every, batch_seed=seed)
    s_per_step = (time.perf_counter() - t0) / steps
    arch = arch_of(child)
    scratch = new_model(arch["depth"], arch["width"], seed)
    scratch_curve = data.train_model(scratch, match_budget * steps, lr, eval_every, batch_seed=seed)
    accuracy = curve[-1][1]
    at_equal = [a for s, a in scratch_curve if s <= steps][-1]
    match = next((s for s, a in scratch_curve if a >= accuracy), None)
    return {"arch": arch, "mutation": mutation, "model": child, "start_accuracy": start_accuracy,
            "accuracy": accuracy, "curve": curve, "scratch_accuracy": at_equal, "scratch_curve": scratch_curve,
            "scratch_steps_to_match": match, "matched": match is not None,
            "steps_saved": (match if match is not None else match_budget * steps) - steps,
            "s_per_step": s_per_step, "seconds_saved": ((match or match_budget * steps) - steps) * s_per_step}


def evolve(generations: int = 4, steps: int = 60, seed: int = 0, start: tuple = (1, 16), max_depth: int = 4,
           max_width: int = 128, lr: float = 0.05, mode: str = "zero", match_budget: int = 4,
           out_dir=None) -> dict:
    """An evolutionary search: a root model, then per generation a parent picked by a 2-way tournament on
    accuracy, mutated (wider or deeper, as the limits allow), trained from its weights and compared with scratch.
    Returns {"models": [...], "lineage": {child: parent}, "best", "steps_saved", "transferred_wins"}; with
    `out_dir`, each model's state_dict is also saved to out_dir/model-<id>.pt."""
    for name, value in (("generations", generations), ("steps", steps), ("match_budget", match_budget)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(name, f"must be a positive integer, got {value!r}")
    if mode not in WIDEN_MODES:
        raise SpecError("mode", f"unknown widen mode {mode!r}; choose one of: {', '.join(WIDEN_MODES)}")
    rng = random.Random(seed)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    with one_thread():
        data = Digits(seed)
        root = new_model(*start, seed)
        curve = data.train_model(root, steps, lr, 5, batch_seed=seed)
        models = [_record(0, None, root, None, out, accuracy=curve[-1][1], steps=steps, curve=curve)]
        for gen in range(1, generations + 1):
            a, b = rng.sample(models, 2) if len(models) > 1 else (models[0], models[0])
            parent = max(a, b, key=lambda m: m["accuracy"])
            arch = parent["arch"]
            allowed = [m for m in MUTATIONS if (m == "wider" and 2 * arch["width"] <= max_width)
                       or (m == "deeper" and arch["depth"] < max_depth)]
            if not allowed:
                continue
            r = compare_child(data, parent["model"], rng.choice(allowed), steps, seed + gen, lr, mode, match_budget)
            models.append(_record(gen, parent["id"], r.pop("model"), r.pop("mutation"), out, steps=steps, **r))
    children = [m for m in models if m["parent"] is not None]
    return {"models": models, "lineage": {m["id"]: m["parent"] for m in children},
            "best": max(models, key=lambda m: m["accuracy"])["id"],
            "steps_saved": sum(m["steps_saved"] for m in children),
            "transferred_wins": sum(m["accuracy"] > m["scratch_accuracy"] for m in children),
            "children": len(children)}


def fine_tune_head(model: nn.Module, steps: int = 30, seed: int = 0, lr: float = 0.05) -> dict:
    """A copy of `model` whose output layer only is trained `steps` steps on the digits (every other layer frozen:
    requires_grad off, so its tensors stay bit-equal to the parent's). Returns {"state_dict", "trained": the names
    of the tensors training changed, "start_accuracy", "accuracy", "steps"}."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise SpecError("steps", f"must be a positive integer, got {steps!r}")
    import copy
    child = copy.deepcopy(model)
    head = linears(child)[-1]
    for p in child.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    before = {k: v.detach().clone() for k, v in child.state_dict().items()}
    with one_thread():
        data = Digits(seed)
        start = data.accuracy(child)
        opt = torch.optim.SGD([p for p in child.parameters() if p.requires_grad], lr=lr, momentum=0.9)
        batches = _batches(data.train, BATCH, seed + 7)
        for _ in range(steps):
            x, y = next(batches)
            loss = F.cross_entropy(child(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        accuracy = data.accuracy(child)
    state = {k: v.detach().clone() for k, v in child.state_dict().items()}
    return {"state_dict": state, "trained": sorted(k for k in state if not torch.equal(state[k], before[k])),
            "start_accuracy": start, "accuracy": accuracy, "steps": steps}


def _record(id_: int, parent, model: nn.Module, mutation, out: Path | None, **fields) -> dict:
    """One model's entry: ids, architecture, results, its weights (and where they were saved)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = None
    if out is not None:
        path = str(out / f"model-{id_}.pt")
        torch.save(state, path)
    return {"id": id_, "parent": parent, "arch": arch_of(model), "mutation": mutation, "model": model,
            "state_dict": state, "path": path, **fields}
