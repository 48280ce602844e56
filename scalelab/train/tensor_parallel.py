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
