"""DDP communication hooks the engine can register (`optim.comm_hook`), and the wire counter that measures them.

A DDP communication hook replaces the all-reduce of each gradient bucket: `hook(state, bucket)` gets the bucket's
flat gradient (`bucket.buffer()`) and returns a Future whose value is the averaged gradient, written back into the
parameters' `.grad`. torch ships casts to fp16/bf16 and PowerSGD (Vogels et al. 2019); a student's own hook (top-k
sparsification with error feedback, lab 02) is named as module:function and gets a `HookState`.

`WireCounter` counts what every rank hands to torch.distributed's collectives, from any thread (a hook's
callbacks run on the backend's threads), and what a ring or tree algorithm then sends per rank: the bytes behind a
compression claim, written into every step event (`comm_bytes`, `wire_bytes`, `collectives`).
"""
from __future__ import annotations

import functools
import threading
import time
from types import SimpleNamespace

import torch.distributed as dist

_SENT = {  # bytes one rank sends for a collective over n ranks whose input on that rank is s bytes
    "all_reduce": lambda s, n: 2 * (n - 1) / n * s,  # ring: reduce-scatter + all-gather
    "all_gather": lambda s, n: (n - 1) * s,  # every rank's s reaches the n - 1 others
    "all_gather_into_tensor": lambda s, n: (n - 1) * s,
    "reduce_scatter_tensor": lambda s, n: (n - 1) / n * s,
    "all_to_all_single": lambda s, n: (n - 1) / n * s,
    "broadcast": lambda s, n: s,
}


class WireCounter:
    """Counts torch.distributed collectives of this process: `take()` hands back what was counted since the last
    call: {"comm_bytes": input bytes, "wire_bytes": bytes sent (ring model), "collectives": calls}."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()
        self._originals = {}

    def _reset(self):
        self.comm_bytes, self.wire_bytes, self.calls = 0, 0.0, 0

    def install(self) -> "WireCounter":
        """Wrap torch.distributed's tensor collectives (idempotent); the wrappers count and call through."""
        for name, sent in _SENT.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, name, sent))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, original, name, sent):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            tensor = kwargs.get("tensor", kwargs.get("input"))
            if tensor is None:
                positional = args[1:2] if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                                                    "all_to_all_single") else args[:1]
                tensor = positional[0] if positional else None
            if hasattr(tensor, "element_size"):
                nbytes = tensor.numel() * tensor.element_size()
                group = kwargs.get("group")
                n = dist.get_world_size(group) if dist.is_initialized() else 1
                with self._lock:
                    self.comm_bytes += nbytes
                    self.wire_bytes += sent(nbytes, n)
                    self.calls += 1
            return original(*args, **kwargs)
        return counted

    def take(self) -> dict:
        with self._lock:
            out = {"comm_bytes": int(self.comm_bytes), "wire_bytes": int(round(self.wire_bytes)),
                   "collectives": self.calls}
            self._reset()
        return out


class HookState(SimpleNamespace):
    """What a hook of the student's own gets as `state`: ratio, error_feedback, rank, world_size, and `memory`, a
    dict the hook may keep tensors in from one step to the next (the residuals of error feedback)."""


def build_hook(strategy, name: str):
    """(state, hook) for `optim.comm_hook` = name, timed like the engine's default all-reduce hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    spec, info = strategy.spec, strategy.info
    if name == "fp16":
        state, hook = None, default_hooks.fp16_compress_hook
    elif name == "bf16":
        state, hook = None, default_hooks.bf16_compress_hook
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=spec.optim.comm_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                            random_seed=spec.seed)
        hook = powerSGD_hook.powerSGD_hook
    else:
        from ..run.user_code import resolve_code
        hook = resolve_code(name, "optim.comm_hook")
        state = HookState(ratio=spec.optim.comm_ratio, error_feedback=spec.optim.comm_error_feedback,
                          rank=info.rank, world_size=info.world_size, memory={})

    def timed(strategy, bucket):
        """Run the hook on the bucket; the callback adds launch-to-completion time to the strategy's comm time."""
        start = time.perf_counter()
        fut = hook(state, bucket)

        def done(f):
            strategy.comm_s += time.perf_counter() - start
            value = f.value()
            return value[0] if isinstance(value, list) else value

        return fut.then(done)

    timed.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    return strategy, timed
