"""Pipeline schedules in the engine (strategy pp): a schedule of the student's own (`pipeline.schedule =
"module:function"`) is checked before the first step (complete, in order, no deadlock: refused naming the field,
never a hang), runs on every stage from the run's code/ folder, and its activation memory is measured in bytes
(saved-tensor hooks) per stage per step; torch.distributed.pipelining's GPipe and 1F1B run on the same stages to
the same losses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scalelab.errors import RunFailed, SpecError
from scalelab.grade.evidence import RUNS, run_evidence
from scalelab.launch import launch
from scalelab.train.pipeline import LiveSavedBytes, builtin_ops, check_plan, plan_schedule

from helpers import tiny

MLP = {"model.name": "mlp", "model.width": 64, "model.depth": 3, "steps": 2, "optim.batch_per_worker": 32,
       "strategy": "pp", "pipeline.micro_batches": 4}

SCHEDULES = '''
def one_f_one_b(stage, stages, micro):
    warm = min(stages - stage - 1, micro)
    ops = [("F", i) for i in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(micro - warm, micro)]


def warm_by_stage(stage, stages, micro):  # the warm-up counted from the wrong end: stage 0 waits for B0 at once
    warm = min(stage, micro)
    ops = [("F", i) for i in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(micro - warm, micro)]
'''


@pytest.mark.parametrize("stages, micro", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_the_builtin_schedules_pass_the_check(stages, micro):
    for name in ("gpipe", "1f1b"):
        assert plan_schedule(name, stages, micro) == [builtin_ops(name, s, stages, micro) for s in range(stages)]


@pytest.mark.parametrize("plan, words", [
    ([[("F", 0), ("B", 0)], [("F", 0)]], "stage 1 never runs B0"),
    ([[("F", 0), ("F", 0), ("B", 0)], [("F", 0), ("B", 0)]], "runs F0 twice"),
    ([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], "B0 before F0"),
    ([[("F", 0), ("X", 0), ("B", 0)], [("F", 0), ("B", 0)]], "operation 1 is ('X', 0)"),
    ([[("F", 1), ("F", 0), ("B", 0), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]],
     "order [1, 0] but stage 1 in the order [0, 1]"),
    ([builtin_ops("1f1b", 1, 2, 3), builtin_ops("1f1b", 0, 2, 3)], "would deadlock: stage 0 at B0, stage 1 at F1"),
])
def test_a_bad_plan_is_refused_naming_the_field(plan, words):
    micro = 1 + max(i for ops in plan for _, i in ops)
    with pytest.raises(SpecError) as err:
        check_plan(plan, micro, "mine")
    assert err.value.field == "pipeline.schedule" and words in str(err.value)


def test_saved_tensor_bytes_follow_the_micro_batches_alive():
    """Four forwards then four backwards hold four micro-batches' saved tensors at once; forward-backward pairs
    hold one; the layer's weights are not counted."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    xs = [torch.randn(4, 32, requires_grad=True) for _ in range(4)]

    def peak(order):
        with LiveSavedBytes(net) as live:
            outs = {}
            for op, i in order:
                if op == "F":
                    outs[i] = net(xs[i]).square().sum()
                else:
                    outs.pop(i).backward()
        assert live.bytes == 0
        return live.peak

    one = peak([("F", 0), ("B", 0)])
    assert one >= 4 * 4 * (32 + 64)  # at least each layer's input, fp32
    assert peak(builtin_ops("gpipe", 0, 2, 4)) == 4 * one
    assert peak(builtin_ops("1f1b", 0, 2, 4)) == 2 * one


def test_a_student_schedule_and_torchs_run_to_gpipes_losses_with_their_own_activation_bytes(tmp_path, monkeypatch):
    (tmp_path / "my_pipe.py").write_text(SCHEDULES)
    monkeypatch.chdir(tmp_path)  # the launcher copies my_pipe.py from the launching folder into the run's code/
    runs = {schedule.replace(":", "-"): launch(tiny(tmp_path, schedule.replace(":", "-"), workers=2, **MLP,
                                                    **{"pipeline.schedule": schedule}))
            for schedule in ("gpipe", "my_pipe:one_f_one_b", "torch-gpipe", "torch-1f1b")}  # side by side
    summaries = {name: run.wait(timeout=180) for name, run in runs.items()}
    for name, summary in summaries.items():
        assert summary["loss_curve"] == pytest.approx(summaries["gpipe"]["loss_curve"], rel=1e-5, abs=1e-6), name
    found = run_evidence(tmp_path)[RUNS]
    pipe = {name: found[name]["pipeline"] for name in summaries}
    mine, gpipe = pipe["my_pipe-one_f_one_b"], pipe["gpipe"]
    assert found["my_pipe-one_f_one_b"]["code"].keys() == {"my_pipe.py"} and mine["schedule"] == "my_pipe:one_f_one_b"
    assert mine["ops"] == ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"] and mine["stages"] == 2
    assert mine["activation_peak_bytes"][0] * 2 == gpipe["activation_peak_bytes"][0]  # 2 micro-batches of 4
    assert mine["activation_peak_bytes"][1] * 4 == gpipe["activation_peak_bytes"][1]  # 1 of 4
    assert pipe["torch-1f1b"]["activation_peak_bytes"] == mine["activation_peak_bytes"]
    assert pipe["torch-gpipe"]["activation_peak_bytes"] == gpipe["activation_peak_bytes"]
    assert pipe["torch-1f1b"]["ops"] == mine["ops"] and pipe["torch-gpipe"]["ops"] == gpipe["ops"]
    assert all(0 < p["bubble"] < 1 and len(p["stage_idle"]) == 2 for p in pipe.values())
    assert all(abs(sum(p["stage_idle"]) / 2 - p["bubble"]) < 1e-9 for p in pipe.values())  # the mean: the bubble


def test_a_deadlocking_schedule_fails_at_once_naming_the_field(tmp_path, monkeypatch):
    (tmp_path / "my_pipe.py").write_text(SCHEDULES)
    monkeypatch.chdir(tmp_path)
    run = launch(tiny(tmp_path, "dead", workers=2, **MLP, **{"pipeline.schedule": "my_pipe:warm_by_stage"}))
    with pytest.raises(RunFailed, match="pipeline.schedule: my_pipe:warm_by_stage would deadlock"):
        run.wait(timeout=60)


def test_the_labs_helper_starts_no_run_for_a_schedule_the_engine_would_refuse(tmp_path, monkeypatch):
    """experiments.model_parallel.pipeline_schedule_runs checks a student's plan in the notebook's process first,
    reading the module afresh (an edit after an earlier import counts): refused plans start no run."""
    from scalelab.experiments.model_parallel import pipeline_schedule_runs
    (tmp_path / "my_pipe.py").write_text(SCHEDULES + '''
def todo(stage, stages, micro):
    raise NotImplementedError("exercise")
''')
    monkeypatch.chdir(tmp_path)
    rows = pipeline_schedule_runs(tiny(tmp_path, "x", workers=2, **MLP),
                                  {"dead": "my_pipe:warm_by_stage", "todo": "my_pipe:todo"}, tmp_path / "runs")
    assert "would deadlock" in rows["dead"]["error"] and "not implemented yet" in rows["todo"]["error"]
    assert not (tmp_path / "runs").exists()


def test_torchs_interleaved_schedule_runs_two_chunks_per_rank_in_the_engine_to_gpipes_losses(tmp_path):
    """pipeline.schedule = torch-interleaved: the MLP cut into 2 ranks x 2 chunks (rank r holds chunks r and r + 2,
    pipeline.hold_chunks), torch's ScheduleInterleaved1F1B over them: the losses of torch's GPipe on one stage per
    rank, and of the unsplit model; the evaluation goes round the chunks, the saved model is the whole one."""
    runs = {schedule: launch(tiny(tmp_path, schedule, workers=2, **MLP, **{"pipeline.schedule": schedule}))
            for schedule in ("torch-gpipe", "torch-interleaved")}  # side by side
    serial = launch(tiny(tmp_path, "serial", workers=1, **{**MLP, "strategy": "ddp"}))
    summaries = {name: run.wait(timeout=180) for name, run in {**runs, "serial": serial}.items()}
    for name in ("torch-interleaved", "serial"):
        assert summaries[name]["loss_curve"] == pytest.approx(summaries["torch-gpipe"]["loss_curve"], rel=1e-5,
                                                              abs=1e-6), name
    assert summaries["torch-interleaved"]["eval_accuracy"] == pytest.approx(summaries["torch-gpipe"]["eval_accuracy"])
    pipe = run_evidence(tmp_path)[RUNS]["torch-interleaved"]["pipeline"]
    assert pipe["schedule"] == "torch-interleaved" and pipe["stages"] == 2
    for rank, ops in enumerate(pipe["ops"]):  # each rank ran F and B of every micro-batch in both of its chunks
        chunks = {int(op.split("/")[1]) for op in ops.split()}
        assert chunks == {rank, rank + 2} and len(ops.split()) == 2 * 2 * MLP["pipeline.micro_batches"], ops
    assert 0 < pipe["bubble"] < 1 and all(b > 0 for b in pipe["activation_peak_bytes"])
    gpipe, interleaved = (torch.load(f"{tmp_path}/{name}/model.pt") for name in ("torch-gpipe", "torch-interleaved"))
    assert gpipe.keys() == interleaved.keys()
    assert all(torch.allclose(gpipe[k], interleaved[k], atol=1e-6) for k in gpipe)


@pytest.mark.parametrize("changes, field, words", [
    ({"model.depth": 2}, "pipeline.schedule", "2 x 2 = 4 chunks"),
    ({"pipeline.micro_batches": 5, "optim.batch_per_worker": 30}, "pipeline.micro_batches", "multiple of 2"),
    ({"strategy": "3d", "world.workers_per_node": 4, "parallel.tp": 2, "parallel.pp": 2}, "pipeline.schedule",
     "parallel.tp = 1"),
])
def test_torchs_interleaved_schedule_is_refused_where_it_cannot_run_naming_the_field(tmp_path, changes, field, words):
    with pytest.raises(SpecError) as err:
        tiny(tmp_path, "x", workers=2, **{**MLP, "pipeline.schedule": "torch-interleaved", **changes})
    assert err.value.field == field and words in str(err.value)


def test_the_replay_follows_virtual_stages_round_the_ranks():
    """Interleaved timelines name each operation's virtual stage: F on chunk v waits for F on chunk v-1 (another
    rank), B for B on chunk v+1. Two ranks, chunks 0 and 2 on rank 0, 1 and 3 on rank 1, one micro-batch, unit
    times: the activations go round twice and back, 8 slots for 4 per rank."""
    from scalelab.train.pipeline import replay_bubble
    rank0 = [("F", 0, 0.0, 1.0, 0), ("F", 0, 0.0, 1.0, 2), ("B", 0, 0.0, 1.0, 2), ("B", 0, 0.0, 1.0, 0)]
    rank1 = [("F", 0, 0.0, 1.0, 1), ("F", 0, 0.0, 1.0, 3), ("B", 0, 0.0, 1.0, 3), ("B", 0, 0.0, 1.0, 1)]
    replay = replay_bubble([rank0, rank1])
    assert replay["span_s"] == 8 and replay["bubble"] == 0.5
    assert replay["starts"] == [[0, 2, 5, 7], [1, 3, 4, 6]]
    plain = [[(op, i, 0.0, 1.0) for op, i in builtin_ops("gpipe", s, 2, 4)] for s in range(2)]
    assert replay_bubble(plain)["bubble"] == pytest.approx(0.2)  # one chunk per rank: (p-1)/(m+p-1), as before
