"""3D parallelism in the engine: data x pipeline x tensor parallel ranks on one device mesh.

    world = dp x pp x tp        rank = (d * pp + p) * tp + t        (Megatron's order: tp innermost, then pp, dp)

so a tensor-parallel group's ranks are neighbours (one node: their all-reduces run inside every layer), the
stages of a pipeline come next, and the data-parallel replicas are outermost (one all-reduce per step, across
nodes). Every rank is in three groups:

    tp group {(d, p, *)}  split each layer of stage p of replica d (tensor_parallel.split_model): the mlp's hidden
                          pairs column/row; a transformer block's attention by heads, its MLP column/row.
    pp group {(d, *, t)}  replica d's pipeline: activations forward, gradients back, micro-batch by micro-batch,
                          by a GPipe or 1F1B schedule (pipeline.PipelineStage); stage p keeps units cut_p..cut_p+1.
                          Under torch's interleaved schedule the units are cut into pp x 2 chunks and stage p
                          keeps chunks p and p + pp (pipeline.hold_chunks), each a module of its own.
    dp group {(*, p, t)}  the ranks holding the same shard: after backward they average its gradients (one flat
                          all-reduce per step, as DDP's single bucket does for whole replicas).

Each replica reads its own part of the global batch (batch_per_worker x grad_accum x dp). Every rank builds the
same full model from the seed before keeping its part, so every layout follows DDP's losses to float precision.

Strategies tp and pp are the 1-D meshes (the whole world one tp group / one pipeline, dp = 1); 3d reads tp and pp
from the spec's `parallel`. Checkpoints: every rank writes its own part (RankCheckpointer); a resume needs the
same layout.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ckpt.manifest import read_manifest
from ..ckpt.sync import SyncCheckpointer
from .partitioned import PartitionedModelStrategy
from .pipeline import PipelineStage, balanced_cuts, chunks_per_rank, hold_chunks
from .tensor_parallel import gather_shards, split_model


def mesh_groups(dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The global ranks of every tp, pp and dp group of a dp x pp x tp mesh."""
    def rank(d, p, t):
        return (d * pp + p) * tp + t
    return {"tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}


def coordinates(rank: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(d, p, t): the replica, stage and tensor-parallel rank of a global rank."""
    return rank // (tp * pp), (rank // tp) % pp, rank % tp


class MeshStrategy(PartitionedModelStrategy):
    """Strategies tp, pp and 3d: this rank's shard of its stage of the model, gradients averaged over dp."""

    wait = "none"
    shards_state = True  # each rank holds its stage's shard: a resume restores into the wrapped model

    def __init__(self, spec, info, device, base):
        self.spec, self.info, self.device, self.base = spec, info, device, base
        self.name, self.backend = spec.strategy, base.backend
        self.dp, self.tp, self.pp = spec.mesh
        self.d, self.p, self.t = coordinates(info.rank, self.tp, self.pp)
        self.groups: dict = {}  # "tp" / "pp" / "dp" -> this rank's group (absent: a group of one rank)
        self.split: dict[str, tuple[int, int]] = {}  # tensor-parallel parameter -> (dim, chunks)
        self.stage: PipelineStage | None = None
        self.boundary: tuple = ()  # the shape of one sample's activation this stage receives
        self.boundaries: dict[int, tuple] = {}  # interleaved: per virtual stage, the same
        self.comm_s = 0.0

    @property
    def pipelined(self) -> bool:
        """True when the pipeline schedule runs each batch's forwards and backwards (pp > 1)."""
        return self.pp > 1

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(replica, replicas): which part of each global batch this rank's replica reads."""
        return self.d, self.dp

    def setup(self) -> None:
        """Join the process group, then build every tp, pp and dp group (each rank builds all, in one order)."""
        self.base.setup()
        for kind, groups in mesh_groups(self.dp, self.tp, self.pp).items():
            for ranks in groups:
                if len(ranks) > 1:
                    group = dist.new_group(ranks)
                    if self.info.rank in ranks:
                        self.groups[kind] = group

    def wrap(self, model, optimizer):
        """Keep this rank's shard of its stage: split layers over tp, cut units over pp; the (still stateless)
        optimizer then steps only the kept parameters, found by their unchanged names."""
        names = {id(p): n for n, p in model.named_parameters()}
        chunks = chunks_per_rank(self.spec.pipeline.schedule) if self.pp > 1 else 1
        # serial sizes: the same cuts everywhere
        cuts = balanced_cuts(model.unit_sizes(), self.pp * chunks) if self.pp > 1 else None
        if self.tp > 1:
            self.split = split_model(model, self.t, self.tp, self.groups["tp"])
        if cuts is not None:
            mine = list(range(self.p, self.pp * chunks, self.pp))  # this rank's virtual stages: p, p + pp, ...
            for v in mine:
                if cuts[v] > 0:  # one sample through the stages before: the activation's shape (tp inside)
                    x0 = torch.zeros(1, *model.sample_shape, device=self.device)
                    with torch.no_grad():
                        self.boundaries[v] = tuple(model.forward_units(x0, 0, cuts[v]).shape[1:])
            self.boundary = self.boundaries.get(self.p, ())
            if chunks == 1:
                model.keep_units(cuts[self.p], cuts[self.p + 1])
                self.stage = PipelineStage(model, self.p, self.pp, self.groups["pp"])
            else:
                parts = hold_chunks(model, [(cuts[v], cuts[v + 1]) for v in mine])
                self.stage = PipelineStage(model, self.p, self.pp, self.groups["pp"], chunks=list(zip(parts, mine)))
        kept = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [kept[names[id(p)]] for p in group["params"] if names[id(p)] in kept]
        return model, optimizer

    def forward_backward(self, model, x, y, accum: int) -> torch.Tensor:
        """One batch's forwards and backwards through the pipeline; the batch's loss on every stage."""
        m = self.spec.pipeline.micro_batches
        xs, ys = list(x.chunk(m)), list(y.chunk(m))
        r = self.stage.step(self.spec.pipeline.schedule, xs, ys, lambda i: (len(ys[i]), *self.boundary),
                            lambda out, target: F.cross_entropy(out.float(), target) / accum)
        return self._from_last(r["loss"] if self.stage.is_last else 0.0)

    def step(self, optimizer, scaler=None) -> None:
        """Average this shard's gradients over its dp group (one flat all-reduce), then apply them."""
        group = self.groups.get("dp")
        if group is not None:
            start = time.perf_counter()
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= self.dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            self.comm_s += time.perf_counter() - start
        optimizer.step()

    def take_comm_time(self) -> float:
        """Seconds in the dp gradient all-reduce since the last call (tp and pp traffic runs inside the step)."""
        t, self.comm_s = self.comm_s, 0.0
        return t

    @torch.no_grad()
    def evaluate(self, model, x, y, autocast=None) -> float:
        """Accuracy on this replica's part of (x, y) through its stages, averaged over the replicas."""
        x, y = x[self.d::self.dp], y[self.d::self.dp]
        model.eval()
        stage, group = self.stage, self.groups.get("pp")
        if stage is not None and stage.chunks:
            correct = self._evaluate_chunks(x, y)
            model.train()
            return self.base.mean(float(self._from_last(correct)))
        if stage is not None and stage.prev is not None:
            x = torch.empty(len(x), *self.boundary, device=self.device)
            dist.recv(x, src=stage.prev, group=group)
        out = model(x)
        model.train()
        if stage is not None and not stage.is_last:
            dist.send(out.contiguous(), dst=stage.next, group=group)
            correct = 0.0
        else:
            correct = float((out.argmax(dim=1) == y).float().mean()) if len(y) else 0.0
        return self.base.mean(float(self._from_last(correct)))

    def _evaluate_chunks(self, x, y) -> float:
        """Interleaved: the evaluation batch goes round the ranks chunk by chunk (virtual stage v on rank v mod
        pp); the accuracy on the rank of the last chunk, 0 elsewhere."""
        stage, group = self.stage, self.groups["pp"]
        ranks = dist.get_process_group_ranks(group)
        last = self.pp * len(stage.chunks) - 1
        out = x
        for module, v in stage.chunks:
            if v > 0:
                out = torch.empty(len(x), *self.boundaries[v], device=self.device)
                dist.recv(out, src=ranks[(v - 1) % self.pp], group=group)
            out = module(out)
            if v < last:
                dist.send(out.contiguous(), dst=ranks[(v + 1) % self.pp], group=group)
        return float((out.argmax(dim=1) == y).float().mean()) if stage.is_last and len(y) else 0.0

    def _from_last(self, value: float) -> torch.Tensor:
        """The last stage's value on every stage of this pipeline."""
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")
        group = self.groups.get("pp")
        if group is not None:
            dist.broadcast(t, src=dist.get_process_group_ranks(group)[-1], group=group)
        return t.float()

    def full_state_dict(self, model) -> dict:
        """The serial model's parameters: tp shards gathered, stages united (collective: every rank calls it)."""
        local = {}
        for name, value in model.state_dict().items():
            if name in self.split:
                value = gather_shards(value, *self.split[name], world=self.tp, group=self.groups["tp"])
            local[name] = value.detach().cpu()
        if self.info.world_size == 1:
            return local
        parts = [None] * self.info.world_size
        dist.all_gather_object(parts, local if self.d == 0 and self.t == 0 else {})  # one copy of each stage
        return {k: v for part in parts for k, v in part.items()}

    def checkpointer(self, ckpt, directory) -> "RankCheckpointer":
        """Per-rank checkpoints of this mesh (checkpoint.mode sharded)."""
        return RankCheckpointer(directory, self.info.rank, keep_last=ckpt.keep_last, keep_best=ckpt.keep_best,
                                device=self.device if self.backend == "nccl" else "cpu")


class RankCheckpointer(SyncCheckpointer):
    """Every rank writes its own part (model shard, optimizer state, step) atomically into checkpoints/rank-<r>/
    with its own manifest, by ckpt/sync.py's machinery; ranks do not share a file, so no rank waits for another
    to write. A resume loads the newest step that every rank has (a collective): a save cut short on one rank
    is never mixed with a newer one elsewhere. Resume at the same layout (tp, pp, dp) only."""

    mode = "sharded"

    def __init__(self, directory, rank: int, keep_last: int = 2, keep_best: int = 0, device="cpu"):
        super().__init__(Path(directory) / f"rank-{rank:05d}", keep_last, keep_best, writer=True)
        self.device = device  # where the agreement's all-reduce runs (NCCL: the rank's GPU)

    def latest(self) -> Path | None:
        """This rank's file of the newest step every rank saved, or None (collective: every rank calls it)."""
        entries = {e["step"]: e for e in read_manifest(self.directory)}
        newest = torch.tensor(max(entries, default=-1), dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        have = torch.tensor(int(int(newest) in entries), dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(have, op=dist.ReduceOp.MIN)  # all restore, or none (keep_last=1 may have dropped it)
        return self.directory / entries[int(newest)]["file"] if have else None


__all__ = ["MeshStrategy", "RankCheckpointer", "coordinates", "mesh_groups"]
