"""RunSpec: round trips, presets, and a clear error naming the field for every kind of bad input."""
from __future__ import annotations

import json

import pytest

from scalelab.run import spec as S
from scalelab.errors import SpecError
from scalelab.run.validate import RULES


def test_json_and_yaml_round_trip_give_the_same_spec(tmp_path):
    spec = S.preset("laptop").with_overrides(["optim.lr=0.2", "fault.kind=raise", "slurm.partition=gpu"])
    for name in ("s.json", "s.yaml"):
        assert S.load(spec.save(tmp_path / name)) == spec


@pytest.mark.parametrize("name", list(S.PRESETS))
def test_every_preset_is_valid(name):
    spec = S.preset(name).validate()
    assert spec.name == name


def test_presets_are_fresh_copies():
    a = S.preset("tiny")
    a.optim.lr = 9.0
    assert S.preset("tiny").optim.lr != 9.0


def test_replace_copies_nested_sections():
    a = S.preset("tiny")
    b = a.replace(name="b")
    b.world.workers_per_node = 3
    assert a.world.workers_per_node == 1


def test_every_field_has_a_validation_rule():
    keys = set()

    def walk(obj, prefix=""):
        import dataclasses
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, prefix + f.name + ".")
            else:
                keys.add(prefix + f.name)
    walk(S.RunSpec())
    assert keys == set(RULES)


_WRONG_TYPE = {int: "many", float: "fast", str: 5, bool: "yes"}


@pytest.mark.parametrize("key", sorted(RULES))
def test_a_wrong_type_names_the_field(key):
    typ, _ = RULES[key]
    with pytest.raises(SpecError) as err:
        S.preset("tiny").with_overrides({key: _WRONG_TYPE[typ]})
    assert err.value.field == key
    assert "expected" in str(err.value)


_OUT_OF_RANGE = {
    "name": "bad name!", "model.name": "resnet", "model.width": 0, "model.depth": 0, "data.source": "imagenet",
    "model.heads": -1, "model.preset": "huge", "data.seq_len": 1,
    "data.samples": 1, "data.size": 2, "data.classes": 1, "data.loader_workers": -1, "data.prefetch_factor": 0,
    "data.format": "tfrecord", "data.samples_per_shard": 0, "data.open_latency_ms": -1.0,
    "data.read_mb_per_s": float("inf"), "data.server": "no port",
    "strategy": "fsdp9", "backend": "nvlink", "device": "tpu", "world.workers_per_node": 0, "world.nodes": 0,
    "world.threads_per_worker": -1, "world.malloc": "tcmalloc",
    "world.wait": "busy", "world.spin_ms": -0.5, "launcher": "ssh", "optim.name": "adam9", "optim.batch_per_worker": 0,
    "optim.lr": 0.0, "optim.lr_scaling": "cubic", "optim.base_batch": 0, "optim.warmup_steps": -1,
    "optim.momentum": 1.0, "optim.weight_decay": -0.1, "optim.grad_accum": 0, "precision": "fp8",
    "optim.schedule": "step", "optim.min_lr_fraction": 1.5, "optim.poly_power": 0.0, "optim.comm_hook": "topk",
    "optim.kfac_factor": "sparse",
    "optim.comm_ratio": 0.0, "optim.comm_rank": 0,
    "optim.kfac_damping": 0.0, "optim.kfac_factor_every": 0, "optim.kfac_inv_every": 0, "optim.kfac_kl_clip": -1.0,
    "optim.kfac_grad_worker_fraction": 1.5,
    "checkpoint.every_steps": -1, "checkpoint.mode": "magic", "checkpoint.keep_last": 0, "checkpoint.keep_best": -1,
    "slurm.partition": "gpu\n#SBATCH --exclusive", "slurm.account": "a b", "slurm.reservation": "r;rm -rf /",
    "slurm.time": "forever", "slurm.gpus_per_node": -1, "slurm.cpus_per_task": 0, "slurm.mem": "lots",
    "fault.kind": "meteor", "fault.rank": -2, "fault.step": -1, "fault.node": -2, "fault.slow_s": -1.0,
    "fault.detect_timeout_s": 0.5, "fault.recovery": "pray", "world.max_restarts": -1, "slurm.signal": "KILL",
    "fault.phase": "network", "world.min_workers": -1, "world.commit_every": 0, "world.rejoin_s": 3601,
    "steps": 0, "epochs": -1, "seed": -5,
    "log_every": 0, "eval_every": -1, "fsdp.sharding": "zero9", "pipeline.schedule": "zigzag",
    "pipeline.micro_batches": 0, "parallel.tp": 0, "parallel.pp": 0,
    "profile.wait_steps": -1, "profile.warmup_steps": -1, "profile.active_steps": 0,
}


@pytest.mark.parametrize("key", sorted(_OUT_OF_RANGE))
def test_a_value_out_of_range_names_the_field_and_the_value(key):
    with pytest.raises(SpecError) as err:
        S.preset("tiny").with_overrides({key: _OUT_OF_RANGE[key]})
    assert err.value.field == key
    value = _OUT_OF_RANGE[key]
    shown = {repr(value)} | ({repr(float(value))} if isinstance(value, (int, float)) else set())
    assert any(text in str(err.value) for text in shown)


def test_ranged_fields_are_all_covered_by_the_out_of_range_test():
    free_text = {"data.path", "output_dir", "data.pin_memory", "checkpoint.resume", "data.compress",
                 "fsdp.reshard_after_forward", "fsdp.offload", "model.activation_checkpointing", "model.compile",
                 "optim.fused",
                 "checkpoint.on_signal", "slurm.requeue", "checkpoint.local_dir",
                 "profile.enabled", "profile.record_shapes", "profile.profile_memory", "profile.with_stack",
                 "optim.comm_error_feedback"}
    assert set(RULES) - free_text == set(_OUT_OF_RANGE)


def test_a_choice_error_lists_what_is_allowed():
    with pytest.raises(SpecError, match="must be one of ddp, horovod"):
        S.preset("tiny").with_overrides(["strategy=zero"])


@pytest.mark.parametrize("changes, field, words", [
    ({"world.nodes": 2}, "world.nodes", "launcher slurm"),
    ({"strategy": "horovod"}, "launcher", "horovodrun"),
    ({"launcher": "horovodrun"}, "launcher", "strategy=horovod"),
    ({"backend": "mpi"}, "backend", "gloo"),
    ({"backend": "nccl", "device": "cpu"}, "backend", "GPUs"),
    ({"precision": "fp16", "device": "cpu"}, "precision", "bf16"),
    ({"optim.warmup_steps": 50, "steps": 10}, "optim.warmup_steps", "steps=10"),
    ({"optim.comm_hook": "fp16", "strategy": "horovod", "launcher": "horovodrun"}, "optim.comm_hook", "strategy=ddp"),
    ({"data.samples": 16, "optim.batch_per_worker": 32}, "data.samples", "global batch"),
    ({"data.source": "path"}, "data.path", ".npz"),
    ({"data.source": "path", "data.path": "x.csv"}, "data.path", ".npz"),
    ({"fault.kind": "raise", "fault.rank": 3}, "fault.rank", "the run has 1 ranks"),
    ({"model.name": "transformer", "data.size": 18}, "data.size", "multiple of 4"),
    ({"data.compress": True, "data.format": "files"}, "data.compress", "data.format=shards"),
    ({"data.open_latency_ms": 5.0}, "data.format", "files, shards or hdf5"),
    ({"checkpoint.mode": "sharded", "strategy": "horovod", "launcher": "horovodrun"}, "checkpoint.mode", "ddp"),
])
def test_cross_field_errors_name_the_option_to_change(changes, field, words):
    with pytest.raises(SpecError) as err:
        S.preset("tiny").with_overrides(changes)
    assert err.value.field == field
    assert words in str(err.value)


def test_unknown_fields_are_rejected_with_the_known_ones():
    with pytest.raises(SpecError, match="known fields of optim: name, batch_per_worker"):
        S.from_dict({"optim": {"learning_rate": 0.1}})
    with pytest.raises(SpecError) as err:
        S.preset("tiny").with_overrides(["optimizer.lr=1"])
    assert err.value.field == "optimizer.lr"


@pytest.mark.parametrize("text, words", [("optim.lr", "key=value"), ("world=2", "is a group"),
                                         ("steps.x=1", "not a group")])
def test_malformed_set_assignments(text, words):
    with pytest.raises(SpecError, match=words):
        S.preset("tiny").with_overrides([text])


def test_set_parses_values_by_type():
    spec = S.preset("tiny").with_overrides(["optim.lr=1e-2", "data.pin_memory=true", "name=123", "steps=7"])
    assert spec.optim.lr == 0.01 and spec.data.pin_memory is True and spec.name == "123" and spec.steps == 7


def test_an_int_is_accepted_where_a_float_is_expected():
    assert S.preset("tiny").with_overrides(["optim.lr=1"]).optim.lr == 1.0


def test_unreadable_and_unparseable_files_say_which(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="bad.json is not valid JSON"):
        S.load(bad)
    with pytest.raises(SpecError, match="cannot read"):
        S.load(tmp_path / "missing.yaml")
    listy = tmp_path / "list.json"
    listy.write_text(json.dumps([1, 2]))
    with pytest.raises(SpecError, match="expected a mapping"):
        S.load(listy)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(SpecError, match="tiny, laptop, gpu-node, multi-node"):
        S.preset("huge")


def test_global_batch_and_world_size():
    spec = S.preset("tiny").with_overrides(["world.workers_per_node=2", "optim.grad_accum=3"])
    assert spec.world_size == 2 and spec.global_batch == 16 * 3 * 2
