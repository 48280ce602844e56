"""Field-by-field checks of a RunSpec: each error names the field, the value, and what is allowed."""
from __future__ import annotations

import math
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

from ..errors import SpecError
from .field_groups import GPT_PRESETS
from .combinations import (fsdp_checks, gloo_cannot_run, horovod_elastic, kfac_checks, mesh_checks,
                           profile_checks, resilience_checks)

# The allowed values of every choice field: owned here, re-exported by scalelab.run.spec.
MODELS = ("cnn", "mlp", "transformer", "gpt")
DATA_SOURCES = ("heat", "digits", "path", "pysrc")
STRATEGIES = ("ddp", "horovod", "fsdp", "pp", "tp", "3d")
SCHEDULES = ("gpipe", "1f1b", "torch-gpipe", "torch-1f1b", "torch-interleaved")  # pipeline.schedule; or module:function
SHARDINGS = ("full", "grad_op", "none")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
LAUNCHERS = ("local", "torchrun", "slurm", "srun", "horovodrun", "mpirun")
OPTIMIZERS = ("sgd", "adamw", "lars", "lamb", "kfac")
LR_SCALING = ("none", "linear", "sqrt")
LR_SCHEDULES = ("constant", "cosine", "poly")
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")
CODE_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}(\.[A-Za-z_][A-Za-z0-9_]{0,63}){0,4}:[A-Za-z_][A-Za-z0-9_]{0,63}$")
PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINT_MODES = ("sync", "async", "sharded", "multilevel")
DATA_FORMATS = ("memory", "files", "shards", "hdf5")
DEVICES = ("auto", "cpu", "cuda")
FAULT_KINDS = ("none", "raise", "exit", "kill", "hang", "slow")
RECOVERIES = ("fail", "forward")
FAULT_PHASES = ("step", "data", "compute")
SIGNALS = re.compile(r"^$|^(USR1|USR2|TERM|INT|HUP)@\d{1,5}$")
MALLOC_POLICIES = ("retain", "system")
WAITS = ("auto", "spin", "block")
WALLTIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}(:\d{2})?$|^\d+$")
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.\-]*$")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_ADDRESS = re.compile(r"^$|^[A-Za-z0-9_.\-]{1,253}:[0-9]{1,5}$")  # data.server: empty or host:port
_MEM = re.compile(r"^$|^\d+[KMGT]?$")


def _choice(options):
    def check(v):
        if v not in options:
            return f"must be one of {', '.join(options)}"
    return check


def _choice_or_code(options):
    def check(v):
        if v not in options and not CODE_REF.match(v):
            return (f"must be one of {', '.join(options)}, or module:function naming code of your own "
                    "(e.g. my_hooks:topk_hook, from my_hooks.py beside the notebook)")
    return check


def _int_at_least(low, high=None):
    def check(v):
        if v < low:
            return f"must be at least {low}"
        if high is not None and v > high:
            return f"must be at most {high}"
    return check


def _positive_float(v):
    if not math.isfinite(v) or v <= 0:
        return "must be a finite number > 0"


def _unit_interval(v):
    if not math.isfinite(v) or not 0 <= v < 1:
        return "must be in [0, 1)"


def _non_negative_float(v):
    if not math.isfinite(v) or v < 0:
        return "must be a finite number >= 0"


def _bounded_float(low, high):
    def check(v):
        if not math.isfinite(v) or not low <= v <= high:
            return f"must be a number from {low:g} to {high:g}"
    return check


def _regex(pattern, what):
    def check(v):
        if not pattern.match(v):
            return f"must be {what}"
    return check


# (type, rule) per dotted field. bool is checked before int because bool is an int subclass.
RULES = {
    "name": (str, _regex(_NAME, "1-64 letters, digits, '-', '_' or '.', starting with a letter or digit")),
    "model.name": (str, _choice(MODELS)),
    "model.width": (int, _int_at_least(1, 8192)),  # 8192: lab 06's GPU-node checkpoints (about 1 GB)
    "model.depth": (int, _int_at_least(1, 64)),
    "model.heads": (int, _int_at_least(0, 256)),
    "model.preset": (str, _choice(("", *GPT_PRESETS))),
    "model.activation_checkpointing": (bool, None),
    "model.compile": (bool, None),
    "data.source": (str, _choice(DATA_SOURCES)),
    "data.path": (str, None),
    "data.samples": (int, _int_at_least(8, 10_000_000)),
    "data.seq_len": (int, _int_at_least(2, 65_536)),
    "data.size": (int, _int_at_least(4, 1024)),
    "data.classes": (int, _int_at_least(2, 64)),
    "data.loader_workers": (int, _int_at_least(0, 64)),
    "data.prefetch_factor": (int, _int_at_least(1, 64)),
    "data.pin_memory": (bool, None),
    "data.format": (str, _choice(DATA_FORMATS)),
    "data.samples_per_shard": (int, _int_at_least(1, 1_000_000)),
    "data.compress": (bool, None),
    "data.open_latency_ms": (float, _bounded_float(0.0, 10_000.0)),
    "data.read_mb_per_s": (float, _bounded_float(0.0, 1e6)),
    "data.server": (str, _regex(_ADDRESS, "empty or host:port (a storage server's address)")),
    "strategy": (str, _choice(STRATEGIES)),
    "backend": (str, _choice(BACKENDS)),
    "device": (str, _choice(DEVICES)),
    "world.workers_per_node": (int, _int_at_least(1, 1024)),
    "world.nodes": (int, _int_at_least(1, 4096)),
    "world.threads_per_worker": (int, _int_at_least(0, 1024)),
    "world.malloc": (str, _choice(MALLOC_POLICIES)),
    "world.wait": (str, _choice(WAITS)),
    "world.spin_ms": (float, _bounded_float(0.0, 1000.0)),
    "world.max_restarts": (int, _int_at_least(0, 100)),
    "world.min_workers": (int, _int_at_least(0, 1024)),
    "world.commit_every": (int, _int_at_least(1, 1_000_000)),
    "world.rejoin_s": (int, _int_at_least(0, 3600)),
    "launcher": (str, _choice(LAUNCHERS)),
    "optim.name": (str, _choice(OPTIMIZERS)),
    "optim.batch_per_worker": (int, _int_at_least(1, 1_000_000)),
    "optim.lr": (float, _positive_float),
    "optim.lr_scaling": (str, _choice(LR_SCALING)),
    "optim.base_batch": (int, _int_at_least(1)),
    "optim.warmup_steps": (int, _int_at_least(0)),
    "optim.schedule": (str, _choice_or_code(LR_SCHEDULES)),
    "optim.min_lr_fraction": (float, _bounded_float(0.0, 1.0)),
    "optim.poly_power": (float, _positive_float),
    "optim.comm_hook": (str, _choice_or_code(COMM_HOOKS)),
    "optim.kfac_factor": (str, _choice_or_code(("dense",))),
    "optim.comm_ratio": (float, _bounded_float(1e-6, 1.0)),
    "optim.comm_error_feedback": (bool, None),
    "optim.comm_rank": (int, _int_at_least(1, 64)),
    "optim.momentum": (float, _unit_interval),
    "optim.weight_decay": (float, _non_negative_float),
    "optim.fused": (bool, None),
    "optim.grad_accum": (int, _int_at_least(1, 1024)),
    "optim.kfac_damping": (float, _positive_float),
    "optim.kfac_factor_every": (int, _int_at_least(1, 100_000)),
    "optim.kfac_inv_every": (int, _int_at_least(1, 100_000)),
    "optim.kfac_kl_clip": (float, _non_negative_float),
    "optim.kfac_grad_worker_fraction": (float, _bounded_float(0.0, 1.0)),
    "precision": (str, _choice(PRECISIONS)),
    "checkpoint.every_steps": (int, _int_at_least(0)),
    "checkpoint.mode": (str, _choice(CHECKPOINT_MODES)),
    "checkpoint.keep_last": (int, _int_at_least(1, 1000)),
    "checkpoint.keep_best": (int, _int_at_least(0, 1000)),
    "checkpoint.resume": (bool, None),
    "checkpoint.on_signal": (bool, None),
    "checkpoint.local_dir": (str, None),
    "slurm.partition": (str, _regex(SLURM_WORD, "a Slurm name (letters, digits, '_', '.', '-')")),
    "slurm.account": (str, _regex(SLURM_WORD, "a Slurm name (letters, digits, '_', '.', '-')")),
    "slurm.reservation": (str, _regex(SLURM_WORD, "a Slurm name (letters, digits, '_', '.', '-')")),
    "slurm.time": (str, _regex(WALLTIME, "a Slurm time: minutes, HH:MM:SS or D-HH:MM:SS")),
    "slurm.gpus_per_node": (int, _int_at_least(0, 64)),
    "slurm.cpus_per_task": (int, _int_at_least(1, 1024)),
    "slurm.mem": (str, _regex(_MEM, "empty or a size like 4G, 500M")),
    "slurm.signal": (str, _regex(SIGNALS, "empty or SIG@SECONDS with SIG one of USR1, USR2, TERM, INT, HUP, e.g. USR1@60")),
    "slurm.requeue": (bool, None),
    "fault.kind": (str, _choice(FAULT_KINDS)),
    "fault.rank": (int, _int_at_least(-1)),
    "fault.step": (int, _int_at_least(0)),
    "fault.node": (int, _int_at_least(-1)),
    "fault.slow_s": (float, _bounded_float(0.0, 3600.0)),
    "fault.phase": (str, _choice(FAULT_PHASES)),
    "fault.detect_timeout_s": (float, _bounded_float(1.0, 86_400.0)),
    "fault.recovery": (str, _choice(RECOVERIES)),
    "fsdp.sharding": (str, _choice(SHARDINGS)),
    "fsdp.reshard_after_forward": (bool, None),
    "fsdp.offload": (bool, None),
    "pipeline.schedule": (str, _choice_or_code(SCHEDULES)),
    "pipeline.micro_batches": (int, _int_at_least(1, 1024)),
    "parallel.tp": (int, _int_at_least(1, 1024)),
    "parallel.pp": (int, _int_at_least(1, 1024)),
    "profile.enabled": (bool, None),
    "profile.wait_steps": (int, _int_at_least(0, 100_000)),
    "profile.warmup_steps": (int, _int_at_least(0, 100_000)),
    "profile.active_steps": (int, _int_at_least(1, 1000)),
    "profile.record_shapes": (bool, None),
    "profile.profile_memory": (bool, None),
    "profile.with_stack": (bool, None),
    "steps": (int, _int_at_least(1, 10_000_000)),
    "epochs": (int, _int_at_least(0, 100_000)),
    "seed": (int, _int_at_least(0, 2**31 - 1)),
    "output_dir": (str, None),
    "log_every": (int, _int_at_least(1)),
    "eval_every": (int, _int_at_least(0)),
}


def _walk(obj, prefix=""):
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from _walk(value, key + ".")
        else:
            yield key, value


def _type_error(key, value, typ):
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return SpecError(key, f"got {value!r} ({type(value).__name__}); expected {names[typ]}")


def check_field(key: str, value):
    """Check one field's type and range; returns the (possibly int->float widened) value."""
    typ, rule = RULES[key]
    if typ is bool:
        if not isinstance(value, bool):
            raise _type_error(key, value, typ)
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, value, typ)
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(key, value, typ)
        value = float(value)
    elif not isinstance(value, typ):
        raise _type_error(key, value, typ)
    problem = rule(value) if rule else None
    if problem:
        raise SpecError(key, f"got {value!r}; {problem}")
    return value


def validate_spec(spec) -> None:
    """Check every field, then the rules that tie fields together."""
    seen = set()
    for key, value in _walk(spec):
        if key not in RULES:  # a field without a rule is a bug in scalelab, not in the spec
            raise AssertionError(f"RunSpec field {key} has no validation rule")
        new = check_field(key, value)
        if new is not value:
            _set(spec, key, new)
        seen.add(key)
    _cross_checks(spec)


def _set(spec, key, value):
    *path, last = key.split(".")
    obj = spec
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, value)


def _cross_checks(spec) -> None:
    """Fields that must agree with each other, checked in this order (the first disagreement is the error)."""
    _placement_checks(spec)
    _optim_model_checks(spec)
    resilience_checks(spec)
    _data_checks(spec)
    fsdp_checks(spec)
    kfac_checks(spec)
    mesh_checks(spec)
    profile_checks(spec)
    _memory_checks(spec)
    gpt_checks(spec)
    _update_checks(spec)


def _placement_checks(spec) -> None:
    """The data file, and where and how the ranks run: nodes and launcher, strategy, backend, device, precision."""
    if spec.data.source == "path":
        if not spec.data.path:
            raise SpecError("data.path", "is empty but data.source is 'path'; give a .npz file with arrays x and y")
        if not Path(spec.data.path).suffix == ".npz":
            raise SpecError("data.path", f"got {spec.data.path!r}; expected a .npz file with arrays x (N,C,H,W) and y (N,)")
    if spec.world.nodes > 1 and spec.launcher not in ("slurm", "srun", "mpirun") and not horovod_elastic(spec):
        raise SpecError("world.nodes", f"got {spec.world.nodes}; more than one node needs launcher slurm (srun "
                                       f"inside an allocation, or mpirun with a hostfile), not {spec.launcher!r}")
    if spec.strategy == "horovod" and spec.launcher in ("local", "torchrun"):
        raise SpecError("launcher", f"got {spec.launcher!r} with strategy 'horovod'; Horovod ranks are started by "
                                    "horovodrun, mpirun or slurm")
    if spec.strategy == "ddp" and spec.launcher == "horovodrun":
        raise SpecError("launcher", "got 'horovodrun' with strategy 'ddp'; use local, torchrun, mpirun or slurm "
                                    "for ddp, or set strategy=horovod")
    if spec.backend == "mpi" and spec.strategy != "horovod":
        raise SpecError("backend", "got 'mpi' with strategy 'ddp'; torch's CPU wheel has no MPI backend: use gloo "
                                   "(CPU) or nccl (GPU), or set strategy=horovod")
    if spec.backend == "nccl" and spec.device == "cpu":
        raise SpecError("backend", "got 'nccl' with device 'cpu'; NCCL needs GPUs: use backend=gloo or auto")
    if spec.backend == "gloo" and spec.device == "cuda" and spec.world_size > 1:
        if why := gloo_cannot_run(spec):
            raise SpecError("backend", f"got 'gloo' with device 'cuda': {why}; use backend=nccl or auto (a GPU per rank), or device=cpu")
    if spec.precision == "fp16" and spec.device == "cpu":
        raise SpecError("precision", "got 'fp16' with device 'cpu'; CPU autocast supports bf16: use precision=bf16")


def _optim_model_checks(spec) -> None:
    """The communication hook, the warm-up and the transformer's patches."""
    if spec.optim.comm_hook != "allreduce" and spec.strategy != "ddp":
        raise SpecError("optim.comm_hook", f"got {spec.optim.comm_hook!r} with strategy {spec.strategy!r}; a "
                                           "communication hook is DDP's: set strategy=ddp or comm_hook=allreduce")
    if spec.optim.comm_hook == "powersgd" and spec.backend == "nccl" and spec.precision != "fp32":
        raise SpecError("optim.comm_hook", "powersgd compresses fp32 gradients: use precision=fp32 with it")
    if spec.optim.warmup_steps > max(spec.steps, 1) and spec.epochs == 0:
        raise SpecError("optim.warmup_steps", f"got {spec.optim.warmup_steps}, more than steps={spec.steps}; "
                                              "lower it or raise steps")
    if spec.model.name == "transformer" and spec.data.source == "heat" and spec.data.size % 4:
        raise SpecError("data.size", f"got {spec.data.size}; the transformer cuts 4x4 patches, so it must be a "
                                     "multiple of 4")


def _data_checks(spec) -> None:
    """The injected fault's rank and the data's size, format and storage server."""
    if spec.fault.kind != "none" and spec.fault.rank >= spec.world_size:
        raise SpecError("fault.rank", f"got {spec.fault.rank}, but the run has {spec.world_size} ranks (0.."
                                      f"{spec.world_size - 1})")
    if spec.data.source in ("heat", "pysrc") and spec.data.samples < spec.global_batch:
        raise SpecError("data.samples", f"got {spec.data.samples}, fewer than one global batch "
                                        f"({spec.global_batch} = batch_per_worker x grad_accum x world size); "
                                        "raise data.samples or lower optim.batch_per_worker")
    if spec.data.compress and spec.data.format != "shards":
        raise SpecError("data.compress", f"is only used with data.format=shards, not {spec.data.format!r}: set "
                                         "data.format=shards or data.compress=false")
    if spec.data.format == "memory" and (spec.data.open_latency_ms or spec.data.read_mb_per_s):
        raise SpecError("data.format", "is 'memory', but data.open_latency_ms / data.read_mb_per_s simulate a file "
                                       "system: set data.format to files, shards or hdf5")
    if spec.data.server and spec.data.format == "memory":
        raise SpecError("data.server", f"got {spec.data.server!r}, but data.format is 'memory': a storage server "
                                       "serves a layout on disk; set data.format to files, shards or hdf5")


def _memory_checks(spec) -> None:
    """Activation checkpointing exists for the transformer and the gpt only."""
    if spec.model.activation_checkpointing and spec.model.name not in ("transformer", "gpt"):
        raise SpecError("model.activation_checkpointing", f"is implemented for the transformer's encoder layers "
                                                          f"and the gpt's blocks, not model.name="
                                                          f"{spec.model.name!r}: set model.name=transformer or gpt, "
                                                          "or activation_checkpointing=false")


def _update_checks(spec) -> None:
    """The fused AdamW update, sharded checkpoints and the digits' classes."""
    if spec.optim.fused and spec.optim.name != "adamw":
        raise SpecError("optim.fused", f"got true with optim.name={spec.optim.name!r}; the fused update is AdamW's: "
                                       "set optim.name=adamw or optim.fused=false")
    if spec.checkpoint.mode == "sharded" and spec.strategy == "horovod":
        raise SpecError("checkpoint.mode", f"got 'sharded' with strategy {spec.strategy!r}; torch.distributed."
                                           "checkpoint needs torch.distributed ranks: use strategy=ddp or mode=async")
    if spec.data.source == "digits" and spec.data.classes != type(spec.data).classes and spec.data.classes != 10:
        raise SpecError("data.classes", f"got {spec.data.classes}; digits has 10 classes (leave it at the default)")




def gpt_checks(spec) -> None:
    """The language model: bytes of Python source to read, heads that divide the width; its fields (heads, preset,
    compile) only with it."""
    m, gpt = spec.model, spec.model.name == "gpt"
    if gpt != (spec.data.source == "pysrc"):
        raise SpecError("data.source" if gpt else "model.name",
                        f"got model.name={m.name!r} with data.source={spec.data.source!r}; the gpt reads bytes of "
                        "text (data.source=pysrc) and pysrc feeds only the gpt: set both or neither")
    if not gpt:
        for name, default in (("heads", 0), ("preset", ""), ("compile", False)):
            if getattr(m, name) != default:
                raise SpecError(f"model.{name}", f"got {getattr(m, name)!r}, but it is only used by model.name=gpt: "
                                                 f"set model.name=gpt or leave model.{name}={default!r}")
        return
    width, _, heads = m.shape()
    if width % heads:
        raise SpecError("model.heads", f"got {heads} heads for width {width}: the heads must divide the width")
