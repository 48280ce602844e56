"""RunSpec: what to run, as one validated, serialisable value.

A lab cell, a widget, the CLI and a batch job all describe a run with a `RunSpec`; launchers turn it
into processes, and every worker reads the same spec back from `<output_dir>/spec.json`.

    spec = preset("tiny").replace(strategy="horovod", launcher="horovodrun")
    spec = spec.with_overrides(["optim.lr=0.05", "world.workers_per_node=2"])
    spec.validate()            # raises SpecError naming the field, the value and what is allowed

Every field is checked by `validate()`; `from_dict` rejects unknown keys with the list of known ones.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import SpecError
from .validate import (validate_spec, MODELS, DATA_SOURCES, STRATEGIES, BACKENDS, LAUNCHERS, OPTIMIZERS,
                       LR_SCALING, PRECISIONS, CHECKPOINT_MODES, DATA_FORMATS, DEVICES, FAULT_KINDS, MALLOC_POLICIES, WAITS,
                       SHARDINGS, SCHEDULES)  # noqa: F401 - re-exported



@dataclass
class ModelSpec:
    """The network to train."""

    name: str = "cnn"
    """cnn (2-D fields), mlp, or transformer (patches of the 2-D field)."""
    width: int = 32
    """Channels (cnn) or hidden units (mlp, transformer)."""
    depth: int = 2
    """Conv blocks (cnn), hidden layers (mlp) or encoder layers (transformer)."""
    activation_checkpointing: bool = False
    """transformer: keep only each encoder layer's input for backward and recompute the rest during backward
    (less activation memory, about one more forward of compute)."""


@dataclass
class DataSpec:
    """Where samples come from and how they are loaded."""

    source: str = "heat"
    """heat (seeded 2-D diffusion fields, classify the diffusivity), digits (scikit-learn's 8x8), or path."""
    path: str = ""
    """A .npz file with arrays x (N,C,H,W) and y (N,) when source is 'path'."""
    samples: int = 1024
    """Samples to generate (heat); digits has 1797 and path uses what the file has."""
    size: int = 16
    """Side of the square field in grid points (heat)."""
    classes: int = 4
    """Diffusivity classes to tell apart (heat)."""
    loader_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    prefetch_factor: int = 2
    """Batches each loader worker keeps ready (only with loader_workers > 0)."""
    pin_memory: bool = False
    """Page-locked host buffers for faster copies to a GPU."""
    format: str = "memory"
    """memory (arrays in RAM), or written once under output_dir/data and read back: files (one per sample),
    shards (packed, indexed) or hdf5."""
    samples_per_shard: int = 256
    """Samples per packed shard file (format shards)."""
    compress: bool = False
    """zlib-compress each sample inside the shards (format shards)."""
    open_latency_ms: float = 0.0
    """Simulated parallel-file-system latency per file open, in ms (formats on disk; 0: none)."""
    read_mb_per_s: float = 0.0
    """Simulated read bandwidth cap per rank in MB/s (formats on disk; 0: none)."""


@dataclass
class WorldSpec:
    """How many workers, on how many nodes."""

    workers_per_node: int = 1
    """Ranks per node (one per GPU on GPU nodes)."""
    nodes: int = 1
    """Nodes (only the slurm launcher spans several)."""
    threads_per_worker: int = 0
    """torch intra-op threads per rank; 0: the node's CPUs divided by workers_per_node."""
    malloc: str = "retain"
    """Host memory a rank frees: retain (kept in the process for the next step's tensors) or system (glibc's
    default: large blocks go back to the OS at each free and are faulted in again, page by page, next step)."""
    wait: str = "auto"
    """How a rank waits for its step's gradient allreduce on the host (DDP on gloo, Horovod on CPU): spin (stay
    on the core, yielding, as MPI does, for at most spin_ms, then block), block (sleep until woken) or auto (spin
    when this node has a core for every rank's threads). GPU collectives always block."""
    spin_ms: float = 1000.0
    """wait=spin (or auto resolved to spin): the longest a rank spins at its allreduce, in milliseconds, before it
    blocks. A long wait means the peer is off the cores (another run or user shares them) and spinning on keeps it
    off; a short bound (0.5) measured worse than both an unbounded spin and block in whole runs on a shared 2-core
    VM, so the default only caps a stall (1 s). 0 blocks at once."""
    max_restarts: int = 0
    """torchrun: how often the agent restarts the workers after one fails, each restart resuming from the newest
    checkpoint (elastic, c10d rendezvous; 0: a failure ends the run). horovodrun with strategy horovod: Horovod
    elastic (`hvd.elastic.run`): after a worker is lost the survivors roll back to the last commit, re-form and go
    on, at most this many times (--reset-limit; see min_workers, commit_every, rejoin_s)."""
    min_workers: int = 0
    """Horovod elastic: the fewest workers the run goes on with after losing some (--min-np; 0: one)."""
    commit_every: int = 1
    """Horovod elastic: commit the state (model, optimizer, step) to host memory every N steps; a lost worker
    rolls the survivors back to the last commit (larger N: less copying, more steps redone)."""
    rejoin_s: int = 0
    """Horovod elastic: seconds a host whose worker failed stays out before a worker may start there again and
    join from the committed state (--blacklist-cooldown-range); 0: never, the survivors finish the run."""


@dataclass
class OptimSpec:
    """Optimisation: batch, learning rate and its scaling, optimizer."""

    name: str = "sgd"
    """sgd, adamw, lars or lamb (LARS/LAMB from pytorch-optimizer), or kfac (SGD on K-FAC-preconditioned
    gradients, distributed KAISA-style: scalelab/train/kfac.py)."""
    batch_per_worker: int = 32
    """Samples per rank per step; the global batch is this times the world size."""
    lr: float = 0.05
    """Learning rate at base_batch; scaled to the global batch by lr_scaling."""
    lr_scaling: str = "none"
    """none, linear (lr x global/base) or sqrt (lr x sqrt(global/base))."""
    base_batch: int = 32
    """The global batch at which lr was tuned."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr/warmup_steps to the scaled lr."""
    momentum: float = 0.9
    """Momentum (sgd, lars) or beta1 (adamw, lamb)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (no allreduce on all but the last)."""
    kfac_damping: float = 0.003
    """kfac: added to the Kronecker factors' eigenvalue products before inverting (larger: closer to SGD)."""
    kfac_factor_every: int = 1
    """kfac: steps between refreshes of the factors' running averages."""
    kfac_inv_every: int = 10
    """kfac: steps between eigendecompositions of the factors (the expensive part)."""
    kfac_kl_clip: float = 0.001
    """kfac: scale the preconditioned step down so lr^2 * v.g stays under this (0: no clipping)."""
    kfac_grad_worker_fraction: float = 1.0
    """kfac: KAISA's fraction of ranks that precondition each layer: 1 COMM-OPT (every rank holds every
    layer's decomposition), 1/world MEM-OPT (one rank per layer, its result broadcast)."""


@dataclass
class CheckpointSpec:
    """When and how to write checkpoints."""

    every_steps: int = 0
    """Save every N steps (0: never)."""
    mode: str = "sync"
    """sync: rank 0 writes atomically (temp file, fsync, rename) while all wait; async: rank 0 snapshots to
    host memory and writes in the background; sharded: every rank writes its part (torch.distributed.checkpoint,
    asynchronously); multilevel: rank 0 writes to a node-local tier (local_dir) while all wait, copied to the
    shared checkpoints/ in the background; a restart reads the local tier when the node survived."""
    keep_last: int = 2
    """Newest checkpoints kept; older ones are deleted (unless kept as best)."""
    keep_best: int = 0
    """Also keep this many checkpoints with the lowest training loss."""
    resume: bool = True
    """Continue from the newest complete checkpoint in output_dir if there is one."""
    local_dir: str = ""
    """The node-local tier of mode multilevel (empty: /dev/shm/scalelab-ckpt-<hash of the run dir>)."""
    on_signal: bool = False
    """On SIGTERM or SIGUSR1 (preemption, a time limit near) the ranks agree at the next step, save an emergency
    checkpoint and exit cleanly (run status 'preempted'); a relaunch resumes from it exactly."""


@dataclass
class FaultSpec:
    """A fault to inject, for fault-tolerance lessons: what a failing rank does to the run."""

    kind: str = "none"
    """none, raise (an exception), exit (non-zero exit), kill (SIGKILL itself), hang (stop responding) or slow
    (a straggler: slow_s extra seconds every step from `step` on)."""
    rank: int = 0
    """Which rank misbehaves (global rank; -1: every rank of `node`, a whole node lost)."""
    step: int = 1
    """At which step (before its forward pass); fires in the first attempt only, not after a restart."""
    node: int = -1
    """Only on this node index (SLURM_NODEID / torchrun's GROUP_RANK; -1: wherever `rank` runs)."""
    slow_s: float = 0.5
    """Extra seconds per step for kind slow."""
    detect_timeout_s: float = 120.0
    """How long a rank waits in a collective for a silent peer before it gives up (the process-group timeout):
    a hung rank is detected after this."""
    recovery: str = "fail"
    """What survivors do when a rank is lost: fail (the run fails; restart it from a checkpoint) or forward (the
    survivors re-form the group and continue from their in-memory state, global batch kept: no rollback)."""


@dataclass
class FSDPSpec:
    """How strategy fsdp shards the model's state over the ranks (FSDP2 `fully_shard`; ZeRO stages)."""

    sharding: str = "full"
    """full (ZeRO-3: parameters, gradients and optimizer state split over the ranks), grad_op (ZeRO-2 in time:
    parameters stay gathered from forward to backward) or none (replicated: DDP's memory through FSDP)."""
    reshard_after_forward: bool = True
    """sharding=full: free each layer's gathered parameters after its forward and gather them again for backward
    (less memory, one more all-gather per layer); false keeps them until backward."""


@dataclass
class PipelineSpec:
    """How the pipeline runs its stages (strategy pp: one stage per rank; 3d: parallel.pp stages)."""

    schedule: str = "1f1b"
    """gpipe (every forward, then every backward) or 1f1b (one forward, one backward once the pipe is full)."""
    micro_batches: int = 4
    """Micro-batches each batch is cut into; the bubble is (stages - 1) / (micro_batches + stages - 1)."""


@dataclass
class ParallelSpec:
    """The device mesh of strategy 3d: world size = dp x pp x tp, ranks grouped as Megatron does (tp innermost,
    then pp, then dp: rank = (d * pp + p) * tp + t); dp = world size / (tp x pp) data-parallel replicas, each
    reading its own part of the global batch."""

    tp: int = 1
    """Tensor-parallel ranks per group: each layer split over them (mlp hidden pairs column/row, transformer
    attention heads and MLP), with all-reduces inside every layer (keep them inside a node)."""
    pp: int = 1
    """Pipeline stages: the model's layers cut into pp consecutive stages (send/recv between them, see pipeline)."""


@dataclass
class ProfileSpec:
    """torch.profiler traces per rank (and Horovod's timeline): where a step's time goes."""

    enabled: bool = False
    """Write <output_dir>/traces/rank-<r>.json (a Chrome trace: chrome://tracing, Perfetto) for the active steps;
    with strategy horovod also traces/horovod-timeline.json. NVTX ranges mark the phases on CUDA."""
    wait_steps: int = 1
    """Steps skipped before the profiler starts (the first step pays one-off setup costs)."""
    warmup_steps: int = 1
    """Steps profiled and thrown away (the profiler's own start-up overhead lands here)."""
    active_steps: int = 3
    """Steps recorded into the trace."""
    record_shapes: bool = False
    """Record each op's input shapes (bigger trace; shows each all-reduce's size)."""
    profile_memory: bool = False
    """Record tensor allocations and frees (a memory timeline; slower)."""
    with_stack: bool = False
    """Record the Python stack of each op (much bigger trace and slower: only to find who called an op)."""


@dataclass
class SlurmSpec:
    """Batch options used by the slurm launcher (students' values are bounded by the hub, not here)."""

    partition: str = ""
    """Partition (empty: the cluster's default)."""
    account: str = ""
    """Account to charge (empty: the user's default)."""
    reservation: str = ""
    """Reservation to run in (empty: none)."""
    time: str = "00:10:00"
    """Wall-clock limit, [D-]HH:MM[:SS] or minutes."""
    gpus_per_node: int = 0
    """GPUs per node requested with --gres=gpu:N."""
    cpus_per_task: int = 1
    """CPUs per rank."""
    mem: str = ""
    """Memory per node, e.g. 4G (empty: the partition's default)."""
    signal: str = ""
    """A warning before the time limit, SIG@SECONDS, e.g. USR1@60 (sbatch --signal=B:USR1@60); the batch script
    passes it to the ranks (empty: none)."""
    requeue: bool = False
    """Requeue the job after an emergency checkpoint (on_signal) so it resumes from it (sbatch --requeue)."""


@dataclass
class RunSpec:
    """One training run: model, data, strategy, world, launcher, optimisation and bookkeeping."""

    name: str = "run"
    """A short name for the run: letters, digits, '-', '_' or '.'."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The network."""
    data: DataSpec = field(default_factory=DataSpec)
    """The data and its loader."""
    strategy: str = "ddp"
    """ddp (torch DistributedDataParallel), horovod, fsdp (FSDP2: state sharded over the ranks, see fsdp) or pp
    (the mlp or transformer cut into one pipeline stage per rank, see pipeline) or tp (its layers split over the
    ranks: column/row, attention heads) or 3d (data x pipeline x tensor parallel on one mesh, see parallel)."""
    backend: str = "auto"
    """auto (nccl with CUDA, gloo without), gloo, nccl, or mpi (Horovod's MPI controller)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    world: WorldSpec = field(default_factory=WorldSpec)
    """Ranks and nodes."""
    launcher: str = "local"
    """local, torchrun, slurm, horovodrun or mpirun."""
    optim: OptimSpec = field(default_factory=OptimSpec)
    """Optimizer and learning-rate schedule."""
    precision: str = "fp32"
    """fp32, bf16 (autocast; CPU or GPU) or fp16 (autocast + grad scaling; GPU only)."""
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    """Checkpoint policy."""
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    """Batch options for the slurm launcher."""
    fault: FaultSpec = field(default_factory=FaultSpec)
    """An injected fault (off by default)."""
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    """Sharding of strategy fsdp (ignored by the others)."""
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    """Schedule and micro-batches of strategies pp and 3d (ignored by the others)."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """tp x pp of strategy 3d (ignored by the others; dp is what the world size leaves)."""
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    """Profiler traces per rank (off by default)."""
    steps: int = 20
    """Optimizer steps to run (ignored when epochs > 0)."""
    epochs: int = 0
    """Passes over the data; 0: run `steps` steps."""
    seed: int = 0
    """Seed for data generation, model init and shuffling (same on every rank)."""
    output_dir: str = ""
    """Where spec.json, events/, logs/ and checkpoints go; empty: runs/<name>-<time> under the cwd."""
    log_every: int = 1
    """Write a step event every N steps."""

    # -- construction -------------------------------------------------------------------------
    def replace(self, **changes) -> "RunSpec":
        """A copy with top-level fields changed (nested specs are copied, never shared)."""
        return dataclasses.replace(from_dict(self.to_dict()), **changes)

    def with_overrides(self, assignments: list[str] | dict[str, Any]) -> "RunSpec":
        """A copy with dotted `key=value` overrides applied (the CLI's --set), then validated."""
        data = self.to_dict()
        from_text = not isinstance(assignments, dict)
        items = (_split_assignment(a) for a in assignments) if from_text else assignments.items()
        for key, value in items:
            _assign(data, key, value, from_text)
        spec = from_dict(data)
        spec.validate()
        return spec

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML-ready)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def to_yaml(self) -> str:
        """YAML text."""
        import yaml
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        """Write as JSON (or YAML for .yaml/.yml) and return the path."""
        path = Path(path)
        text = self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json()
        path.write_text(text)
        return path

    # -- derived facts ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total ranks."""
        return self.world.workers_per_node * self.world.nodes

    @property
    def mesh(self) -> tuple[int, int, int]:
        """(dp, tp, pp): data-parallel replicas, tensor-parallel ranks per group, pipeline stages. tp and pp use
        the whole world (dp = 1); 3d reads `parallel` (dp = world size / (tp x pp), at least 1); others are dp."""
        w = self.world_size
        if self.strategy == "tp":
            return 1, w, 1
        if self.strategy == "pp":
            return 1, 1, w
        if self.strategy == "3d":
            return max(w // (self.parallel.tp * self.parallel.pp), 1), self.parallel.tp, self.parallel.pp
        return w, 1, 1

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: batch_per_worker x grad_accum x data-parallel replicas
        (the ranks of one replica's pipeline stages and tensor-parallel groups share its batch)."""
        return self.optim.batch_per_worker * self.optim.grad_accum * self.mesh[0]

    def validate(self) -> "RunSpec":
        """Check every field; raise SpecError naming the first bad one. Returns self."""
        validate_spec(self)
        return self


# -- dict / file round trip -----------------------------------------------------------------------
_NESTED = {"model": ModelSpec, "data": DataSpec, "world": WorldSpec, "optim": OptimSpec,
           "checkpoint": CheckpointSpec, "slurm": SlurmSpec, "fault": FaultSpec, "fsdp": FSDPSpec,
           "pipeline": PipelineSpec, "parallel": ParallelSpec, "profile": ProfileSpec}


def _build(cls, data: Any, prefix: str):
    if isinstance(data, cls):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise SpecError(prefix or "spec", f"expected a mapping of fields, got {type(data).__name__} {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise SpecError(where, f"unknown field; known fields{' of ' + prefix if prefix else ''}: {', '.join(known)}")
    kwargs = {}
    for name, value in data.items():
        sub = _NESTED.get(name) if cls is RunSpec else None
        kwargs[name] = _build(sub, value, name) if sub else value
    return cls(**kwargs)


def from_dict(data: dict) -> RunSpec:
    """Build a RunSpec from a nested dict; unknown keys are an error (types are checked by validate)."""
    return _build(RunSpec, data, "")


def load(path: str | Path) -> RunSpec:
    """Read a RunSpec from a JSON or YAML file and validate it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError("spec", f"cannot read {path}: {e.strerror}") from e
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml and json raise different types; both mean "not parseable"
        raise SpecError("spec", f"{path} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from e
    spec = from_dict(data)
    spec.validate()
    return spec


# -- --set key=value ------------------------------------------------------------------------------
def _split_assignment(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise SpecError(text, "expected key=value, e.g. optim.lr=0.1 or world.workers_per_node=2")
    key, raw = text.split("=", 1)
    return key.strip(), _parse_value(raw.strip())


def _parse_value(raw: str) -> Any:
    import yaml
    for number in (int, float):  # YAML 1.1 reads "1e-2" as a string
        try:
            return number(raw)
        except ValueError:
            pass
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _assign(data: dict, key: str, value: Any, from_text: bool) -> None:
    parts = key.split(".")
    target = data
    for i, part in enumerate(parts[:-1]):
        if not isinstance(target.get(part), dict):
            raise SpecError(key, f"{'.'.join(parts[: i + 1])!r} is not a group of fields; groups: {', '.join(_NESTED)}")
        target = target[part]
    last = parts[-1]
    if last not in target:
        where = ".".join(parts[:-1])
        raise SpecError(key, f"unknown field; known fields{' of ' + where if where else ''}: {', '.join(target)}")
    if isinstance(target[last], dict):
        raise SpecError(key, f"is a group; set one of its fields, e.g. {key}.{next(iter(target[last]))}=...")
    # --set name=123 means the string "123": text parsed as YAML is turned back into a string for str fields
    if from_text and isinstance(target[last], str) and not isinstance(value, str):
        value = str(value) if not isinstance(value, bool) else str(value).lower()
    target[last] = value


# -- presets --------------------------------------------------------------------------------------
def _tiny() -> RunSpec:
    return RunSpec(name="tiny", model=ModelSpec("cnn", width=8, depth=2),
                   data=DataSpec("heat", samples=512, size=16, classes=4),
                   optim=OptimSpec(batch_per_worker=16, lr=0.05), steps=20)


def _laptop() -> RunSpec:
    return RunSpec(name="laptop", model=ModelSpec("cnn", width=32, depth=3),
                   data=DataSpec("heat", samples=4096, size=32, classes=4),
                   optim=OptimSpec(batch_per_worker=32, lr=0.05), steps=200,
                   world=WorldSpec(workers_per_node=2))


def _gpu_node() -> RunSpec:
    return RunSpec(name="gpu-node", model=ModelSpec("cnn", width=64, depth=4),
                   data=DataSpec("heat", samples=65536, size=64, classes=8, loader_workers=4, pin_memory=True),
                   optim=OptimSpec(batch_per_worker=256, lr=0.1, lr_scaling="linear", base_batch=256, warmup_steps=50),
                   precision="bf16", device="cuda", steps=1000,
                   world=WorldSpec(workers_per_node=4), launcher="torchrun")


def _multi_node() -> RunSpec:
    spec = _gpu_node()
    return spec.replace(name="multi-node", world=WorldSpec(workers_per_node=4, nodes=2), launcher="slurm",
                        slurm=SlurmSpec(gpus_per_node=4, cpus_per_task=8, time="00:30:00"))


PRESETS = {"tiny": _tiny, "laptop": _laptop, "gpu-node": _gpu_node, "multi-node": _multi_node}
"""Named starting points: tiny (CI on CPU, seconds), laptop, gpu-node, multi-node."""


def preset(name: str = "tiny") -> RunSpec:
    """A fresh copy of a named preset."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise SpecError("preset", f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
