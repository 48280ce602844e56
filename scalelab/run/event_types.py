"""The engine's event stream, declared: every type of event a rank writes, and every field each type may carry.

Widgets, labs, the CLI and the grader's evidence all read `<run dir>/events/rank-<r>.jsonl` (run/events.py); this
is the one list of what can be in those lines. Every event has the fields of COMMON; a type's own fields are all
optional (a resumed run, a GPU, a Horovod elastic run or a lab's own step each write a subset), but no event may
carry a field that is not declared here for its type. EventWriter.emit holds every event to this when the
environment sets SCALELAB_STRICT_EVENTS=1 (the test suite does, for every run it starts), and a test holds every
`emit` call in the code to it (tests/test_event_types.py). A new event or field is declared here first.

Not the engine's stream, and not held to this: lab 05's spread-rank experiment (experiments/spread_rank.py) writes
its own read log (start, read, epoch) in the same file layout with its own writer; lab 01's timer log and the kill
experiments' exit records are files of their own.
"""
from __future__ import annotations

import os

from ..errors import ScalelabError

STRICT_ENV = "SCALELAB_STRICT_EVENTS"

COMMON = {
    "type": "the event's type: a key of EVENTS",
    "rank": "the global rank that wrote it",
    "t": "wall-clock time of writing (time.time(), seconds)",
}

_STEP_TIMES = {
    "step": "the step just finished (1-based)",
    "loss": "this rank's training loss of the step",
    "lr": "the learning rate the step used",
    "samples": "samples this rank processed in the step",
    "step_s": "seconds the step took on this rank",
    "data_s": "of which waiting for the next batch",
    "compute_s": "of which forward and backward",
    "comm_s": "of which waiting for gradient communication",
    "samples_per_s": "this rank's samples per second in the step",
}

EVENTS: dict[str, dict[str, str]] = {
    "start": {
        "world_size": "ranks in the run", "local_rank": "rank on its node",
        "rank_source": "where the rank came from (torchrun, SLURM_PROCID, OMPI_COMM_WORLD_RANK, ...)",
        "backend": "torch.distributed backend (gloo, nccl, mpi)", "device": "the rank's device",
        "threads": "intra-op threads of the rank", "malloc": "the allocator settings the rank ran with",
        "wait": "seconds the rank waited for its peers at rendezvous", "pid": "process id", "host": "host name",
        "interface": "network interface of the rendezvous", "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
        "total_steps": "steps of the whole run", "start_step": "the step this launch starts after (0: a new run)",
        "resumed_from": "the checkpoint this launch resumed from, or null", "global_batch": "samples per step, all ranks",
        "peak_lr": "the learning rate after warm-up (scaled)", "parameters": "model parameters",
        "strategy": "ddp, horovod, fsdp, pp, tp or 3d", "comm_hook": "the DDP communication hook, or null",
        "schedule": "the pipeline schedule (pp, 3d), or null", "code": "SHA-256 of each user file the run loaded",
        "nonce": "the grading's nonce (null outside a grading)",
        "horovod_host": "Horovod's host name for the rank", "elastic": "true in a Horovod elastic run",
        "hvd_rank": "Horovod's rank", "commit_every": "steps between Horovod elastic commits",
        "precision": "fp32, bf16 or fp16 (a lab's own step)", "step_function": "module:function of a lab's own step",
    },
    "step": {
        **_STEP_TIMES,
        "tokens_per_s": "tokens per second (gpt)", "flops_per_token": "model FLOPs per token (gpt)",
        "mfu": "model FLOPs utilisation (gpt on a GPU with a known peak; null otherwise)",
        "peak_tflops": "the device's peak the MFU is against (null when unknown)",
        "comm_bytes": "gradient bytes handed to the communication hook in the step",
        "wire_bytes": "bytes the hook sent on the wire in the step", "collectives": "collective calls in the step",
        "world_size": "ranks in the run (Horovod elastic: changes with membership)", "hvd_rank": "Horovod's rank",
    },
    "eval": {"step": "the step after which it evaluated", "accuracy": "accuracy on the run's evaluation set"},
    "memory": {
        "step": "the step measured", "param_bytes": "parameters held by the rank",
        "grad_bytes": "gradients held by the rank", "optim_bytes": "optimizer state held by the rank",
        "state_bytes": "parameters + gradients + optimizer state", "rss_peak_bytes": "the process's resident peak",
        "device_peak_bytes": "the most GPU memory the rank's tensors held (GPU only)",
        "activation_bytes": "activations saved for backward in the step", "comm": "communication buffers",
        "saved_bytes": "bytes saved for backward per dtype (a lab's own step)",
    },
    "checkpoint": {
        "step": "the step saved", "blocked_s": "seconds training waited for the save (the stall)",
        "path": "the checkpoint's file or folder (null on a rank that writes nothing)", "bytes": "bytes written",
        "snapshot_s": "async: seconds to start the snapshot", "waited_s": "async: seconds waiting for a free buffer",
        "tier": "multilevel: local", "mode": "sync, async, sharded or multilevel",
        "metric": "the loss (all ranks' mean) the keep-best rule judges",
    },
    "checkpoint_done": {
        "step": "the step whose checkpoint is now complete on disk", "path": "its file or folder",
        "bytes": "bytes written", "flush_s": "seconds the background write took",
        "finished_t": "wall-clock time the write finished", "tier": "multilevel: shared",
        "update_wait_s": "seconds the next optimizer step waited for the snapshot copy",
    },
    "preempted": {"step": "the last step done", "signal": "the signal that asked the run to stop, or peer",
                  "emergency_s": "seconds from the decision to leave to the checkpoint on disk"},
    "fault": {"kind": "what was injected (kill, raise, slow, preempt, ...)", "step": "the step it hit",
              "node": "the node it hit", "pid": "the process it hit", "source": "who injected it (inject: the course)",
              "id": "the injection's id"},
    "error": {"error": "the exception's type", "message": "its message", "traceback": "its traceback",
              "peer_failure": "true when the rank failed because a peer did"},
    "trace": {"path": "the profiler trace file", "active_steps": "steps recorded", "first_step": "the first of them"},
    "pipeline": {
        "schedule": "gpipe, 1f1b, torch-*", "micro": "micro-batches per step", "stage": "this rank's stage",
        "stages": "stages in the pipeline", "ops": "this stage's operations in order",
        "activation_peak_bytes": "the most activation memory the stage held", "peak_in_flight": "micro-batches in flight at most",
        "busy_s": "seconds the stage computed", "wall_s": "the step's wall time", "bubble": "the step's idle fraction",
        "stage_idle": "each stage's idle fraction",
    },
    "joined": {"step": "the step at which the rank joined", "members": "the hosts now in the run",
               "world_size": "ranks now", "hvd_rank": "Horovod's rank"},
    "recovered": {
        "mode": "how the run recovered", "reason": "what it recovered from", "generation": "membership generation",
        "lost": "ranks or hosts lost", "added": "hosts added", "members": "the hosts now in the run",
        "world_before": "ranks before", "world_size": "ranks now", "rank_before": "this rank's number before",
        "hvd_rank": "Horovod's rank", "failed_step": "the step that failed", "resumed_step": "the step it resumed from",
        "rolled_back_steps": "steps done again", "detected_t": "wall-clock time the failure was detected",
        "recover_s": "seconds from detection to training again", "lr_factor": "the learning rate's rescaling",
        "error": "the error that was survived",
    },
    "commit": {"step": "the step committed", "world_size": "ranks", "commit_s": "seconds the commit took"},
    "end": {
        "steps": "steps done", "final_loss": "the last step's loss, all ranks' mean",
        "eval_accuracy": "accuracy on the evaluation set at the end", "elapsed_s": "seconds from start to end",
        "rss_peak_bytes": "the process's resident peak", "device_peak_bytes": "the most GPU memory held (GPU only)",
        "reverify": "true in a grader's shortened re-run", "world_size": "ranks at the end (Horovod elastic)",
        "resets": "Horovod elastic resets", "members": "the hosts at the end (Horovod elastic)",
        "param_dtypes": "parameter dtypes (a lab's own step)", "scaler_calls": "GradScaler calls (a lab's own step)",
        "step": "the last step (a lab's interval run)",
    },
}


class EventError(ScalelabError):
    """An event the declaration does not have: an unknown type, or a field not declared for its type."""


def undeclared(event: dict) -> list[str]:
    """What in `event` (a whole line: type, rank, t and the fields) the declaration does not have; [] if nothing."""
    kind = event.get("type")
    if kind not in EVENTS:
        return [f"event type {kind!r} is not declared (scalelab/run/event_types.py: {', '.join(EVENTS)})"]
    extra = sorted(k for k in event if k not in COMMON and k not in EVENTS[kind])
    return [f"{kind!r} event field {k!r} is not declared in scalelab/run/event_types.py" for k in extra]


def strict() -> bool:
    """Whether EventWriter.emit refuses undeclared events (SCALELAB_STRICT_EVENTS=1; the test suite sets it)."""
    return os.environ.get(STRICT_ENV) == "1"


def check(event: dict) -> None:
    """Raise EventError naming what in `event` is not declared."""
    problems = undeclared(event)
    if problems:
        raise EventError("; ".join(problems) + ": declare it there first")


__all__ = ["COMMON", "EVENTS", "EventError", "STRICT_ENV", "check", "strict", "undeclared"]
