"""Pure parts of the engine: rank discovery, batch scripts as text, summaries, checkpoints, the CLI surface."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from scalelab.ckpt import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from scalelab.dist import rank_info
from scalelab.launch.slurm import batch_script
from scalelab.run.metrics import exclusive_fractions, scaling_efficiency, summarize
from scalelab.run.spec import preset


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1, 0, "none")),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4, 1, "torch")),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1"}, (1, 2, 1, "horovod")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (5, 8, 1, "mpi")),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2(x2)"},
     (2, 4, 0, "slurm")),
    # torchrun inside an sbatch job: torchrun's variables win over the job's
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (1, 2, 0, "torch")),
])
def test_rank_info_reads_each_launchers_variables(env, expected):
    info = rank_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == expected


def test_batch_script_carries_resources_and_only_the_options_that_are_set(tmp_path):
    spec = preset("tiny").with_overrides({"world.workers_per_node": 4, "world.nodes": 2, "launcher": "slurm",
                                          "slurm.partition": "gpu", "slurm.reservation": "class",
                                          "slurm.gpus_per_node": 4, "slurm.time": "00:30:00"})
    text = batch_script(spec, tmp_path, "/opt/py/bin/python")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --reservation=class", "#SBATCH --gres=gpu:4", "#SBATCH --time=00:30:00"):
        assert line in lines
    assert not any(l.startswith(("#SBATCH --account", "#SBATCH --mem")) for l in lines)
    assert lines[-1].startswith("srun --kill-on-bad-exit=1")
    assert f"/opt/py/bin/python -m scalelab.train.worker --spec {tmp_path}/spec.json" in lines[-1]


def test_batch_script_for_horovod_starts_ranks_with_mpirun(tmp_path):
    spec = preset("tiny").with_overrides({"strategy": "horovod", "launcher": "slurm", "world.workers_per_node": 2})
    last = batch_script(spec, tmp_path).splitlines()[-1]
    assert last.startswith("mpirun -np 2") and "srun" not in last


def test_batch_script_quotes_paths_with_spaces(tmp_path):
    run_dir = tmp_path / "my runs"
    text = batch_script(preset("tiny").replace(launcher="slurm"), run_dir, "/usr/bin/python3")
    assert f"'{run_dir}/spec.json'" in text


def _step(rank, step, samples=16, step_s=0.01, loss=1.0):
    return {"type": "step", "rank": rank, "step": step, "samples": samples, "step_s": step_s, "data_s": 0.001,
            "compute_s": 0.008, "comm_s": 0.002, "loss": loss, "t": step}


def test_summary_skips_warmup_steps_and_adds_rank_throughputs():
    events = [_step(0, 1, step_s=1.0), *[_step(0, s) for s in range(2, 11)],
              _step(1, 1, step_s=1.0), *[_step(1, s, step_s=0.02) for s in range(2, 11)],
              {"type": "end", "rank": 0, "final_loss": 0.5, "eval_accuracy": 0.9, "t": 11}]
    s = summarize(events, 2)
    assert s["per_rank_samples_per_s"] == pytest.approx([1600.0, 800.0])  # the slow first step is left out
    assert s["samples_per_s"] == pytest.approx(2400.0)
    assert s["final_loss"] == 0.5 and s["steps"] == 10 and s["eval_accuracy"] == 0.9
    # 18 measured steps with 1 ms of data wait each, over 9 x 10 ms + 9 x 20 ms of step time
    assert s["time_fraction"]["data"] == pytest.approx(18 * 0.001 / (9 * 0.01 + 9 * 0.02))
    assert sum(s["time_fraction"].values()) == pytest.approx(1.0)
    assert s["comm_in_flight"] == pytest.approx(18 * 0.002 / (9 * 0.01 + 9 * 0.02))


def test_time_fractions_add_up_to_one_when_ddp_comm_overlaps_compute():
    # DDP: compute 9 ms of a 10 ms step already contains a 4 ms bucket all-reduce that ran alongside backward
    f = exclusive_fractions({"step_s": 0.010, "data_s": 0.001, "compute_s": 0.009, "comm_s": 0.004})
    assert f == pytest.approx({"data": 0.1, "compute": 0.5, "comm": 0.4, "other": 0.0})
    # Horovod: comm timed apart; 1 ms no timer covered
    f = exclusive_fractions({"step_s": 0.010, "data_s": 0.001, "compute_s": 0.006, "comm_s": 0.002})
    assert f == pytest.approx({"data": 0.1, "compute": 0.6, "comm": 0.2, "other": 0.1})


def test_scaling_efficiency():
    assert scaling_efficiency(180.0, 100.0, 2) == pytest.approx(0.9)
    assert scaling_efficiency(1.0, 0.0, 2) == 0.0


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_checkpoints_round_trip_and_keep_the_last_k(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, model, opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000010.pt", "step-00000015.pt"]
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_opt) == 15
    torch.testing.assert_close(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["momentum_buffer"] is not None


def test_a_corrupted_checkpoint_is_refused_naming_the_file(tmp_path):
    model = _model()
    path = save_checkpoint(tmp_path, 1, model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path.name} is corrupted"):
        load_checkpoint(path, _model())


def test_a_file_not_in_the_manifest_is_never_loaded(tmp_path):
    model = _model()
    save_checkpoint(tmp_path, 1, model, torch.optim.SGD(model.parameters(), lr=0.1))
    partial = tmp_path / "step-00000002.pt"
    partial.write_bytes(b"half a checkpoint")
    assert latest_checkpoint(tmp_path).name == "step-00000001.pt"
    with pytest.raises(CheckpointError, match="may be partial"):
        load_checkpoint(partial, _model())


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "scalelab.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: the flag was once refused while --set trained it
def test_cli_run_json_prints_the_summary(tmp_path, strategy):
    r = _cli("run", "--preset", "tiny", "--workers", "2", "--strategy", strategy, "--json", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])  # the JSON is the last line of stdout
    assert "20/20" in r.stderr  # and progress went to stderr all the same
    assert {"status", "world_size", "samples_per_s", "steps", "final_loss"} <= summary.keys()
    assert summary["status"] == "succeeded" and summary["world_size"] == 2 and summary["steps"] == 20
    assert summary["strategy"] == strategy and summary["samples_per_s"] > 0


def test_cli_choices_are_the_engines():
    """`scalelab run` offers every strategy and launcher the engine validates, and no other (issue 37)."""
    from scalelab.cli import build_parser
    from scalelab.run.validate import LAUNCHERS, STRATEGIES
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    choices = {a.dest: tuple(a.choices) for a in run._actions if a.choices}
    assert choices["strategy"] == STRATEGIES and choices["launcher"] == LAUNCHERS
    assert {"fsdp", "pp", "tp", "3d"} <= set(STRATEGIES) and "srun" in LAUNCHERS


def test_cli_run_shows_progress_and_a_summary_table(tmp_path):
    r = _cli("run", "--preset", "tiny", "--workers", "1", "--set", "steps=5", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "5/5" in r.stderr  # the progress bar reached the end
    assert "samples/s (all ranks)" in r.stdout and "succeeded" in r.stdout


def test_cli_failed_run_exits_non_zero_with_the_rank(tmp_path):
    r = _cli("run", "--workers", "2", "--set", "fault.kind=raise", "--set", "fault.rank=1", "--json",
             "--out", str(tmp_path / "r"))
    assert r.returncode == 1
    summary = json.loads(r.stdout)
    assert summary["status"] == "failed" and summary["failed_rank"] == 1


@pytest.mark.parametrize("args, words", [
    (["--set", "optim.lr=fast"], "optim.lr: got 'fast' (str); expected a number"),
    (["--set", "world.workers_per_node=0"], "world.workers_per_node: got 0; must be at least 1"),
    (["--set", "optim.learning_rate=1"], "optim.learning_rate: unknown field"),
    (["--set", "steps"], "expected key=value"),
    (["--strategy", "horovod", "--launcher", "local"], "launcher: got 'local' with strategy 'horovod'"),
])
def test_cli_set_errors_name_the_field(args, words):
    r = _cli("run", *args)
    assert r.returncode == 1
    assert words in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_surface_is_frozen():
    """The documented commands and flags stay put (a change here is a change for every course handout)."""
    from scalelab.cli import build_parser
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"run", "doctor", "cluster"} <= set(commands)
    flags = {opt for a in commands["run"]._actions for opt in a.option_strings}
    assert {"--preset", "--workers", "--nodes", "--strategy", "--launcher", "--set", "--json", "--spec"} <= flags
    grade = {opt for a in commands["grade"]._actions for opt in a.option_strings}
    assert {"-j", "--out", "--set", "--json", "--slurm", "--partition", "--slurm-cpus"} <= grade
    course = next(a for a in commands["course"]._actions if a.dest == "course_command").choices
    assert {"collect", "return", "gradebook", "warm", "inject"} <= set(course)
    inject = {opt for a in course["inject"]._actions for opt in a.option_strings}
    assert {"--file", "--config", "--lab", "--rank", "--window-s"} <= inject
    site = commands["site"]._subparsers._group_actions[0].choices
    build = {opt for a in site["build"]._actions for opt in a.option_strings}
    assert {"--lab", "--labs-root", "--out", "--force", "--json", "--leaderboard", "--pseudonym-key-file"} <= build


def test_free_ports_come_from_below_the_kernels_ephemeral_range():
    # A port from bind(0) is ephemeral: between the pick and the rank's bind the kernel may hand it to any connection
    # (a rank's TCPStore got EADDRINUSE with two test workers side by side). Below the range only another pick can.
    import socket
    from scalelab.run.procs import PORT_FLOOR, _ephemeral_range, free_port
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(30)]
    assert all(PORT_FLOOR <= p < low for p in ports), ports
    assert len(set(ports)) > 20, "picked at random, not one port again and again"
    with socket.socket() as s:
        s.bind(("", ports[0]))  # free on every address, as a rendezvous binds it


def test_lr_schedules_warm_up_then_decay_to_their_floor():
    from scalelab.train.optim import lr_at
    for schedule in ("cosine", "poly"):
        lrs = [lr_at(s, 1.0, 3, schedule, 13, min_lr_fraction=0.1, poly_power=2.0) for s in range(13)]
        assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0]) and lrs[3] == pytest.approx(1.0)
        assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lr_at(8, 1.0, 3, "cosine", 14) == pytest.approx(0.5)  # half way down the cosine (steps 3..13)
    assert [lr_at(s, 0.5, 0, "constant", 10) for s in (0, 9)] == [0.5, 0.5]


def test_code_a_spec_names_must_exist_beside_the_notebook(tmp_path):
    from scalelab.errors import LaunchError
    from scalelab.run.user_code import copy_user_code
    spec = preset("tiny").with_overrides({"optim.comm_hook": "my_hooks:topk_hook"})
    with pytest.raises(LaunchError, match=r"optim.comm_hook: 'my_hooks:topk_hook'.*my_hooks.py.*%%writefile"):
        copy_user_code(spec, tmp_path / "run", source_dir=tmp_path)
    (tmp_path / "my_hooks.py").write_text("def topk_hook(state, bucket): pass\n")
    copied = copy_user_code(spec, tmp_path / "run", source_dir=tmp_path)
    assert list(copied) == ["my_hooks.py"] and (tmp_path / "run" / "code" / "my_hooks.py").is_file()


def test_wire_counter_counts_collectives_from_any_thread_with_the_ring_model():
    import threading

    import torch.distributed as dist

    from scalelab.train.comm_hooks import _SENT, WireCounter
    assert _SENT["all_reduce"](400, 2) == 400 and _SENT["all_reduce"](400, 4) == 600  # 2(N-1)/N S
    assert _SENT["all_gather"](100, 4) == 300  # each rank's s reaches the N-1 others
    original = dist.all_reduce
    counter = WireCounter().install()
    try:
        assert dist.all_reduce is not original
        calls = []
        counter._originals["all_reduce"] = lambda *a, **k: calls.append(a)  # no process group needed
        dist.all_reduce = counter._wrap(counter._originals["all_reduce"], "all_reduce", _SENT["all_reduce"])
        worker = threading.Thread(target=dist.all_reduce, args=(torch.zeros(10),))
        worker.start()
        worker.join()
        dist.all_reduce(torch.zeros(5, dtype=torch.float16))
        assert counter.take() == {"comm_bytes": 50, "wire_bytes": 0, "collectives": 2}  # world 1 sends nothing
        assert counter.take()["collectives"] == 0 and len(calls) == 2
    finally:
        counter.uninstall()
        dist.all_reduce = original


def test_mpirun_command_lines_are_written_once():
    """launch/commands.py builds every mpirun command line (the mpirun launcher, Horovod in an allocation and in a
    batch script, the SPMD pool): the root rule and the core-sharing options live there only (issue 37)."""
    import os
    from pathlib import Path

    from scalelab.launch.commands import mpirun_args
    pkg = Path(__file__).resolve().parent.parent / "scalelab"
    elsewhere = [str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                 if p.name != "commands.py" and ("--allow-run-as-root" in p.read_text()
                                                 or "mpi_yield_when_idle" in p.read_text())]
    assert elsewhere == [], f"mpirun options written outside launch/commands.py: {elsewhere}"
    cmd = mpirun_args(4, ("MASTER_ADDR",), exe="mpirun", interface="lo", per_node=2, shared_cores=True,
                      hostfile="hosts")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    assert cmd == ["mpirun", "-np", "4", "--npernode", "2", "--oversubscribe", "--bind-to", "none", "--mca",
                   "btl_tcp_if_include", "lo", "--mca", "mpi_yield_when_idle", "1", *root, "--hostfile", "hosts",
                   "-x", "MASTER_ADDR"]
    assert mpirun_args(2, exe="mpirun")[:5] == ["mpirun", "-np", "2", "--bind-to", "none"]
