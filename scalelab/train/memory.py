"""What a rank holds and what it sends: state bytes per rank, the process's peak RSS, collectives by kind.

On a GPU a rank's peak memory is `torch.cuda.max_memory_allocated()` (`device_peak`, in the memory and end events
as device_peak_bytes). On a CPU there is no allocator counter, so this module measures two honest things instead:

- `state_bytes`: the bytes of the parameters, gradients and optimizer state *this rank holds*, summed over the
  tensors themselves (a sharded DTensor counts its local shard only). This is the quantity ZeRO/FSDP shrinks.
- `rss_peak_bytes`: the process's resident-set high-water mark (`getrusage`), which also counts the Python
  interpreter, torch's libraries, activations and allocator caches: an upper bound, dominated by fixed costs for
  small models.

`CommCounter` counts the collectives a block of code issues (all-gather, reduce-scatter, all-reduce, send/recv,
...) and the bytes of their tensors, with a torch dispatch mode: it sees what FSDP and DDP call into c10d and
what DTensor calls as functional collectives.
Time: a c10d collective is waited for as soon as it is issued, on the counted step only, so `time_s` is its own
duration (including waiting for the slowest rank) and that step gives up overlapping it with compute. Functional
collectives (DTensor) are waited for later by the caller: they are counted, not timed.
"""
from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for `t` (a DTensor's local shard, a plain tensor whole)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optimizer) -> dict:
    """Parameters, gradients (those present now) and optimizer state held by this rank, in bytes."""
    params = list(model.parameters())
    optim = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)  # step counters are scalars: not state that scales
    out = {"param_bytes": sum(local_bytes(p) for p in params),
           "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
           "optim_bytes": optim}
    out["state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    return out


def rss_peak_bytes() -> int:
    """The process's resident-set high-water mark in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def device_peak(device) -> dict:
    """{"device_peak_bytes": the most GPU memory this rank's tensors have held} on a CUDA device (the caching
    allocator's `max_memory_allocated`: parameters, gradients, optimizer state, activations and workspaces,
    without the CUDA context), {} on a CPU."""
    if getattr(device, "type", None) != "cuda":
        return {}
    return {"device_peak_bytes": int(torch.cuda.max_memory_allocated(device))}


# c10d op name (torch.ops.c10d.<name>) -> the collective it is
_KINDS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "_allgather_base_": "all_gather",
          "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
          "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
          "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast", "send": "send",
          "recv_": "recv", "alltoall_base_": "all_to_all", "barrier": "barrier",
          "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter", "allgather_coalesced_": "all_gather",
          # functional collectives (DTensor, torch.compile): torch.ops._c10d_functional.<name>
          "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all_single": "all_to_all", "broadcast": "broadcast"}
_NAMESPACES = ("c10d::", "_c10d_functional::")


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as c:` ... then `c.by_kind` = {kind: {"calls": n, "bytes": b, "time_s": t}}; bytes are
    the input tensors' (an all-gather counts its output, the gathered size, as NCCL's tests do)."""

    def __init__(self):
        super().__init__()
        self.by_kind: dict[str, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if getattr(packet, "_qualified_op_name", "").startswith(_NAMESPACES) and packet.__name__ in _KINDS:
            name = packet.__name__
            kind = _KINDS[name]
            tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
            if kind == "all_gather":
                tensors = tensors[:1]  # the output buffer (the gathered tensor)
            elif kind == "reduce_scatter":
                tensors = tensors[1:2] or tensors[:1]  # the input (the full-size tensor)
            entry = self.by_kind[kind]
            entry["calls"] += 1
            entry["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            work = out[-1] if isinstance(out, tuple) and out else None
            if hasattr(work, "wait"):  # a c10d op hands back its Work: wait for it here, and time it
                work.wait()
                entry["time_s"] = entry.get("time_s", 0.0) + time.perf_counter() - start
            return out
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        """A plain dict, for an event."""
        return {k: dict(v) for k, v in sorted(self.by_kind.items())}


class SavedTensorBytes:
    """`with SavedTensorBytes() as saved:` a forward pass; then `saved.bytes` = the activations autograd keeps for
    backward (each tensor once; parameters left out: they are state, counted by `state_bytes`). A block under
    activation checkpointing keeps only its input, which `models.checkpointed` reports with `add`."""

    active: "SavedTensorBytes | None" = None

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        from torch.autograd.graph import saved_tensors_hooks
        self.bytes, self._seen = 0, set()
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        SavedTensorBytes.active = self
        return self

    def __exit__(self, *exc):
        SavedTensorBytes.active = None
        return self._hooks.__exit__(*exc)

    def add(self, t: torch.Tensor) -> None:
        """Count `t` once (by storage address and size)."""
        if isinstance(t, torch.nn.Parameter) or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += local_bytes(t)

    def _pack(self, t):
        self.add(t)
        return t
