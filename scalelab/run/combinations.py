"""The rules that tie one feature's RunSpec fields together, called by run/validate.py's cross checks after every
field passed its own rule: strategies (fsdp; tp, pp and 3d meshes), K-FAC, faults and resilience (Horovod elastic
among them), profiling, and which strategies gloo cannot run on GPUs. Each error names the field to change."""
from __future__ import annotations

from ..errors import SpecError


def gloo_cannot_run(spec) -> str | None:
    """Why `spec`'s strategy cannot run on GPUs with gloo, or None when it can.

    Gloo all-reduces and broadcasts CUDA tensors (DDP, FSDP without sharding, tensor parallelism), but it sends
    a tensor's GPU address as if it were host memory: point-to-point (pipeline stages) fails with "writev: Bad
    address", and FSDP's reduce-scatter killed its rank without a word (both on an H100, torch 2.11).
    """
    if spec.strategy in ("pp", "3d"):
        return f"strategy '{spec.strategy}' sends activations between pipeline stages, which gloo cannot do for GPU tensors"
    if spec.strategy == "fsdp" and spec.fsdp.sharding != "none":
        return (f"strategy 'fsdp' with fsdp.sharding={spec.fsdp.sharding} reduce-scatters gradients, which gloo "
                "cannot do for GPU tensors")
    return None


def kfac_checks(spec) -> None:
    """K-FAC preconditions whole layers, after data-parallel averaging: ddp (or one rank) only; KAISA's
    gradient workers per layer must divide the ranks."""
    if spec.optim.name != "kfac":
        return
    if spec.strategy != "ddp":
        raise SpecError("optim.name", f"got 'kfac' with strategy {spec.strategy!r}; K-FAC needs each rank to hold "
                                      "whole layers with averaged gradients: use strategy=ddp")
    w, f = spec.world_size, spec.optim.kfac_grad_worker_fraction
    workers = max(1, min(w, round(f * w)))
    if f <= 0 or w % workers:
        raise SpecError("optim.kfac_grad_worker_fraction",
                        f"got {f:g}: {workers} gradient workers per layer do not divide the {w} ranks; pick k/{w} "
                        f"with k dividing {w} (1/{w}: MEM-OPT, 1: COMM-OPT)")


def resilience_checks(spec) -> None:
    """Faults, preemption and recovery fields that only make sense together."""
    f = spec.fault
    if f.kind != "none" and f.rank == -1 and f.node == -1:
        raise SpecError("fault.rank", "got -1 (every rank of a node) but fault.node is -1; name the node to lose "
                                      "with fault.node, or pick one rank")
    if f.node >= spec.world.nodes:
        raise SpecError("fault.node", f"got {f.node}, but the run has {spec.world.nodes} node(s) (0.."
                                      f"{spec.world.nodes - 1}); use -1 for any node")
    if f.recovery == "forward" and (spec.strategy != "ddp" or spec.launcher != "local"):
        raise SpecError("fault.recovery", f"got 'forward' with strategy {spec.strategy!r} and launcher "
                                          f"{spec.launcher!r}; forward recovery re-forms a torch.distributed group "
                                          "of ranks on this machine: use strategy=ddp, launcher=local")
    if spec.world.max_restarts and spec.launcher != "torchrun" and not horovod_elastic(spec):
        raise SpecError("world.max_restarts", f"got {spec.world.max_restarts} with launcher {spec.launcher!r} and "
                                              f"strategy {spec.strategy!r}; only torchrun and Horovod elastic "
                                              "(strategy=horovod, launcher=horovodrun) outlive a lost worker: set one "
                                              "of them, or max_restarts=0")
    horovod_elastic_checks(spec)
    if spec.checkpoint.local_dir and spec.checkpoint.mode != "multilevel":
        raise SpecError("checkpoint.local_dir", f"is only used by checkpoint.mode=multilevel, not "
                                                f"{spec.checkpoint.mode!r}: set the mode or leave local_dir empty")
    if spec.checkpoint.mode == "multilevel" and spec.strategy not in ("ddp", "horovod"):
        raise SpecError("checkpoint.mode", f"got 'multilevel' with strategy {spec.strategy!r}; it saves rank 0's "
                                           "whole model (ddp, horovod): use mode=sharded for sharded models")
    if (spec.slurm.signal or spec.slurm.requeue) and not spec.checkpoint.on_signal:
        raise SpecError("slurm.signal" if spec.slurm.signal else "slurm.requeue",
                        "needs checkpoint.on_signal=true: without an emergency checkpoint a signalled or requeued "
                        "job loses the work since its last checkpoint")


def horovod_elastic(spec) -> bool:
    """Whether `spec` asks for Horovod elastic: strategy horovod under horovodrun with world.max_restarts > 0."""
    return spec.strategy == "horovod" and spec.launcher == "horovodrun" and spec.world.max_restarts > 0


def horovod_elastic_checks(spec) -> None:
    """Horovod elastic (train/hvd_elastic.py): its fields only with it; a state that lives in memory."""
    w = spec.world
    if not horovod_elastic(spec):
        for name, default in (("min_workers", 0), ("commit_every", 1), ("rejoin_s", 0)):
            if getattr(w, name) != default:
                raise SpecError(f"world.{name}", f"got {getattr(w, name)}, but it is only used by Horovod elastic: "
                                                 "set strategy=horovod, launcher=horovodrun and world.max_restarts > 0, "
                                                 f"or leave world.{name}={default}")
        return
    if w.min_workers > spec.world_size:
        raise SpecError("world.min_workers", f"got {w.min_workers}, more than the {spec.world_size} workers the run "
                                             f"starts with: lower it (0: go on with one) or raise world.workers_per_node")
    if spec.fault.kind == "hang":
        raise SpecError("fault.kind", "got 'hang' with Horovod elastic: its driver only notices a worker that exits, "
                                      "so a hung one stalls the re-formed group until --elastic-timeout; use kind "
                                      "kill, exit or raise (or strategy=ddp with fault.recovery=forward, which fences "
                                      "a hung rank)")
    if spec.checkpoint.every_steps or spec.checkpoint.on_signal:
        raise SpecError("checkpoint.every_steps" if spec.checkpoint.every_steps else "checkpoint.on_signal",
                        "is not used with Horovod elastic: its state is committed in host memory every "
                        "world.commit_every steps instead; set checkpoint.every_steps=0 and checkpoint.on_signal=false")
    if spec.data.format != "memory" or spec.optim.grad_accum != 1 or spec.precision == "fp16":
        field = ("data.format" if spec.data.format != "memory" else
                 "optim.grad_accum" if spec.optim.grad_accum != 1 else "precision")
        raise SpecError(field, "Horovod elastic trains on in-memory data, one micro-batch per step, in fp32 or bf16: "
                               "set data.format=memory, optim.grad_accum=1 and precision fp32 or bf16")


def _ranks_hold_parts(spec, runs: str, part: str) -> None:
    """A strategy whose ranks each hold a part (fsdp, the meshes): torch.distributed ranks, sharded checkpoints."""
    if spec.launcher == "horovodrun":
        raise SpecError("launcher", f"got 'horovodrun' with strategy {spec.strategy!r}; {runs} on torch.distributed "
                                    "ranks: use local, torchrun, mpirun or slurm")
    if spec.checkpoint.every_steps and spec.checkpoint.mode != "sharded":
        raise SpecError("checkpoint.mode", f"got {spec.checkpoint.mode!r} with strategy {spec.strategy!r}; each "
                                           f"rank holds only its {part}, so every rank must write: use "
                                           "checkpoint.mode=sharded")


def fsdp_checks(spec) -> None:
    """Strategy fsdp: torch.distributed ranks, and checkpoints that every rank writes its own shard of."""
    if spec.strategy != "fsdp":
        return
    _ranks_hold_parts(spec, "FSDP runs", "shard of the state")


PIPELINE_CHUNKS = {"torch-interleaved": 2}
"""The model chunks (virtual stages) each rank holds under a pipeline.schedule (train/pipeline.py); 1 if not here."""


def mesh_checks(spec) -> None:
    """Strategies tp, pp and 3d: a dp x pp x tp mesh that the world size fills, a model it can cut, whole
    micro-batches, torch.distributed ranks, and checkpoints that every rank writes its own part of."""
    if spec.strategy not in ("tp", "pp", "3d"):
        return
    dp, tp, pp = spec.mesh
    name, depth, width = spec.model.name, spec.model.depth, spec.model.width
    if name == "gpt":  # a preset sets the shape
        width, depth, _ = spec.model.shape()
    if spec.strategy == "3d" and spec.world_size % (tp * pp):
        raise SpecError("parallel.tp", f"parallel.tp x parallel.pp = {tp} x {pp} = {tp * pp} does not divide the "
                                       f"world of {spec.world_size} ranks (world.nodes x world.workers_per_node), so "
                                       "dp = world / (tp x pp) is not whole: choose tp and pp whose product divides "
                                       f"{spec.world_size}, or a world that is a multiple of {tp * pp}")
    if name not in ("mlp", "transformer", "gpt"):
        raise SpecError("model.name", f"got {name!r} with strategy {spec.strategy!r}; tensor and pipeline "
                                      "parallelism cut the mlp's, the transformer's or the gpt's layers: set "
                                      "model.name=mlp or model.name=transformer (or gpt)")
    if spec.strategy in ("tp", "pp") and spec.world_size < 2:
        raise SpecError("world.workers_per_node", f"got {spec.world_size} ranks for strategy {spec.strategy!r}; "
                                                  f"it needs 2 to {depth + 1} ranks (raise model.depth for more)")
    most = depth + 1 if name == "mlp" else depth + 2  # transformer, gpt: its blocks, the embedding and the head
    if pp > most:
        raise SpecError("parallel.pp" if spec.strategy == "3d" else "world.workers_per_node",
                        f"got {pp} pipeline stages; a {name} of depth {depth} is cut into at most {most} stages "
                        "(raise model.depth for more)")
    chunks = PIPELINE_CHUNKS.get(spec.pipeline.schedule, 1)
    if pp > 1 and chunks > 1:
        schedule, micro = spec.pipeline.schedule, spec.pipeline.micro_batches
        if pp * chunks > most:
            raise SpecError("pipeline.schedule", f"got {schedule!r}, which cuts the model into {pp} x {chunks} = "
                                                 f"{pp * chunks} chunks, one per virtual stage; a {name} of depth "
                                                 f"{depth} is cut into at most {most}: raise model.depth, use fewer "
                                                 "pipeline stages, or a schedule of one stage per rank")
        if tp > 1:
            raise SpecError("pipeline.schedule", f"got {schedule!r} with parallel.tp = {tp}; its chunks are cut "
                                                 "from the whole model: use parallel.tp = 1 with it")
        if micro % max(1, micro // pp):
            raise SpecError("pipeline.micro_batches", f"got {micro}; {schedule} runs them in max(1, micro_batches "
                                                      f"// {pp} stages) = {micro // pp} rounds of equal size: use a "
                                                      f"multiple of {max(1, micro // pp)}")
    if tp > 1 and name == "mlp" and (depth < 2 or width % tp):
        raise SpecError("model.width" if depth >= 2 else "model.depth",
                        f"tensor parallelism splits pairs of the mlp's hidden layers over {tp} ranks: it needs "
                        f"model.depth >= 2 (got {depth}) and a model.width that {tp} divides (got {width})")
    heads = spec.model.shape()[2] if name == "gpt" else 4 if width % 4 == 0 else 1
    if tp > 1 and name == "gpt" and heads % tp:
        raise SpecError("model.heads", f"the gpt has {heads} attention heads, which {tp} tensor-parallel ranks do "
                                       "not divide: choose heads (or a preset) that tp divides")
    if tp > 1 and name == "transformer" and heads % tp:
        raise SpecError("model.width", f"got {width}: the transformer has {heads} attention heads, which {tp} "
                                       "tensor-parallel ranks do not divide: use a width that 4 divides and tp 2 or 4")
    if pp > 1 and spec.optim.batch_per_worker % spec.pipeline.micro_batches:
        raise SpecError("pipeline.micro_batches", f"got {spec.pipeline.micro_batches}, which does not divide "
                                                  f"optim.batch_per_worker={spec.optim.batch_per_worker} into equal "
                                                  "micro-batches")
    _ranks_hold_parts(spec, "its mesh runs", "part of the model")


def profile_checks(spec) -> None:
    """Profiling: the schedule must fit in the run, or the trace would never be written."""
    p = spec.profile
    if p.enabled and spec.epochs == 0 and p.wait_steps + p.warmup_steps + p.active_steps > spec.steps:
        raise SpecError("profile.active_steps", f"wait_steps + warmup_steps + active_steps = {p.wait_steps} + "
                                                f"{p.warmup_steps} + {p.active_steps} is more than steps="
                                                f"{spec.steps}: the trace would never be written; lower them or "
                                                "raise steps")
    if p.enabled and horovod_elastic(spec):
        raise SpecError("profile.enabled", "Horovod elastic (world.max_restarts > 0) runs its own loop, which is not "
                                           "profiled: profile a run with world.max_restarts=0, or set "
                                           "profile.enabled=false")


__all__ = ["gloo_cannot_run", "horovod_elastic", "kfac_checks", "resilience_checks", "horovod_elastic_checks",
           "fsdp_checks", "mesh_checks", "profile_checks"]
