"""The field groups of a RunSpec (`spec.model`, `spec.data`, `spec.world`, ...): one dataclass per group, each field
with its default and a docstring saying what it means and what it takes. What a value may be is checked in
`validate.py`; the whole spec, its round trip through dicts and files, and the presets are in `spec.py`."""
from __future__ import annotations

from dataclasses import dataclass


GPT_PRESETS = {
    "tiny": {"width": 64, "depth": 2, "heads": 4},        # 0.14 M parameters: seconds on a CPU
    "small": {"width": 256, "depth": 4, "heads": 4},      # 3.3 M
    "medium": {"width": 512, "depth": 8, "heads": 8},     # 25 M
    "100m": {"width": 768, "depth": 14, "heads": 12},     # 99.7 M (100.4 M at seq_len 1024): one GPU
}
"""model.preset -> the gpt's width, depth and heads (sizes counted with data.seq_len 64 unless said)."""


@dataclass
class ModelSpec:
    """The network to train."""

    name: str = "cnn"
    """cnn (2-D fields), mlp, transformer (patches of the 2-D field), or gpt (a decoder-only language model on
    bytes: causal self-attention, data.source pysrc)."""
    width: int = 32
    """Channels (cnn) or hidden units (mlp, transformer, gpt: the embedding width)."""
    depth: int = 2
    """Conv blocks (cnn), hidden layers (mlp), encoder layers (transformer) or decoder blocks (gpt)."""
    heads: int = 0
    """gpt: attention heads (must divide width); 0: 4 when 4 divides width, else 1."""
    preset: str = ""
    """gpt: a named size, tiny, small, medium or 100m (see GPT_PRESETS), whose width, depth and heads are used
    instead of the fields'; empty: use width, depth and heads."""
    activation_checkpointing: bool = False
    """transformer, gpt: keep only each encoder layer's (block's) input for backward and recompute the rest during
    backward (less activation memory, about one more forward of compute)."""
    compile: bool = False
    """gpt: torch.compile each decoder block in place (parameter names unchanged; the first steps pay for the
    compilation)."""

    def shape(self) -> tuple[int, int, int]:
        """(width, depth, heads) after the preset and the heads default are applied."""
        if self.preset:
            p = GPT_PRESETS[self.preset]
            return p["width"], p["depth"], p["heads"]
        return self.width, self.depth, self.heads or (4 if self.width % 4 == 0 else 1)


@dataclass
class DataSpec:
    """Where samples come from and how they are loaded."""

    source: str = "heat"
    """heat (seeded 2-D diffusion fields, classify the diffusivity), digits (scikit-learn's 8x8), path, or pysrc
    (bytes of the Python standard library's source files, next-byte prediction: model gpt; data/pysrc.py)."""
    path: str = ""
    """A .npz file with arrays x (N,C,H,W) and y (N,) when source is 'path'."""
    samples: int = 1024
    """Samples to generate (heat) or windows of text to train on (pysrc); digits has 1797 and path uses what the
    file has."""
    seq_len: int = 64
    """pysrc: bytes per sample (the gpt's context length); each position's target is the next byte."""
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
    server: str = ""
    """host:port of a storage server (scalelab.data.storage_server) that every rank reads the on-disk layout through,
    sharing its bandwidth and metadata budgets with every other job reading from it; the run's output_dir must lie
    beneath the server's root (formats on disk; empty: read the file system directly)."""


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
    schedule: str = "constant"
    """The rate after warm-up: constant, cosine (half a cosine down to min_lr_fraction x peak at the last step),
    poly (peak x (1 - progress)^poly_power, down to min_lr_fraction x peak), or module:function, a schedule of your
    own: function(step, total_steps, peak_lr, warmup_steps) -> lr for 0-based step (warm-up included), imported
    from the launching folder's module.py (a copy goes into the run's code/ folder)."""
    min_lr_fraction: float = 0.0
    """cosine, poly: the rate at the last step, as a fraction of the peak."""
    poly_power: float = 2.0
    """poly: the exponent of (1 - progress)."""
    comm_hook: str = "allreduce"
    """How DDP exchanges each gradient bucket: allreduce (fp32, as DDP does by default), fp16 or bf16 (cast, all-reduce,
    cast back: half the bytes), powersgd (torch's PowerSGD hook at rank comm_rank, error feedback on), or
    module:function, a DDP communication hook of your own: function(state, bucket) -> Future of the bucket's averaged
    gradient, with state.ratio, state.error_feedback, state.rank, state.world_size and state.memory (a dict kept
    between steps), imported from the launching folder's module.py (a copy goes into the run's code/ folder)."""
    comm_ratio: float = 0.01
    """A hook of your own: the share of each bucket's entries a sparsifying hook sends (state.ratio)."""
    comm_error_feedback: bool = True
    """A hook of your own: carry what was not sent to the next step (state.error_feedback)."""
    comm_rank: int = 1
    """powersgd: the rank of the low-rank approximation."""
    momentum: float = 0.9
    """Momentum (sgd, lars) or beta1 (adamw, lamb)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    fused: bool = False
    """adamw: torch's fused implementation (one kernel updates every parameter, instead of a few per parameter: the
    optimizer step of a large model on a GPU gets much shorter); off: torch's default (foreach on a GPU)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (no allreduce on all but the last)."""
    kfac_damping: float = 0.003
    """kfac: added to the Kronecker factors' eigenvalue products before inverting (larger: closer to SGD)."""
    kfac_factor_every: int = 1
    """kfac: steps between refreshes of the factors' running averages."""
    kfac_inv_every: int = 10
    """kfac: steps between eigendecompositions of the factors (the expensive part)."""
    kfac_factor: str = "dense"
    """kfac: how a layer's Kronecker factor is formed from its rows (inputs, output gradients): dense (rows^T rows
    / n), or module:function of your own, f(rows) -> the (d, d) factor, run on every rank (lab 09)."""
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
    """The node-local tier of mode multilevel (empty: /dev/shm/scalelab-ckpt-u<uid>/<hash of the run dir>). Made
    private (0700) when the run starts; a folder another account made first, or a link, is refused (ckpt/private.py)."""
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
    phase: str = "step"
    """Where kind slow's extra seconds land: step (before the step, outside the rank's own step_s), data (in its
    batch fetch: its data_s) or compute (before its forward: its compute_s). Other kinds ignore it."""
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
    offload: bool = False
    """ZeRO-Offload (FSDP2's CPUOffloadPolicy): each rank keeps its shard of the parameters, gradients and
    optimizer state in host memory, copies a unit's parameters to the device for its forward and backward, and
    the optimizer steps on the CPU. Device memory falls to about one unit's gathered parameters plus activations;
    each step pays the copies over PCIe. On a CPU run the copies are no-ops: the same code path, the same losses."""


@dataclass
class PipelineSpec:
    """How the pipeline runs its stages (strategy pp: one stage per rank; 3d: parallel.pp stages)."""

    schedule: str = "1f1b"
    """gpipe (every forward, then every backward), 1f1b (one forward, one backward once the pipe is full),
    module:function (a schedule of your own: function(stage, stages, micro) -> [("F" | "B", micro-batch), ...],
    from <module>.py beside the notebook, checked before the first step: complete, in order, no deadlock), or
    torch-gpipe / torch-1f1b (torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B on the same stages) or
    torch-interleaved (its ScheduleInterleaved1F1B: the model cut into 2 chunks per rank, rank r holding r and r + pp)."""
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
