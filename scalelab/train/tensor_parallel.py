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

A transformer block splits the same way (ParallelEncoderLayer): q, k and v column-parallel by attention heads
(each rank attends with its heads only), the out-projection row-parallel, then the block's MLP column/row: two
all-reduces forward, two backward. `split_model` swaps the engine model's layers for these shards (train/mesh.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .models import checkpointed



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


class ParallelAttention(nn.Module):
    """Multi-head self-attention with this rank's heads: column-parallel q, k and v (its rows of each third of
    the packed in-projection), attention on its heads alone, row-parallel out-projection."""

    def __init__(self, serial: nn.MultiheadAttention, rank: int, world: int, group=None):
        super().__init__()
        if serial.num_heads % world:
            raise ValueError(f"{serial.num_heads} attention heads cannot be split over {world} tensor-parallel "
                             f"ranks: choose a tp that divides {serial.num_heads}")
        self.group, self.heads, self.head_dim = group, serial.num_heads // world, serial.head_dim
        self.in_proj_weight = nn.Parameter(_slice_thirds(serial.in_proj_weight, rank, world))
        self.in_proj_bias = nn.Parameter(_slice_thirds(serial.in_proj_bias, rank, world))
        self.out_proj = RowParallelLinear(serial.out_proj, rank, world, group)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = F.linear(CopyToParallel.apply(x, self.group), self.in_proj_weight, self.in_proj_bias)
        q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)  # b, heads, t, head_dim: no communication
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class ParallelEncoderLayer(nn.Module):
    """A pre-norm nn.TransformerEncoderLayer (relu, no dropout) split over a tensor-parallel group: attention by
    heads, the MLP column/row; two all-reduces forward (one per half) and two backward. The layer norms are
    replicated (their gradients agree on every rank: f and g are exact). Parameter names stay the serial layer's."""

    def __init__(self, serial: nn.TransformerEncoderLayer, rank: int, world: int, group=None):
        super().__init__()
        self.norm1, self.norm2 = serial.norm1, serial.norm2
        self.self_attn = ParallelAttention(serial.self_attn, rank, world, group)
        self.linear1 = ColumnParallelLinear(serial.linear1, rank, world, group)
        self.linear2 = RowParallelLinear(serial.linear2, rank, world, group)

    def forward(self, x):
        x = x + self.self_attn(self.norm1(x))
        return x + self.linear2(F.relu(self.linear1(self.norm2(x))))


def _slice_thirds(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of each of q, k and v in a packed (3 x d, ...) tensor."""
    return torch.cat([_slice(part, 0, rank, world) for part in t.chunk(3, dim=0)])


def split_model(model: nn.Module, rank: int, world: int, group=None) -> dict[str, tuple[int, int]]:
    """Swap the engine model's layers for tensor-parallel shards of themselves, in place: the mlp's pairs of
    hidden layers column/row (the head and an unpaired last hidden layer stay replicated), every transformer
    block by heads and MLP (embedding, norms and head replicated). Returns, per split parameter, (dim, chunks):
    the dimension it was cut along and how many packed parts (q, k, v: 3) were each cut."""
    if hasattr(model, "blocks"):  # the gpt (train/gpt.py)
        return _split_gpt(model, rank, world, group)
    split: dict[str, tuple[int, int]] = {}
    if hasattr(model, "encoder"):
        for key, layer in list(model.encoder.layers._modules.items()):
            model.encoder.layers._modules[key] = ParallelEncoderLayer(layer, rank, world, group)
            if "forward" in vars(layer):  # models.checkpointed wrapped it: activation checkpointing survives
                checkpointed(model.encoder.layers._modules[key])
            at = f"encoder.layers.{key}."
            split.update({at + "self_attn.in_proj_weight": (0, 3), at + "self_attn.in_proj_bias": (0, 3),
                          at + "self_attn.out_proj.weight": (1, 1), at + "linear1.weight": (0, 1),
                          at + "linear1.bias": (0, 1), at + "linear2.weight": (1, 1)})
        return split
    linears = [i for i, layer in enumerate(model.net) if isinstance(layer, nn.Linear)][:-1]  # not the head
    for first, second in zip(linears[0::2], linears[1::2]):
        model.net[first] = ColumnParallelLinear(model.net[first], rank, world, group)
        model.net[second] = RowParallelLinear(model.net[second], rank, world, group)
        split.update({f"net.{first}.weight": (0, 1), f"net.{first}.bias": (0, 1), f"net.{second}.weight": (1, 1)})
    return split


def _split_gpt(model: nn.Module, rank: int, world: int, group=None) -> dict[str, tuple[int, int]]:
    """Each gpt block by heads and MLP, in place: the packed q, k, v projection column-parallel (this rank's slice of
    each third, so its output is q, k and v of its heads), the out-projection row-parallel, the MLP column/row; two
    all-reduces forward and two backward per block. Activation checkpointing and compile survive: the block stays."""
    if model.heads % world:
        raise ValueError(f"{model.heads} attention heads cannot be split over {world} tensor-parallel ranks: choose "
                         f"a tp that divides {model.heads}")
    split: dict[str, tuple[int, int]] = {}
    for key, block in model.blocks._modules.items():
        attn, mlp = block.attn, block.mlp
        qkv = ColumnParallelLinear(attn.qkv, rank, world, group)
        qkv.weight = nn.Parameter(_slice_thirds(attn.qkv.weight, rank, world))
        qkv.bias = nn.Parameter(_slice_thirds(attn.qkv.bias, rank, world))
        attn.qkv, attn.proj, attn.heads = qkv, RowParallelLinear(attn.proj, rank, world, group), attn.heads // world
        mlp.fc = ColumnParallelLinear(mlp.fc, rank, world, group)
        mlp.proj = RowParallelLinear(mlp.proj, rank, world, group)
        at = f"blocks.{key}."
        split.update({at + "attn.qkv.weight": (0, 3), at + "attn.qkv.bias": (0, 3), at + "attn.proj.weight": (1, 1),
                      at + "mlp.fc.weight": (0, 1), at + "mlp.fc.bias": (0, 1), at + "mlp.proj.weight": (1, 1)})
    return split


def gather_shards(value: torch.Tensor, dim: int, chunks: int, world: int, group=None) -> torch.Tensor:
    """The serial tensor from every rank's shard (collective over the tensor-parallel group)."""
    parts = [torch.empty_like(value) for _ in range(world)]
    dist.all_gather(parts, value.contiguous(), group=group)
    pieces = [part.chunk(chunks, dim=dim) for part in parts]
    return torch.cat([torch.cat([p[c] for p in pieces], dim=dim) for c in range(chunks)], dim=dim)
