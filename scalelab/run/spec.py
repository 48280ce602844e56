"""RunSpec: what to run, as one validated, serialisable value.

A lab cell, a widget, the CLI and a batch job all describe a run with a `RunSpec`; launchers turn it
into processes, and every worker reads the same spec back from `<output_dir>/spec.json`.

    spec = preset("tiny").replace(strategy="horovod", launcher="horovodrun")
    spec = spec.with_overrides(["optim.lr=0.05", "world.workers_per_node=2"])
    spec.validate()            # raises SpecError naming the field, the value and what is allowed

Every field is checked by `validate()`; `from_dict` rejects unknown keys with the list of known ones.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import SpecError
from .validate import (validate_spec, MODELS, DATA_SOURCES, STRATEGIES, BACKENDS, LAUNCHERS, OPTIMIZERS,
                       LR_SCALING, PRECISIONS, CHECKPOINT_MODES, DATA_FORMATS, DEVICES, FAULT_KINDS, MALLOC_POLICIES, WAITS,
                       SHARDINGS, SCHEDULES)  # noqa: F401 - re-exported
# the field groups, also importable from here, where code has always found them
from .field_groups import (ModelSpec, DataSpec, WorldSpec, OptimSpec, CheckpointSpec, FaultSpec,  # noqa: F401
                           FSDPSpec, PipelineSpec, ParallelSpec, ProfileSpec, SlurmSpec)


@dataclass
class RunSpec:
    """One training run: model, data, strategy, world, launcher, optimisation and bookkeeping."""

    name: str = "run"
    """A short name for the run: letters, digits, '-', '_' or '.'."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The network."""
    data: DataSpec = field(default_factory=DataSpec)
    """The data and its loader."""
    strategy: str = "ddp"
    """ddp (torch DistributedDataParallel), horovod, fsdp (FSDP2: state sharded over the ranks, see fsdp) or pp
    (the mlp or transformer cut into one pipeline stage per rank, see pipeline) or tp (its layers split over the
    ranks: column/row, attention heads) or 3d (data x pipeline x tensor parallel on one mesh, see parallel)."""
    backend: str = "auto"
    """auto (nccl with CUDA, gloo without), gloo, nccl, or mpi (Horovod's MPI controller)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    world: WorldSpec = field(default_factory=WorldSpec)
    """Ranks and nodes."""
    launcher: str = "local"
    """local, torchrun, slurm, horovodrun or mpirun."""
    optim: OptimSpec = field(default_factory=OptimSpec)
    """Optimizer and learning-rate schedule."""
    precision: str = "fp32"
    """fp32, bf16 (autocast; CPU or GPU) or fp16 (autocast + grad scaling; GPU only)."""
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    """Checkpoint policy."""
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    """Batch options for the slurm launcher."""
    fault: FaultSpec = field(default_factory=FaultSpec)
    """An injected fault (off by default)."""
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    """Sharding of strategy fsdp (ignored by the others)."""
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    """Schedule and micro-batches of strategies pp and 3d (ignored by the others)."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """tp x pp of strategy 3d (ignored by the others; dp is what the world size leaves)."""
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    """Profiler traces per rank (off by default)."""
    steps: int = 20
    """Optimizer steps to run (ignored when epochs > 0)."""
    epochs: int = 0
    """Passes over the data; 0: run `steps` steps."""
    seed: int = 0
    """Seed for data generation, model init and shuffling (same on every rank)."""
    output_dir: str = ""
    """Where spec.json, events/, logs/ and checkpoints go; empty: runs/<name>-<time> under the cwd."""
    log_every: int = 1
    """Write a step event every N steps."""
    eval_every: int = 0
    """Measure held-out accuracy every N steps and write an `eval` event (step, accuracy); 0: only at the end."""

    # -- construction -------------------------------------------------------------------------
    def replace(self, **changes) -> "RunSpec":
        """A copy with top-level fields changed (nested specs are copied, never shared)."""
        return dataclasses.replace(from_dict(self.to_dict()), **changes)

    def with_overrides(self, assignments: list[str] | dict[str, Any]) -> "RunSpec":
        """A copy with dotted `key=value` overrides applied (the CLI's --set), then validated."""
        data = self.to_dict()
        from_text = not isinstance(assignments, dict)
        items = (_split_assignment(a) for a in assignments) if from_text else assignments.items()
        for key, value in items:
            _assign(data, key, value, from_text)
        spec = from_dict(data)
        spec.validate()
        return spec

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML-ready)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def to_yaml(self) -> str:
        """YAML text."""
        import yaml
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        """Write as JSON (or YAML for .yaml/.yml) and return the path."""
        path = Path(path)
        text = self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json()
        path.write_text(text)
        return path

    # -- derived facts ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Total ranks."""
        return self.world.workers_per_node * self.world.nodes

    @property
    def mesh(self) -> tuple[int, int, int]:
        """(dp, tp, pp): data-parallel replicas, tensor-parallel ranks per group, pipeline stages. tp and pp use
        the whole world (dp = 1); 3d reads `parallel` (dp = world size / (tp x pp), at least 1); others are dp."""
        w = self.world_size
        if self.strategy == "tp":
            return 1, w, 1
        if self.strategy == "pp":
            return 1, 1, w
        if self.strategy == "3d":
            return max(w // (self.parallel.tp * self.parallel.pp), 1), self.parallel.tp, self.parallel.pp
        return w, 1, 1

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: batch_per_worker x grad_accum x data-parallel replicas
        (the ranks of one replica's pipeline stages and tensor-parallel groups share its batch)."""
        return self.optim.batch_per_worker * self.optim.grad_accum * self.mesh[0]

    def validate(self) -> "RunSpec":
        """Check every field; raise SpecError naming the first bad one. Returns self."""
        validate_spec(self)
        return self


# -- dict / file round trip -----------------------------------------------------------------------
_NESTED = {"model": ModelSpec, "data": DataSpec, "world": WorldSpec, "optim": OptimSpec,
           "checkpoint": CheckpointSpec, "slurm": SlurmSpec, "fault": FaultSpec, "fsdp": FSDPSpec,
           "pipeline": PipelineSpec, "parallel": ParallelSpec, "profile": ProfileSpec}


def _build(cls, data: Any, prefix: str):
    if isinstance(data, cls):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise SpecError(prefix or "spec", f"expected a mapping of fields, got {type(data).__name__} {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise SpecError(where, f"unknown field; known fields{' of ' + prefix if prefix else ''}: {', '.join(known)}")
    kwargs = {}
    for name, value in data.items():
        sub = _NESTED.get(name) if cls is RunSpec else None
        kwargs[name] = _build(sub, value, name) if sub else value
    return cls(**kwargs)


def from_dict(data: dict) -> RunSpec:
    """Build a RunSpec from a nested dict; unknown keys are an error (types are checked by validate)."""
    return _build(RunSpec, data, "")


def load(path: str | Path) -> RunSpec:
    """Read a RunSpec from a JSON or YAML file and validate it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError("spec", f"cannot read {path}: {e.strerror}") from e
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml and json raise different types; both mean "not parseable"
        raise SpecError("spec", f"{path} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from e
    spec = from_dict(data)
    spec.validate()
    return spec


# -- --set key=value ------------------------------------------------------------------------------
def _split_assignment(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise SpecError(text, "expected key=value, e.g. optim.lr=0.1 or world.workers_per_node=2")
    key, raw = text.split("=", 1)
    return key.strip(), _parse_value(raw.strip())


def _parse_value(raw: str) -> Any:
    import yaml
    for number in (int, float):  # YAML 1.1 reads "1e-2" as a string
        try:
            return number(raw)
        except ValueError:
            pass
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _assign(data: dict, key: str, value: Any, from_text: bool) -> None:
    parts = key.split(".")
    target = data
    for i, part in enumerate(parts[:-1]):
        if not isinstance(target.get(part), dict):
            raise SpecError(key, f"{'.'.join(parts[: i + 1])!r} is not a group of fields; groups: {', '.join(_NESTED)}")
        target = target[part]
    last = parts[-1]
    if last not in target:
        where = ".".join(parts[:-1])
        raise SpecError(key, f"unknown field; known fields{' of ' + where if where else ''}: {', '.join(target)}")
    if isinstance(target[last], dict):
        raise SpecError(key, f"is a group; set one of its fields, e.g. {key}.{next(iter(target[last]))}=...")
    # --set name=123 means the string "123": text parsed as YAML is turned back into a string for str fields
    if from_text and isinstance(target[last], str) and not isinstance(value, str):
        value = str(value) if not isinstance(value, bool) else str(value).lower()
    target[last] = value


# -- presets --------------------------------------------------------------------------------------
def _tiny() -> RunSpec:
    return RunSpec(name="tiny", model=ModelSpec("cnn", width=8, depth=2),
                   data=DataSpec("heat", samples=512, size=16, classes=4),
                   optim=OptimSpec(batch_per_worker=16, lr=0.05), steps=20)


def _laptop() -> RunSpec:
    return RunSpec(name="laptop", model=ModelSpec("cnn", width=32, depth=3),
                   data=DataSpec("heat", samples=4096, size=32, classes=4),
                   optim=OptimSpec(batch_per_worker=32, lr=0.05), steps=200,
                   world=WorldSpec(workers_per_node=2))


def _gpu_node() -> RunSpec:
    return RunSpec(name="gpu-node", model=ModelSpec("cnn", width=64, depth=4),
                   data=DataSpec("heat", samples=65536, size=64, classes=8, loader_workers=4, pin_memory=True),
                   optim=OptimSpec(batch_per_worker=256, lr=0.1, lr_scaling="linear", base_batch=256, warmup_steps=50),
                   precision="bf16", device="cuda", steps=1000,
                   world=WorldSpec(workers_per_node=4), launcher="torchrun")


def _multi_node() -> RunSpec:
    spec = _gpu_node()
    return spec.replace(name="multi-node", world=WorldSpec(workers_per_node=4, nodes=2), launcher="slurm",
                        slurm=SlurmSpec(gpus_per_node=4, cpus_per_task=8, time="00:30:00"))


PRESETS = {"tiny": _tiny, "laptop": _laptop, "gpu-node": _gpu_node, "multi-node": _multi_node}
"""Named starting points: tiny (CI on CPU, seconds), laptop, gpu-node, multi-node."""


def preset(name: str = "tiny") -> RunSpec:
    """A fresh copy of a named preset."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise SpecError("preset", f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
