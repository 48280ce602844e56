"""The training loop every launcher runs, one process per rank, readable top to bottom.

Each step: fetch a batch (timed as data wait), forward and backward under autocast, let the strategy
average gradients and step, then write a step event. Rank facts come from `scalelab.dist.rank_info()`.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data import build_dataset, build_loader
from ..data.batches import resumable_batches
from ..data.loader import build_eval_set
from ..data.stored import training_dataset
from ..dist import threads_per_rank
from .faults import maybe_inject, phase_delay
from .forward import ForwardRecoveryDDP
from .hostmem import apply_malloc_policy
from .inject_hook import instructor_injection
from ..run.nonce import init_seed, reverify_steps
from ..run.user_code import code_hashes
from .comm_hooks import WireCounter
from .memory import CommCounter, SavedTensorBytes, device_peak, rss_peak_bytes, state_bytes
from .gpt import Throughput
from .build import autocast_for, build_training
from .optim import lr_of
from .preempt import Preemption
from .profiling import StepProfiler
from .strategies import build_strategy, pick_device
from .strategy import Strategy


@dataclass
class _Rank:
    """What one rank's training holds from its set-up to its end: train() and its steps read it."""

    spec: Any
    info: Any
    events: Any
    device: torch.device
    strategy: Strategy
    raw_model: torch.nn.Module  # the model as built: evaluated, checkpointed and saved
    model: Any  # the model as the strategy trains it (wrapped)
    optimizer: Any
    scaler: Any  # a GradScaler for fp16, else None
    checkpointer: Any
    profiler: StepProfiler
    autocast: Any
    batches: Any
    throughput: Throughput
    start_step: int
    total_steps: int
    peak_lr: float
    wire: Any = None  # WireCounter: what each step handed to torch.distributed and sent
    slow_data: Any = None  # a straggler in one phase (fault.phase data / compute), else None
    slow_compute: Any = None


def train(spec, info, events) -> dict:
    """Run `spec` as rank `info.rank`; returns the end event's fields."""
    started = time.perf_counter()
    r = _set_up(spec, info, events)
    loss_value = float("nan")
    preemption = Preemption(spec.checkpoint.on_signal)  # SIGTERM/SIGUSR1 -> emergency checkpoint, clean exit
    r.profiler.start(r.start_step)
    stop = min(r.total_steps, r.start_step + (reverify_steps() or r.total_steps))  # a grader's re-run: its first steps
    instructor = instructor_injection(spec, info)  # $SCALELAB_INJECT_FILE: the capstone's live kill or preemption
    for step in range(r.start_step, stop):
        maybe_inject(spec.fault, info.rank, step, events)
        if instructor:
            instructor(step, events)
        loss_value = _step(r, step)
        done = step + 1
        if spec.eval_every and done % spec.eval_every == 0 and done < r.total_steps:  # every rank: a collective
            events.emit("eval", step=done, accuracy=_evaluate(r))
        saved = spec.checkpoint.every_steps and done % spec.checkpoint.every_steps == 0 and done < r.total_steps
        if saved:
            _checkpoint(r.checkpointer, r.strategy, r.raw_model, r.optimizer, done, loss_value, events)
        _report_flushes(r.checkpointer.completed(), events)
        if done < r.total_steps and preemption.agreed(r.strategy):  # every rank votes: all stop after the same step
            return _preempted(r.checkpointer, r.strategy, r.raw_model, r.optimizer, done, loss_value, events,
                              preemption.signal, already_saved=saved)

    r.profiler.stop()
    if r.wire:
        r.wire.uninstall()
    if stop < r.total_steps:  # a grader's re-run: it compares these steps' losses, nothing else of the run is needed
        end = dict(steps=stop, final_loss=r.strategy.mean(loss_value), elapsed_s=time.perf_counter() - started,
                   reverify=True)
        events.emit("end", **end)
        r.strategy.shutdown()
        return end
    return _finish(r, loss_value, started)


def _set_up(spec, info, events) -> _Rank:
    """This rank's device, strategy, model and optimizer (resumed from the newest checkpoint when the spec asks) and
    its batches; then the start event."""
    malloc = apply_malloc_policy(spec.world.malloc)  # before the first large tensor
    threads = threads_per_rank(spec, info.local_size)
    torch.set_num_threads(threads)
    device = pick_device(spec, info.local_rank)
    profiler = StepProfiler(spec, info.rank, device, events)  # traces/rank-<r>.json when spec.profile.enabled
    # forward recovery: survivors of a lost rank re-form the group and go on from memory (train/forward.py)
    strategy = (ForwardRecoveryDDP if spec.fault.recovery == "forward" else build_strategy)(spec, info, device)
    strategy.setup()
    run_dir = Path(spec.output_dir)
    dataset = build_dataset(spec.data, spec.seed)
    raw_model, model, optimizer, checkpointer, start_step, resumed_from, peak_lr = _model_and_state(
        spec, strategy, dataset, device, run_dir)

    accum = spec.optim.grad_accum
    train_set = training_dataset(dataset, spec.data, run_dir / "data", spec.seed)  # on disk unless format=memory
    # the pipeline stages and tensor-parallel shards of one replica see the same batches (train/mesh.py)
    dp_rank, dp_world = strategy.data_parallel
    loader = build_loader(train_set, spec.data, spec.optim.batch_per_worker, dp_rank, dp_world, spec.seed)
    total_steps = spec.epochs * (len(loader) // accum) if spec.epochs else spec.steps
    batches = resumable_batches(loader, start_step * accum, device)
    throughput = Throughput(raw_model, device, spec.precision, info.world_size // dp_world)  # gpt: tokens/s, MFU

    events.emit("start", world_size=info.world_size, local_rank=info.local_rank, rank_source=info.source,
                backend=strategy.backend, device=str(device), threads=threads, malloc=malloc, wait=strategy.wait,
                pid=os.getpid(), host=socket.gethostname(), interface=os.environ.get("GLOO_SOCKET_IFNAME"),
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                total_steps=total_steps, start_step=start_step,
                resumed_from=resumed_from, global_batch=spec.global_batch, peak_lr=peak_lr,
                parameters=sum(p.numel() for p in raw_model.parameters()), strategy=spec.strategy,
                comm_hook=spec.optim.comm_hook, schedule=spec.optim.schedule, code=code_hashes(run_dir))
    return _Rank(
        spec=spec, info=info, events=events, device=device, strategy=strategy, raw_model=raw_model, model=model,
        optimizer=optimizer, scaler=torch.amp.GradScaler("cuda") if spec.precision == "fp16" else None,
        checkpointer=checkpointer, profiler=profiler, autocast=autocast_for(spec.precision, device), batches=batches,
        throughput=throughput, start_step=start_step, total_steps=total_steps, peak_lr=peak_lr,
        # the bytes behind a compression claim (ring model); Horovod moves its own
        wire=WireCounter().install() if info.world_size > 1 and spec.strategy != "horovod" else None,
        slow_data=phase_delay(spec.fault, info.rank, "data"),
        slow_compute=phase_delay(spec.fault, info.rank, "compute"))


def _model_and_state(spec, strategy, dataset, device, run_dir):
    """The model, built from the grading's nonce (run/nonce.py: copied or hand-written events cannot match its
    initial weights), and its optimizer, wrapped by the strategy and resumed from the newest checkpoint when the
    spec asks. Returns raw_model, model, optimizer, checkpointer, start_step, resumed_from, peak_lr."""
    model, optimizer, peak_lr = build_training(spec, dataset, device, init_seed(spec.seed))
    raw_model = model
    if strategy.shards_state:  # wrap shards the state: a resume restores into the shards
        model, optimizer = strategy.wrap(model, optimizer)
    checkpointer = strategy.checkpointer(spec.checkpoint, run_dir / "checkpoints")  # a mesh: one part per rank
    start_step, resumed_from = 0, None
    if spec.checkpoint.resume and (found := checkpointer.latest()):
        start_step = checkpointer.restore(model, optimizer, found)
        resumed_from = str(found)
    if not strategy.shards_state:
        model, optimizer = strategy.wrap(model, optimizer)
    return raw_model, model, optimizer, checkpointer, start_step, resumed_from, peak_lr


def _step(r: _Rank, step: int) -> float:
    """One training step after `step` steps: its micro-batches' forwards and backwards (or the pipeline schedule's),
    the strategy's step, the memory event (first step) and the step event; returns the step's loss."""
    spec, strategy, profiler, events = r.spec, r.strategy, r.profiler, r.events
    accum, batch = spec.optim.grad_accum, spec.optim.batch_per_worker
    lr = lr_of(spec.optim, step, r.peak_lr, r.total_steps)
    for group in r.optimizer.param_groups:
        group["lr"] = lr
    if r.wire:
        r.wire.take()  # from here to the step event
    t0 = time.perf_counter()
    data_s, loss_sum = 0.0, torch.zeros((), device=r.device)
    first = step == r.start_step
    # the first step's collectives are counted (every step issues the same ones); later steps run unobserved
    counter = CommCounter() if first else contextlib.nullcontext()
    activations = SavedTensorBytes()  # the activations one micro-batch's forward keeps for backward (first step)
    counter.__enter__()
    for micro in range(accum):
        t_data = time.perf_counter()
        with profiler.phase("data"):
            x, y = next(r.batches)
            if r.slow_data and micro == 0:
                r.slow_data(step)
        data_s += time.perf_counter() - t_data
        if r.slow_compute and micro == 0:  # a slow forward: in this rank's compute_s, whatever the strategy
            r.slow_compute(step)
        if strategy.pipelined:  # the schedule runs the micro-batches' forwards and backwards
            loss_sum += strategy.forward_backward(r.model, x, y, accum)
            continue
        with strategy.no_sync(r.model) if micro < accum - 1 else contextlib.nullcontext():
            with r.autocast, activations if first and micro == 0 else contextlib.nullcontext(), \
                    profiler.phase("forward"):
                loss = F.cross_entropy(r.model(x).float(), y) / accum
            with profiler.phase("backward"):
                (r.scaler.scale(loss) if r.scaler else loss).backward()
        loss_sum += loss.detach()
    with profiler.phase("optimizer"):
        strategy.step(r.optimizer, r.scaler)
    counter.__exit__(None, None, None)
    if first:  # what this rank holds once every state exists: gradients are freed next
        events.emit("memory", step=step + 1, **state_bytes(r.raw_model, r.optimizer), rss_peak_bytes=rss_peak_bytes(),
                    **device_peak(r.device), activation_bytes=activations.bytes, comm=counter.summary())
    r.optimizer.zero_grad()  # set_to_none is the default (and Horovod takes no argument)
    loss_value = float(loss_sum)  # a CPU-GPU sync point: it also makes the step time below honest
    profiler.step()
    step_s = time.perf_counter() - t0
    comm_s = strategy.take_comm_time()
    done = step + 1
    if done % spec.log_every == 0 or done == r.total_steps:
        exposed = comm_s if spec.strategy == "horovod" else 0.0  # DDP's buckets overlap backward
        events.emit("step", step=done, loss=loss_value, lr=lr, samples=batch * accum, step_s=step_s,
                    data_s=data_s, compute_s=max(step_s - data_s - exposed, 0.0), comm_s=comm_s,
                    samples_per_s=batch * accum / step_s, **r.throughput.fields(batch * accum, step_s),
                    **(r.wire.take() if r.wire else {}))
    return loss_value


def _finish(r: _Rank, loss_value: float, started: float) -> dict:
    """The end of a whole run: the last writes on disk, the final loss and accuracy, model.pt, the end event."""
    _report_flushes(r.checkpointer.close(), r.events)  # an asynchronous save still in flight finishes (or raises)
    final_loss = r.strategy.mean(loss_value)
    accuracy = _evaluate(r)
    full_state = r.strategy.full_state_dict(r.raw_model)  # FSDP gathers the shards: every rank takes part
    if r.info.is_main:
        torch.save(full_state, Path(r.spec.output_dir) / "model.pt")
    r.strategy.barrier()
    end = dict(steps=r.total_steps, final_loss=final_loss, eval_accuracy=accuracy,
               elapsed_s=time.perf_counter() - started, rss_peak_bytes=rss_peak_bytes(), **device_peak(r.device))
    r.events.emit("end", **end)
    r.strategy.shutdown()
    return end


def _checkpoint(checkpointer, strategy, model, optimizer, step, loss, events):
    """Save through the spec's checkpointer; blocked_s is what training lost to it (the stall)."""
    t0 = time.perf_counter()
    metric = strategy.mean(loss)  # keep-best judges the loss of all ranks, not rank 0's share
    saved = checkpointer.save(step, model, optimizer, metric=metric)
    if checkpointer.needs_barrier:
        strategy.barrier()  # sync: nobody runs ahead of a checkpoint that is not complete yet
    events.emit("checkpoint", **{**saved, "mode": checkpointer.mode, "metric": metric,
                                 "blocked_s": time.perf_counter() - t0})


def _preempted(checkpointer, strategy, model, optimizer, step, loss, events, signal_name, already_saved) -> dict:
    """Emergency checkpoint after `step` (unless one was just taken), wait until it is on disk, leave cleanly."""
    t0 = time.perf_counter()
    if not already_saved:
        _checkpoint(checkpointer, strategy, model, optimizer, step, loss, events)
    _report_flushes(checkpointer.close(), events)  # an asynchronous write must be complete before we exit
    strategy.barrier()
    fields = dict(step=step, signal=signal_name or "peer", emergency_s=time.perf_counter() - t0)
    events.emit("preempted", **fields)
    strategy.shutdown()
    return {"preempted": True, **fields}


def _report_flushes(done: list[dict], events) -> None:
    """One event per checkpoint that became complete on disk (for async modes, long after its save call)."""
    for d in done:
        events.emit("checkpoint_done", **d)


@torch.no_grad()
def _evaluate(r: _Rank) -> float:
    """Accuracy on a held-out set, split over ranks (or a mesh's replicas) by the strategy and averaged."""
    x, y = build_eval_set(r.spec.data, r.spec.seed)
    return r.strategy.evaluate(r.raw_model, x.to(r.device), y.to(r.device), r.autocast)
