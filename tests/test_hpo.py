"""scalelab.experiments.hpo: a search shared by worker processes (or Slurm jobs) through one optuna journal
file, with trials stopped early by the median pruner, and seeded so one worker repeats its first trials."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from scalelab.errors import RunFailed, SpecError
from scalelab.experiments import hpo


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    return hpo.parallel_hpo(tmp_path_factory.mktemp("hpo"), trials=8, workers=2, steps=60, seed=0,
                            sync_start_s=60)


def test_two_local_workers_share_exactly_the_trials_and_prune_some(local_run):
    r = local_run
    assert [t["number"] for t in r["trials"]] == list(range(8))  # exactly `trials`, none twice
    assert set(r["trials_per_worker"]) == {0, 1} and sum(r["trials_per_worker"].values()) == 8
    assert len({t["pid"] for t in r["trials"]}) == 2 and {t["host"] for t in r["trials"]} == {socket.gethostname()}
    assert r["pruned"] >= 1 and r["complete"] >= 1 and r["complete"] + r["pruned"] == 8
    pruned = [t for t in r["trials"] if t["state"] == "pruned"]
    assert all(t["steps"] < 60 for t in pruned)
    assert r["steps_saved"] == sum(60 - t["steps"] for t in pruned) > 0
    assert r["steps_run"] + r["steps_saved"] == r["steps_budget"] == 8 * 60
    # the best complete trial learned the digits (chance is 0.1) and is the best of the complete ones
    assert r["best"]["state"] == "complete" and r["best"]["value"] > 0.5
    assert r["best"]["value"] == max(t["value"] for t in r["trials"] if t["state"] == "complete")
    assert set(r["best"]["params"]) == {"lr", "width", "weight_decay"}
    assert all(0 < t["seconds"] < 60 for t in r["trials"])


def test_one_worker_with_the_same_seed_proposes_the_same_first_trials(local_run, tmp_path):
    # the worker's own loop, run in this process (no second interpreter start-up)
    hpo.prepare_study(tmp_path, trials=2, steps=10, seed=0, report_every=10)
    threads = torch.get_num_threads()
    assert hpo.run_worker(tmp_path, 0) == 2 and torch.get_num_threads() == threads
    solo = hpo.summarize(tmp_path)  # read back from the journal file alone
    # worker 0's first trials in the shared run; under load the other worker may take all but one of them
    first = [t["params"] for t in local_run["trials"] if t["worker"] == 0][:2]
    assert first, "worker 0 ran no trial in the shared run"
    assert [t["params"] for t in solo["trials"]][:len(first)] == first
    assert [t["steps"] for t in solo["trials"]] == [10, 10] and solo["steps_saved"] == 0


def test_an_objective_of_the_students_runs_each_trial_as_an_engine_run_it_reports_and_stops(tmp_path, monkeypatch):
    from scalelab.grade.evidence import RUNS, run_evidence
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_objective.py").write_text("from scalelab.experiments.hpo import engine_objective as objective\n")
    r = hpo.parallel_hpo(tmp_path / "hpo", trials=4, workers=2, steps=60, report_every=15, seed=0, startup_trials=2,
                         pruner_startup=1, sync_start_s=60, objective="my_objective:objective")
    found = run_evidence(tmp_path / "hpo")[RUNS]
    assert len(r["trials"]) == 4 and len(found) == 4
    for t in r["trials"]:
        run = found[os.path.relpath(t["run_dir"], tmp_path / "hpo")]
        assert run["implausible"] == [] and run["total_steps"] == 60
        assert t["steps"] == run["step_numbers"][-1]  # what ran is what the run's events say
        evals = dict((s, a) for s, a in run["evals"])
        assert t["intermediate"] and all(evals[int(s)] == v for s, v in t["intermediate"].items())
        if t["state"] == "complete":
            assert t["steps"] == 60 and t["value"] == run["eval_accuracy"]
    (tmp_path / "my_objective.py").write_text("def objective(trial, spec):\n    raise NotImplementedError('exercise')\n")
    with pytest.raises(NotImplementedError, match="objective in my_objective.py is not written yet"):
        hpo.parallel_hpo(tmp_path / "hpo2", trials=2, workers=1, steps=20, objective="my_objective:objective")


@pytest.mark.parametrize("kwargs, field", [({"trials": 0}, "trials"), ({"workers": "2"}, "workers"),
                                           ({"launcher": "ray"}, "launcher"), ({"report_every": 99}, "report_every"),
                                           ({"objective": "my.objective:f"}, "objective")])
def test_a_bad_argument_names_itself(tmp_path, kwargs, field):
    with pytest.raises(SpecError) as e:
        hpo.parallel_hpo(tmp_path, **{"steps": 20, **kwargs})
    assert e.value.field == field and field in str(e.value)


def test_a_failing_worker_is_named_with_its_exit_status(tmp_path):
    with pytest.raises(RunFailed) as e:
        hpo.parallel_hpo(tmp_path, trials=2, workers=1, steps=20, python="/bin/false")
    assert "HPO worker 0 exited with status 1" in str(e.value) and e.value.rank == 0


def test_the_worker_batch_script_is_one_task_on_one_cpu(tmp_path):
    text = hpo.worker_script(tmp_path, 3, python="/venv/bin/python")
    assert "#SBATCH --ntasks=1" in text and "#SBATCH --cpus-per-task=1" in text
    assert f"--output={tmp_path.resolve()}/logs/worker-3.log" in text
    assert text.rstrip().endswith(f"/venv/bin/python -m scalelab.experiments.hpo worker {tmp_path.resolve()} 3")


@pytest.mark.slurm
def test_two_sbatch_workers_run_the_search_on_slurm(slurm_cluster, tmp_path):
    r = hpo.parallel_hpo(tmp_path, trials=6, workers=2, steps=40, seed=1, launcher="slurm", sync_start_s=60,
                         env={**os.environ, **slurm_cluster.env()})
    assert r["launcher"] == "slurm" and [t["number"] for t in r["trials"]] == list(range(6))
    assert set(r["trials_per_worker"]) == {0, 1}  # both batch jobs ran trials
    assert all(t["state"] in ("complete", "pruned") for t in r["trials"]) and r["best"]["value"] > 0.3
    assert all("trial" in (tmp_path / "logs" / f"worker-{i}.log").read_text() for i in (0, 1))
