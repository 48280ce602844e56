"""Data-parallel strategies: torch DDP, Horovod and FSDP (sharded state) behind one small interface.

Both average gradients over ranks every step, so with the same seed they follow the same trajectory;
what differs is who moves the bytes (DDP's reducer with gloo/NCCL, Horovod's background thread with
Gloo/MPI/NCCL) and where communication time can be measured.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..dist import set_socket_interface, threads_per_rank
from ..machine import usable_cpus
from ..run.combinations import gloo_cannot_run
from .strategy import Strategy


def pick_device(spec, local_rank: int) -> torch.device:
    """cuda:<local rank> when asked for (or auto and available), else cpu."""
    want_cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            from ..errors import SpecError
            raise SpecError("device", "got 'cuda' but this node has no usable GPU; use device=auto or cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() and not torch.cuda.is_available():
        # the local cluster's stand-in GPUs (or a CPU build of torch): scheduled for real, computed on the CPU
        print(f"scalelab: this rank was given GPU(s) CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} but "
              "torch sees no CUDA device: computing on the CPU", file=sys.stderr, flush=True)
    return torch.device("cpu")


def pick_backend(spec, device: torch.device, local_size: int = 1) -> str:
    """The process group's backend for this rank. auto: NCCL when each of this node's `local_size` ranks has a
    GPU of its own, gloo on the CPU or when ranks share a GPU (NCCL refuses two ranks on one GPU: "Duplicate GPU
    detected"). An explicit choice that cannot work here is a SpecError naming what to change."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    shared = device.type == "cuda" and local_size > gpus
    from ..errors import SpecError
    if spec.backend == "nccl" and shared:
        raise SpecError("backend", f"got 'nccl' with {local_size} ranks on a node with {gpus} GPU(s); NCCL needs a "
                                   f"GPU per rank: set world.workers_per_node to at most {gpus}, or backend=gloo "
                                   "to let the ranks share a GPU")
    backend = spec.backend if spec.backend != "auto" else ("nccl" if device.type == "cuda" and not shared else "gloo")
    why = gloo_cannot_run(spec) if device.type == "cuda" and backend == "gloo" and spec.world_size > 1 else None
    if why:
        fix = (f"set world.workers_per_node to at most {gpus} (one GPU per rank, NCCL)" if shared
               else "use backend=nccl or auto")
        raise SpecError("backend" if spec.backend == "gloo" else "world.workers_per_node",
                        f"{why}: {fix}, or device=cpu")
    if shared and spec.backend == "auto":
        print(f"scalelab: {local_size} ranks share this node's {gpus} GPU(s): backend gloo (NCCL needs a GPU per "
              "rank)", file=sys.stderr, flush=True)
    return backend


def resolve_wait(spec, info, host_collectives: bool) -> str:
    """spin or block: how a rank waits for its step's gradient allreduce (see WorldSpec.wait); the
    collectives are host ones for DDP on gloo and for Horovod on CPU.

    A blocked rank's core goes idle; on a VM the idle vCPU is halted and handed back to the host, and the
    rank then pays to be woken and to warm its caches again, every step. Spinning avoids that, and costs
    nothing when every rank thread has a core of its own; when ranks share cores it would take CPU from the
    rank being waited for, so auto blocks then. Others' threads (another run, another user) can take the cores
    after this choice, so a spin is bounded by world.spin_ms (see spin_until). NCCL collectives finish on the
    GPU: no spinning there.
    """
    if not host_collectives:
        return "block"
    if spec.world.wait != "auto":
        return spec.world.wait
    return "spin" if info.local_size * threads_per_rank(spec, info.local_size) <= usable_cpus() else "block"


class DDPStrategy(Strategy):
    """torch.distributed + DistributedDataParallel; communication timed by a bucket comm hook."""

    name = "ddp"

    def __init__(self, spec, info, device):
        self.spec, self.info, self.device = spec, info, device
        self.backend = pick_backend(spec, device, info.local_size)
        self.comm_s = 0.0
        self.wait = "none"
        """How this rank waits for its last allreduce: spin, block, or none (1 rank: nothing to wait for)."""

    def setup(self) -> None:
        """Join the process group at MASTER_ADDR/MASTER_PORT: through the run's own store where the launcher gave
        the run a secret (scalelab.run.rendezvous: only the run's ranks can read or write it), else env:// (a
        worker started by hand, torchrun's workers, mpirun's)."""
        if self.info.world_size > 1 and not dist.is_initialized():
            from ..run.rendezvous import join_store
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            set_socket_interface()  # across nodes: the link towards MASTER_ADDR, found on this rank's own node
            timeout = timedelta(seconds=self.spec.fault.detect_timeout_s)
            store = join_store(self.info.rank, self.info.world_size, timeout)  # env:// gives its store this timeout too
            dist.init_process_group(self.backend, rank=self.info.rank, world_size=self.info.world_size,
                                    timeout=timeout, **({"store": store} if store is not None else {}))

    def wrap(self, model, optimizer):
        """DDP-wrap the model (broadcasts rank 0's parameters); the optimizer is unchanged."""
        if self.info.world_size == 1:
            return model, optimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.wait = resolve_wait(self.spec, self.info, host_collectives=self.backend == "gloo")
        model = DDP(model, device_ids=ids)
        if self.spec.optim.comm_hook == "allreduce":
            model.register_comm_hook(self, _timed_allreduce_hook)
        else:  # a cast, PowerSGD, or the student's own hook (train/comm_hooks.py)
            from .comm_hooks import build_hook
            model.register_comm_hook(*build_hook(self, self.spec.optim.comm_hook))
        return model, optimizer

    def full_state_dict(self, model) -> dict:
        """The whole model's parameters (every rank holds them all)."""
        return model.state_dict()

    def no_sync(self, model):
        """Skip the allreduce for an accumulation micro-batch."""
        return model.no_sync() if self.info.world_size > 1 else contextlib.nullcontext()

    def step(self, optimizer, scaler=None) -> None:
        """Apply the (already averaged) gradients."""
        _apply(optimizer, scaler)

    def take_comm_time(self) -> float:
        """Seconds spent in gradient allreduce since the last call (buckets overlap backward compute)."""
        t, self.comm_s = self.comm_s, 0.0
        return t

    def mean(self, value: float) -> float:
        """Average a scalar over ranks."""
        if self.info.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(t)
        return float(t.item()) / self.info.world_size

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.info.world_size > 1:
            dist.barrier()

    def shutdown(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _apply(optimizer, scaler) -> None:
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def spin_until(done, budget_s: float) -> bool:
    """Poll `done()` on the core, yielding between polls, for at most `budget_s` seconds; True once it held.

    The bound matters where threads outnumber cores: sched_yield only hands the core to threads of this process's
    own scheduling group (each rank leads its own session, hence its own autogroup), so an unbounded spin kept the
    core from the very peer it waited for. Measured on the shared 2-core VM (2 DDP ranks, the bench CNN, load
    1.6-2.3): alternating waits step by step within a run, a 0.5 ms bound sat between block and an unbounded spin
    (90.9 against 90.4 and 91.8 ms/step); whole runs, interleaved, put it below both (efficiency 0.86 against 0.92
    unbounded), so world.spin_ms defaults to 1 s: a cap on a stall, not a tuning."""
    deadline = time.perf_counter() + budget_s
    while not done():
        if time.perf_counter() >= deadline:
            return False
        os.sched_yield()
    return True


def _timed_allreduce_hook(state: DDPStrategy, bucket):
    # Same arithmetic as DDP's default hook (sum, then divide by world size); the callback runs when the
    # bucket's allreduce completes, so the measured time includes queueing behind earlier buckets.
    start = time.perf_counter()
    tensor = bucket.buffer().div_(state.info.world_size)
    work = dist.all_reduce(tensor, async_op=True)
    if state.wait == "spin" and bucket.is_last():
        # Backward is over: nothing is left to overlap, so wait here, on the core (see resolve_wait), for at most
        # world.spin_ms. The future below is then complete, and `done` runs at once (and raises what a failed
        # allreduce raised); past the bound, DDP blocks on the future as with wait=block.
        spin_until(work.is_completed, state.spec.world.spin_ms / 1000)
    fut = work.get_future()

    def done(f):
        state.comm_s += time.perf_counter() - start
        return f.value()[0]

    return fut.then(done)


class HorovodStrategy(Strategy):
    """Horovod's DistributedOptimizer; communication timed at `synchronize()` (the exposed wait)."""

    name = "horovod"

    def __init__(self, spec, info, device):
        import horovod.torch as hvd
        self.hvd, self.spec, self.info, self.device = hvd, spec, info, device
        self.backend = "horovod"
        self.comm_s = 0.0
        self.wait = "none"
        """spin (poll the handles here, yielding), block (synchronize(), which sleeps 1 ms between polls) or
        none (1 rank)."""

    def setup(self) -> None:
        """hvd.init(): Gloo under horovodrun --gloo, MPI under mpirun."""
        self.hvd.init()
        self.backend = "horovod-" + ("mpi" if self.hvd.mpi_enabled() else "gloo")

    def wrap(self, model, optimizer):
        """Broadcast rank 0's parameters and optimizer state; wrap the optimizer."""
        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             backward_passes_per_step=self.spec.optim.grad_accum, op=hvd.Average)
        if self.info.world_size > 1:
            self.wait = resolve_wait(self.spec, self.info, host_collectives=self.device.type == "cpu")
        return model, optimizer

    def full_state_dict(self, model) -> dict:
        """The whole model's parameters (every rank holds them all)."""
        return model.state_dict()

    def no_sync(self, model):
        """Horovod counts backward passes itself (backward_passes_per_step)."""
        return contextlib.nullcontext()

    def step(self, optimizer, scaler=None) -> None:
        """Wait for the allreduces (timed), then apply the averaged gradients."""
        start = time.perf_counter()
        if self.wait == "spin":
            self._spin_until_reduced(optimizer)
        optimizer.synchronize()
        self.comm_s += time.perf_counter() - start
        if scaler:
            scaler.unscale_(optimizer)  # after synchronize: unscale the averaged gradients
        with optimizer.skip_synchronize():
            _apply(optimizer, scaler)

    def _spin_until_reduced(self, optimizer) -> None:
        """Wait on the core, for at most world.spin_ms in all, for the allreduces backward started;
        synchronize() then finds them done (past the bound, it waits for the rest as with wait=block).

        The handles are the DistributedOptimizer's own (`_handles`, Horovod 0.28); a tensor whose hook has
        not fired yet has none, and synchronize() starts and waits for it as usual.
        """
        deadline = time.perf_counter() + self.spec.world.spin_ms / 1000
        for handle, _ in list(getattr(optimizer, "_handles", {}).values()):
            if handle is None or callable(handle):
                continue
            if not spin_until(lambda: self.hvd.poll(handle), max(deadline - time.perf_counter(), 0.0)):
                return

    def take_comm_time(self) -> float:
        """Seconds this rank waited for gradient allreduces since the last call."""
        t, self.comm_s = self.comm_s, 0.0
        return t

    def mean(self, value: float) -> float:
        """Average a scalar over ranks."""
        return float(self.hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=self.hvd.Average).item())

    def barrier(self) -> None:
        """Wait for every rank."""
        self.hvd.allreduce(torch.zeros(1), name="scalelab.barrier")

    def shutdown(self) -> None:
        """Shut Horovod down."""
        self.hvd.shutdown()


# Fully sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`): ZeRO on one mesh axis.
#
# Every rank still sees its own slice of each batch, as with DDP; what changes is who holds the model's state.
#
#     sharding=full     ZeRO-3: parameters, gradients and optimizer state are split 1/W per rank; each layer's
#                       parameters are all-gathered just before its forward and backward, its gradients
#                       reduce-scattered after backward. reshard_after_forward=false keeps the gathered
#                       parameters from forward to backward (one all-gather less per layer, more memory).
#     sharding=grad_op  ZeRO-2 in time: like full, but never resharded between forward and backward.
#     sharding=none     replicated (HSDP with shards of one rank): every rank holds everything and gradients
#                       are all-reduced, i.e. DDP's memory and traffic through FSDP's code path.
#     offload=true      ZeRO-Offload on top of any of them: the shards live in host memory, each unit's
#                       parameters are copied to the device when gathered, and the optimizer steps on the CPU.
#
# Each `nn.Linear`, conv and transformer layer is its own FSDP unit (so only one unit's parameters are gathered at
# a time), then the root. With the same seed, global batch and optimizer the loss follows DDP's to float
# precision: both average the same gradients over ranks.


def _units(model: nn.Module) -> list[nn.Module]:
    """The submodules that become their own FSDP unit: layers that own parameters, innermost first; for the gpt its
    decoder blocks and its head (one all-gather per block, as torchtitan shards a transformer)."""
    if hasattr(model, "blocks"):
        return [*model.blocks, model.head]
    kinds = (nn.Linear, nn.Conv2d, nn.TransformerEncoderLayer)
    return [m for m in model.modules() if isinstance(m, kinds) and m is not model]


class FSDPStrategy(DDPStrategy):
    """FSDP2 over a 1-D mesh of all ranks (or a (W, 1) mesh for sharding=none); the process group is DDP's."""

    name = "fsdp"
    shards_state = True

    def wrap(self, model, optimizer):
        """Shard the model in place; the optimizer then steps the sharded parameters (DTensors)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        if self.info.world_size == 1 and not torch.distributed.is_initialized():
            return model, optimizer  # one rank: nothing to shard, and no process group to build a mesh on
        device = self.device.type
        sharding, w = self.spec.fsdp.sharding, self.info.world_size
        if sharding == "none":
            mesh = init_device_mesh(device, (w, 1), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device, (w,))
        reshard = self.spec.fsdp.reshard_after_forward and sharding == "full"
        kw = {"mesh": mesh, "reshard_after_forward": reshard}
        if self.spec.fsdp.offload:  # ZeRO-Offload: shards live in (pinned, on a GPU) host memory, the step on the CPU
            from torch.distributed.fsdp import CPUOffloadPolicy
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
        names = {id(p): n for n, p in model.named_parameters()}
        for unit in _units(model):
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        # fully_shard swapped every parameter for a DTensor: point the (still stateless) optimizer at the new ones
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model, optimizer

    def no_sync(self, model):
        """Accumulation micro-batches keep their gradients unreduced until the last one."""
        @contextlib.contextmanager
        def unsynced():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return unsynced() if hasattr(model, "set_requires_gradient_sync") else contextlib.nullcontext()

    def full_state_dict(self, model) -> dict:
        """The whole model's parameters as plain CPU tensors (collective: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        if not hasattr(model, "set_requires_gradient_sync"):
            return model.state_dict()
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def build_strategy(spec, info, device):
    """The strategy the spec names."""
    if spec.strategy in ("tp", "pp", "3d"):  # a dp x pp x tp mesh (train/mesh.py), over DDP's process group
        from .mesh import MeshStrategy
        mesh = MeshStrategy(spec, info, device, base=DDPStrategy(spec, info, device))
        if mesh.pipelined:  # a `pipeline` event per step: schedule, activation bytes, bubble (train/pipeline.py)
            from .pipeline import record_pipeline
            record_pipeline(mesh, spec, info)
        return mesh
    return {"ddp": DDPStrategy, "horovod": HorovodStrategy, "fsdp": FSDPStrategy}[spec.strategy](spec, info, device)
