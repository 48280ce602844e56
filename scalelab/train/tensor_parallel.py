"""Tensor parallelism by hand: Megatron's column- and row-parallel linear layers over a process group.

A two-layer MLP `y = W2 relu(W1 x + b1) + b2` is split over the W ranks of a group without ever gathering a
weight:

    column-parallel W1: rank r holds rows r*h/W .. (r+1)*h/W of W1 (and of b1): its slice of the hidden units.
                        relu acts element-wise, so it runs on the slice with no communication.
    row-parallel W2:    rank r holds the matching columns of W2 and computes a partial y; one all-reduce sums
                        the partials (b2 is added once, after it).

Communication lives in two autograd functions, each the other's transpose (Megatron's f and g):

    copy_to_parallel     forward: identity       backward: all-reduce the input's gradient (every rank's slice
                                                           of W1 contributed a part of dL/dx)
    reduce_from_parallel forward: all-reduce     backward: identity (every rank needs the whole dL/dy)

So a forward costs one all-reduce of the output (batch x out) and a backward one of the input's gradient
(batch x in), whatever the weights' size: activations travel every layer, every micro-batch, which is why
tensor parallelism stays inside a node with fast links.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .partitioned import PartitionedModelStrategy


class CopyToParallel(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _slice(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = t.shape[dim]
    if size % world:
        raise ValueError(f"a dimension of {size} cannot be split over {world} tensor-parallel ranks: choose a "
                         f"width divisible by {world}")
    return t.narrow(dim, rank * size // world, size // world).detach().clone()


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a Linear's weight (its slice of the outputs); input copied in, output left split."""

    def __init__(self, serial: nn.Linear, rank: int, world: int, group=None, copy=CopyToParallel):
        super().__init__()
        self.group, self.copy = group, copy
        self.weight = nn.Parameter(_slice(serial.weight, 0, rank, world))
        self.bias = nn.Parameter(_slice(serial.bias, 0, rank, world)) if serial.bias is not None else None

    def forward(self, x):
        return F.linear(self.copy.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of a Linear's weight; takes a split input, all-reduces the partial outputs."""

    def __init__(self, serial: nn.Linear, rank: int, world: int, group=None, reduce=ReduceFromParallel):
        super().__init__()
        self.group, self.reduce = group, reduce
        self.weight = nn.Parameter(_slice(serial.weight, 1, rank, world))
        self.bias = nn.Parameter(serial.bias.detach().clone()) if serial.bias is not None else None

    def forward(self, x_part):
        y = self.reduce.apply(F.linear(x_part, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class ParallelMLP(nn.Module):
    """Column-parallel first layer, its activation on the slice, row-parallel second layer."""

    def __init__(self, first: nn.Linear, second: nn.Linear, rank: int, world: int, group=None, activation=F.relu,
                 copy=CopyToParallel, reduce=ReduceFromParallel):
        super().__init__()
        self.first = ColumnParallelLinear(first, rank, world, group, copy)
        self.second = RowParallelLinear(second, rank, world, group, reduce)
        self.activation = activation

    def forward(self, x):
        return self.second(self.activation(self.first(x)))


def shard_of_serial_grads(first: nn.Linear, second: nn.Linear, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The slices of a serial MLP's gradients that rank `rank` of a ParallelMLP should hold, by its names."""
    return {"first.weight": _slice(first.weight.grad, 0, rank, world),
            "first.bias": _slice(first.bias.grad, 0, rank, world),
            "second.weight": _slice(second.weight.grad, 1, rank, world),
            "second.bias": second.bias.grad.detach().clone()}


class TensorParallelStrategy(PartitionedModelStrategy):
    """Strategy tp: the engine's MLP with each pair of hidden layers split column/row over all ranks (dp = 1:
    every rank sees the whole batch); the classifier head and an unpaired last hidden layer stay replicated,
    their gradients identical on every rank because f and g are exact.

    The process group, scalar means, barriers and shutdown are the data-parallel strategy's (`base`). Parameter
    names stay those of the serial model, so `full_state_dict` concatenates the shards back into it."""

    name = "tp"
    wait = "none"

    def __init__(self, spec, info, device, base):
        self.spec, self.info, self.device, self.base = spec, info, device, base
        self.backend = base.backend
        self.split_dims: dict[str, int] = {}  # parameter name -> the dimension its shards were cut along

    def setup(self) -> None:
        """Join the process group."""
        self.base.setup()

    def wrap(self, model, optimizer):
        """Swap pairs of hidden Linear layers of `model.net` for column/row-parallel shards of themselves."""
        rank, world = self.info.rank, self.info.world_size
        linears = [i for i, layer in enumerate(model.net) if isinstance(layer, nn.Linear)][:-1]  # not the head
        names = {id(p): n for n, p in model.named_parameters()}
        for first, second in zip(linears[0::2], linears[1::2]):
            model.net[first] = ColumnParallelLinear(model.net[first], rank, world)
            model.net[second] = RowParallelLinear(model.net[second], rank, world)
            self.split_dims.update({f"net.{first}.weight": 0, f"net.{first}.bias": 0, f"net.{second}.weight": 1})
        # the shards keep their layers' names: point the (still stateless) optimizer at them
        now = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [now[names[id(p)]] for p in group["params"]]
        return model, optimizer

    @torch.no_grad()
    def evaluate(self, model, x, y) -> float:
        """Accuracy on (x, y): every rank runs the same inputs (its shards' partial sums are all-reduced)."""
        model.eval()
        correct = float((model(x).argmax(dim=1) == y).float().mean())
        model.train()
        return correct

    def full_state_dict(self, model) -> dict:
        """The serial model's parameters, shards concatenated (collective: every rank calls it)."""
        out = {}
        for name, value in model.state_dict().items():
            if name in self.split_dims:
                parts = [torch.empty_like(value) for _ in range(self.info.world_size)]
                dist.all_gather(parts, value.contiguous())
                value = torch.cat(parts, dim=self.split_dims[name])
            out[name] = value
        return out
