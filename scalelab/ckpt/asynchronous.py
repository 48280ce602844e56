"""Asynchronous checkpoints: copy the state to host memory, let training go on, write it in the background.

Training stalls only for the part of the snapshot (a memory copy into buffers reused from one save to the next,
pinned when a GPU is there) that the next step's forward and backward do not hide, and, when `max_in_flight`
earlier saves are still being written, for the oldest of them to finish. The background thread writes exactly what a sync save writes (same atomic file, same manifest
entry), so resume does not care how a checkpoint was made. A flush that fails is not lost: its error is
raised at the next `save()`, `completed()` or `close()`, naming the file (DeepFreeze / DataStates idea).

    ck = AsyncCheckpointer("runs/x/checkpoints", keep_last=2, max_in_flight=1)
    info = ck.save(step, model, optimizer)   # returns at once; the next optimizer.step() waits for the copy
    ...
    ck.close()                                # waits for the last flush; raises its error if it failed
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from .manifest import CheckpointError
from .sync import Checkpointer, capture, checkpoint_name, write_checkpoint


def started_pool(prefix: str) -> ThreadPoolExecutor:
    """A one-thread pool whose thread is running already. A pool starts its thread at the first submit, and
    starting a thread waits until the new thread has run: on a machine with more runnable threads than cores that
    took 58 ms once (2 cores, six busy processes beside two ranks), all of it inside the first save's blocking
    time. Created with the checkpointer, before training, that wait is not charged to any save."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=prefix)
    pool.submit(int).result()
    return pool


class HostSnapshot:
    """Copies nested state (dicts, lists, tensors, plain values) into host buffers kept between calls."""

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, state, path: str = ""):
        """A snapshot of `state` whose tensors live in this object's buffers (valid until the next copy)."""
        if isinstance(state, torch.Tensor) and type(state).__name__ == "DTensor":  # a shard: copy the local part
            from torch.distributed.tensor import DTensor
            local = self.copy(state.to_local(), path)
            return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False,
                                      shape=state.shape, stride=state.stride())
        if isinstance(state, torch.Tensor):
            buf = self._buffers.get(path)
            if buf is None or buf.shape != state.shape or buf.dtype != state.dtype:
                buf = torch.empty(state.shape, dtype=state.dtype, device="cpu", pin_memory=self.pin)
                self._buffers[path] = buf
            buf.copy_(state.detach(), non_blocking=self.pin)
            return buf
        if isinstance(state, dict):
            return {k: self.copy(v, f"{path}/{k}") for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.copy(v, f"{path}/{i}") for i, v in enumerate(state))
        return state  # ints, floats, strings, None: immutable or copied by state_dict() already

    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class AsyncCheckpointer(Checkpointer):
    """Snapshot to host memory, write on a background thread; at most `max_in_flight` unwritten.

    overlap=True (the default) does not even copy on the training thread: the copy runs on a helper thread
    while training goes on, and the optimizer's next `step()` waits (a step pre-hook) until the copy is
    complete, because that step is the first thing that changes the weights and optimizer state. Forward and
    backward of the next step therefore hide the copy (DataStates-LLM's lazy snapshot). Use overlap=False
    when something other than `optimizer.step()` changes the model between saves (an EMA, a manual edit).
    """

    mode = "async"
    needs_barrier = False  # every rank holds the same state; nothing on disk is waited for

    def __init__(self, directory, keep_last: int = 2, keep_best: int = 0, writer: bool = True,
                 max_in_flight: int = 1, overlap: bool = True):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.directory, self.keep_last, self.keep_best = Path(directory), keep_last, keep_best
        self.writer, self.max_in_flight, self.overlap = writer, max_in_flight, overlap
        self._pool = started_pool("ckpt-flush")  # flushes in order
        self._copier = started_pool("ckpt-snapshot")
        self._slots = [HostSnapshot() for _ in range(max_in_flight)]
        self._free = deque(range(max_in_flight))
        self._inflight: deque[tuple[Future, int, int]] = deque()  # (flush future, slot, step)
        self._last_copy: tuple[Future, int] | None = None  # (copy future, step) the next update must wait for
        self._update_wait: dict[int, float] = {}
        self._hooks: dict[int, object] = {}
        self._done: list[dict] = []
        self._error: CheckpointError | None = None

    def save(self, step: int, model, optimizer, metric: float | None = None, extra: dict | None = None) -> dict:
        """Start a snapshot and return; the write happens later. Raises the error of an earlier flush."""
        t0 = time.perf_counter()
        self._reap(block=False)
        if not self.writer:
            return {"step": step, "blocked_s": 0.0, "path": None, "bytes": 0, "snapshot_s": 0.0, "waited_s": 0.0}
        while not self._free:  # bounded: wait for the oldest flush to hand its buffers back
            self._reap(block=True, just_one=True)
        waited = time.perf_counter() - t0
        slot = self._free.popleft()
        t1 = time.perf_counter()
        state = capture(step, model, optimizer, extra)  # references to the live tensors, nothing copied yet
        if self.overlap:
            copy = self._copier.submit(self._snapshot, slot, state)
            self._last_copy = (copy, step)
            self._guard(optimizer)
        else:
            copy = Future()
            copy.set_result(self._snapshot(slot, state))
        snapshot_s = time.perf_counter() - t1
        future = self._pool.submit(self._flush, copy, metric)
        self._inflight.append((future, slot, step))
        return {"step": step, "blocked_s": time.perf_counter() - t0, "snapshot_s": snapshot_s, "waited_s": waited,
                "path": str(self.directory / checkpoint_name(step)), "bytes": self._slots[slot].nbytes()}

    def _snapshot(self, slot: int, state: dict) -> dict:
        snap = self._slots[slot].copy(state)
        if self._slots[slot].pin:
            torch.cuda.synchronize()  # the copies were non-blocking: they must have landed
        return snap

    def _guard(self, optimizer) -> None:
        """Make the optimizer's step wait for the snapshot in progress (registered once per optimizer)."""
        if id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self.before_update()  # a step pre-hook must return None (or new arguments)

    def before_update(self) -> float:
        """Block until the snapshot in progress is complete (called by the optimizer's step pre-hook); returns
        the seconds waited, which count as checkpoint stall."""
        if self._last_copy is None:
            return 0.0
        copy, step = self._last_copy
        t0 = time.perf_counter()
        wait([copy])
        waited = time.perf_counter() - t0
        self._last_copy = None
        self._update_wait[step] = self._update_wait.get(step, 0.0) + waited
        return waited

    def _flush(self, copy: Future, metric) -> dict:
        state = copy.result()
        t0 = time.perf_counter()
        path, size = write_checkpoint(self.directory, state, self.keep_last, self.keep_best, metric,
                                      delete_later=True)
        return {"step": state["step"], "path": str(path), "bytes": size, "flush_s": time.perf_counter() - t0,
                "finished_t": time.time()}

    def _reap(self, block: bool, just_one: bool = False) -> None:
        while self._inflight and (block or self._inflight[0][0].done()):
            future, slot, step = self._inflight.popleft()
            try:
                done = future.result()
                done["update_wait_s"] = self._update_wait.pop(step, 0.0)
                self._done.append(done)
            except BaseException as e:  # noqa: BLE001 - kept and raised below, at a point the caller expects
                if self._error is None:
                    path = self.directory / checkpoint_name(step)
                    self._error = CheckpointError(f"asynchronous checkpoint of step {step} to {path} failed: "
                                                  f"{type(e).__name__}: {e}")
                    self._error.__cause__ = e
            self._free.append(slot)
            if just_one:
                break
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def completed(self) -> list[dict]:
        """Flushes finished since the last call ({step, path, bytes, flush_s}); raises a failed flush's error."""
        self._reap(block=False)
        done, self._done = self._done, []
        return done

    def in_flight(self) -> int:
        """Saves snapshotted but not yet on disk."""
        return sum(1 for f, _, _ in self._inflight if not f.done())

    def close(self) -> list[dict]:
        """Wait for every flush; returns those not yet reported; raises the first failure."""
        try:
            self._reap(block=True)
        finally:
            self._pool.shutdown(wait=True)
            self._copier.shutdown(wait=True)
            for handle in self._hooks.values():
                handle.remove()
            self._hooks = {}
        done, self._done = self._done, []
        return done


__all__ = ["AsyncCheckpointer", "HostSnapshot", "started_pool"]
