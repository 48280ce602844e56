"""Sharded checkpoints: every rank writes its part, in parallel, with `torch.distributed.checkpoint` (DCP).

With DDP every rank holds the same replicated state; DCP's planner deduplicates it and spreads the tensors
over the ranks, so W ranks write ~1/W of the bytes each instead of rank 0 writing everything (with FSDP or
tensor parallelism each rank's shard is genuinely its own). `async_save=True` uses DCP's asynchronous save:
the state is staged to host memory and written by a background thread while training goes on.

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
from pathlib import Path

import torch
import torch.distributed as dist

from .manifest import CheckpointError, checksum_file, fsync_dir, latest, record, verify


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    return dcp, get_state_dict, set_state_dict


def sharded_name(step: int) -> str:
    """The directory of the sharded checkpoint at `step`."""
    return f"step-{step:08d}"


class ShardedCheckpointer:
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
        self._done: list[dict] = []
        self._error: BaseException | None = None
        self.directory.mkdir(parents=True, exist_ok=True)

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, metric: float | None = None, extra: dict | None = None) -> dict:
        """Write this rank's part (async: stage it and return). Raises an earlier async save's error."""
        dcp, get_state_dict, _ = _dcp()
        t0 = time.perf_counter()
        self._wait_pending()  # one save in flight at most: its staged copy must not be overwritten
        waited = time.perf_counter() - t0
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": step}
        partial = self.directory / f".{sharded_name(step)}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left over from a killed attempt at this step
        self._barrier()
        partial.mkdir(parents=True, exist_ok=True)
        kwargs = dict(checkpoint_id=str(partial), process_group=self._group, no_dist=self._no_dist)
        start = time.perf_counter()
        if self.async_save and not self._no_dist:
            future = dcp.async_save(state, **kwargs)
            future = getattr(future, "upload_completion", future)
            finalised = threading.Event()
            # finalise on DCP's writer thread as soon as the write completes: rank 0's checksums and rename
            # never stall training
            future.add_done_callback(lambda f: self._finish_async(f, step, metric, start, finalised))
            self._pending = (finalised, step)
        else:
            with _quiet_single_process():
                dcp.save(state, **kwargs)
            self._finish(step, metric, start)
        return {"step": step, "blocked_s": time.perf_counter() - t0, "waited_s": waited,
                "path": str(self.directory / sharded_name(step)), "bytes": _state_bytes(state) // max(self.world, 1)}

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

    def _finish_async(self, future, step, metric, start, finalised: threading.Event) -> None:
        try:
            future.result()
            self._finish(step, metric, start)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by _wait_pending
            self._error = e
        finally:
            finalised.set()

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
        """Saves finished since the last call (an async one is finalised once its write is done)."""
        if self._pending is not None and self._pending[0].is_set():
            self._wait_pending()
        done, self._done = self._done, []
        return done

    def close(self) -> list[dict]:
        """Finish the save in flight, if any; returns what was not yet reported."""
        self._wait_pending()
        done, self._done = self._done, []
        return done

    # -- resuming -------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete sharded checkpoint, or None."""
        return latest(self.directory)

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
