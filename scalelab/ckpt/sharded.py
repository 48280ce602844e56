"""Sharded checkpoints: every rank writes its part, in parallel, with `torch.distributed.checkpoint` (DCP).

With DDP every rank holds the same replicated state; DCP's planner deduplicates it and spreads the tensors
over the ranks, so W ranks write ~1/W of the bytes each instead of rank 0 writing everything (with FSDP or
tensor parallelism each rank's shard is genuinely its own). `async_save=True` returns after taking the state
dict: a writer thread copies it into host buffers kept from save to save (the optimizer's next step waits for
that copy, as the async mode's does), then does the whole DCP save of that copy, collectives included.

Atomicity is the same contract as the single-file modes: every rank writes into `.step-<N>.partial/`; once
DCP's coordinator has written the metadata (which it does only after every rank's data is written), rank 0
checksums the files, renames the directory to `step-<N>/`, and enters it in the manifest.

DCP traffic goes over its own gloo process group, so the background thread's collectives never interleave
with the training's allreduce (and CPU tensors work even when training uses NCCL).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, wait
from pathlib import Path

import torch
import torch.distributed as dist

from .asynchronous import HostSnapshot, started_pool
from .sync import Checkpointer
from .manifest import CheckpointError, checksum_file, fsync_dir, record, verify


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    return dcp, get_state_dict, set_state_dict


def sharded_name(step: int) -> str:
    """The directory of the sharded checkpoint at `step`."""
    return f"step-{step:08d}"


class ShardedCheckpointer(Checkpointer):
    """Collective checkpoints: every rank must call `save` and `restore` at the same steps."""

    mode = "sharded"
    needs_barrier = False  # DCP synchronises the ranks itself

    def __init__(self, directory, keep_last: int = 2, keep_best: int = 0, rank: int = 0, world: int = 1,
                 async_save: bool = False):
        self.directory, self.keep_last, self.keep_best = Path(directory), keep_last, keep_best
        self.rank, self.world, self.async_save = rank, world, async_save
        distributed = dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None  # collective: all ranks call it
        self._no_dist = not distributed
        self._pending = None  # (finalised event, step) of the save in flight
        # async: the writer's thread runs before training starts (started_pool), not inside the first save
        self._writer, self._snapshot = (started_pool("ckpt-sharded-write"), HostSnapshot()) if async_save else (None, None)
        self._staging = None  # (staging future, step) the optimizer's next step must wait for
        self._update_wait: dict[int, float] = {}
        self._hooks: dict[int, object] = {}
        self._done: list[dict] = []
        self._error: BaseException | None = None
        self.directory.mkdir(parents=True, exist_ok=True)

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, metric: float | None = None, extra: dict | None = None) -> dict:
        """Write this rank's part (async: start the copy and return). Raises an earlier async save's error."""
        dcp, get_state_dict, _ = _dcp()
        t0 = time.perf_counter()
        self._wait_pending()  # one save in flight at most: its staged copy must not be overwritten
        waited = time.perf_counter() - t0
        if self.async_save and not self._no_dist:
            size = self._save_async(step, model, optimizer, metric)
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            partial = self._prepare(step)
            start = time.perf_counter()
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=str(partial), process_group=self._group, no_dist=self._no_dist)
            self._finish(step, metric, start)
            size = _state_bytes(state)
        return {"step": step, "blocked_s": time.perf_counter() - t0, "waited_s": waited,
                "path": str(self.directory / sharded_name(step)), "bytes": size // max(self.world, 1)}

    def _save_async(self, step: int, model, optimizer, metric) -> int:
        """Hand the state to the writer thread and return its bytes: nothing is copied, planned or written here.

        The writer takes the state dict and copies it into host buffers kept from save to save (`HostSnapshot`,
        pinned with a GPU) while the next forward and backward run — the optimizer's next step waits for that
        copy (a step pre-hook), as the async mode's does — then does what a synchronous save does: the barrier,
        DCP's planning collectives on this checkpointer's own gloo group, the files, rank 0's checksums and rename.
        A model with sharded (DTensor) parameters has its state dict taken here, between steps: FSDP swaps its
        parameters during forward. So has an optimizer without state yet (DCP would initialise it with a step).
        """
        _, get_state_dict, _ = _dcp()
        state = None
        if not optimizer.state or any(type(p).__name__ == "DTensor" for p in model.parameters()):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            size = _state_bytes(state)
        else:  # the same tensors as DCP's state dict, found in a fraction of the time
            size = _state_bytes([model.state_dict(), optimizer.state_dict()["state"]])
        if self._writer is None:
            self._writer = started_pool("ckpt-sharded-write")
            self._snapshot = HostSnapshot()
        staged: Future = Future()
        self._staging = (staged, step)
        if id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(self._before_update)
        finalised = threading.Event()
        self._pending = (finalised, step)
        self._writer.submit(self._write_async, state or (model, optimizer), staged, step, metric, finalised)
        return size

    def _before_update(self, optimizer, args, kwargs) -> None:
        """The optimizer's step pre-hook: wait until the staged copy is complete (counted as stall)."""
        if self._staging is None:
            return
        staged, step = self._staging
        t0 = time.perf_counter()
        wait([staged])
        self._update_wait[step] = self._update_wait.get(step, 0.0) + time.perf_counter() - t0
        self._staging = None

    def _write_async(self, state, staged: Future, step: int, metric, finalised: threading.Event) -> None:
        dcp, get_state_dict, _ = _dcp()
        try:
            try:
                if isinstance(state, tuple):  # a plain model: its state dict is taken here, before the copy
                    model, optimizer = state
                    model_sd, optim_sd = get_state_dict(model, optimizer)
                    state = {"model": model_sd, "optim": optim_sd, "step": step}
                state = self._snapshot.copy(state)
                if self._snapshot.pin:
                    torch.cuda.synchronize()  # the copies were non-blocking: they must have landed
            finally:
                staged.set_result(None)  # the optimizer may step now (a failed copy is reported below)
            partial = self._prepare(step)
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=str(partial), process_group=self._group, no_dist=self._no_dist)
            self._finish(step, metric, start)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by _wait_pending
            self._error = e
        finally:
            finalised.set()

    def _prepare(self, step: int) -> Path:
        """The empty `.partial` directory every rank writes into (rank 0 clears one left by a killed attempt)."""
        partial = self.directory / f".{sharded_name(step)}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        partial.mkdir(parents=True, exist_ok=True)
        return partial

    def _finish(self, step: int, metric, start: float) -> None:
        """Rank 0: checksum the complete directory, rename it into place, enter it in the manifest."""
        flush_s = time.perf_counter() - start
        final = self.directory / sharded_name(step)
        size = 0
        if self.rank == 0:
            partial = self.directory / f".{sharded_name(step)}.partial"
            files = {p.name: checksum_file(p) for p in sorted(partial.iterdir()) if p.is_file()}
            size = sum((partial / n).stat().st_size for n in files)
            for name in files:  # DCP does not fsync: make the bytes durable before the rename publishes them
                fd = os.open(partial / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            fsync_dir(self.directory)
            entry = {"step": step, "file": final.name, "kind": "sharded", "files": files, "bytes": size,
                     "ranks": self.world}
            if metric is not None:
                entry["metric"] = float(metric)
            record(self.directory, entry, self.keep_last, self.keep_best, delete_later=True)
        self._done.append({"step": step, "path": str(final), "bytes": size, "flush_s": flush_s,
                           "finished_t": time.time()})

    def _wait_pending(self) -> None:
        if self._pending is None:
            return
        finalised, step = self._pending
        finalised.wait()
        self._pending = None
        if self._error is not None:
            e, self._error = self._error, None
            raise CheckpointError(f"asynchronous sharded checkpoint of step {step} to "
                                  f"{self.directory / sharded_name(step)} failed: {type(e).__name__}: {e}") from e

    def completed(self) -> list[dict]:
        """Saves finished since the last call (an async one is finalised once its write is done), each with
        `update_wait_s`: how long the optimizer's step waited for its staged copy."""
        if self._pending is not None and self._pending[0].is_set():
            self._wait_pending()
        return self._report()

    def in_flight(self) -> int:
        """Saves started but not yet finalised (0 or 1)."""
        return int(self._pending is not None and not self._pending[0].is_set())

    def close(self) -> list[dict]:
        """Finish the save in flight, if any; returns what was not yet reported."""
        try:
            self._wait_pending()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks, self._staging = {}, None
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
        return self._report()

    def _report(self) -> list[dict]:
        done, self._done = self._done, []
        for entry in done:
            entry["update_wait_s"] = self._update_wait.pop(entry["step"], 0.0)
        return done

    # -- resuming -------------------------------------------------------------------------------------
    def restore(self, model, optimizer, path=None) -> int:
        """Load the newest complete checkpoint (or `path`) into model and optimizer; 0 when there is none."""
        path = Path(path) if path else self.latest()
        if path is None:
            return 0
        return load_sharded(path, model, optimizer, self._group, self._no_dist)

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)


def load_sharded(path, model, optimizer=None, group=None, no_dist: bool | None = None) -> int:
    """Verify every file of a sharded checkpoint, then load it with DCP; returns its step."""
    dcp, get_state_dict, set_state_dict = _dcp()
    path = Path(path)
    verify(path)
    if no_dist is None:
        no_dist = not (dist.is_available() and dist.is_initialized())
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer is not None else (model.state_dict(), {})
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=no_dist)
    except Exception as e:  # noqa: BLE001 - DCP's errors do not say which checkpoint
        raise CheckpointError(f"could not load sharded checkpoint {path}: {type(e).__name__}: {e}") from e
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
    return int(state["step"])


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' a single process even when told so (no_dist=True): say it once, here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _state_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


__all__ = ["ShardedCheckpointer", "load_sharded", "sharded_name"]
