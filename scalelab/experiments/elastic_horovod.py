"""Lab 08 (resilience): lose a worker under Horovod elastic and watch the survivors roll back and finish.

    report = horovod_elastic_run("runs/elastic", steps=40, fault_step=14)
    report["world_sizes"]        # [3, 2]: the group before and after the reset
    report["resumed_step"]       # the last commit before the fault: where the survivors went on from
    report["recovery_s"]         # from the kill to the first step trained again by the re-formed group
    report["replay_max_diff"]    # the final model against one process replaying the same steps: ~1e-7
    horovod_elastic_run("runs/back", steps=1500, fault_step=5, rejoin_s=2)   # world_sizes [3, 2, 3]

The replay differs from the run only in the order of float sums (three partial gradients summed, not one); over
tens of steps that stays near 1e-7, but a long run amplifies it (0.6 after 1500 steps here, with no fault at
all), so compare short runs. A worker comes back (rejoin_s) only if the run outlasts the cooldown and a new
process's start-up.

The run is real: horovodrun with a host discovery script, one worker SIGKILLed at `fault_step`
(train/hvd_elastic.py, launch/horovodrun.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..run.spec import preset


def elastic_spec(out_dir, steps: int = 40, fault_step: int = 14, workers: int = 3, commit_every: int = 4,
                 fault_rank: int = 1, detect_timeout_s: float = 10.0, rejoin_s: int = 0, **overrides):
    """The tiny preset's MLP on `workers` Horovod elastic workers, worker `fault_rank` SIGKILLed before step
    `fault_step` (fault_step < 0: no fault); `overrides` are dotted RunSpec fields."""
    fault = {"fault.kind": "kill", "fault.rank": fault_rank, "fault.step": fault_step} if fault_step >= 0 else {}
    return preset("tiny").replace(name="elastic", output_dir=str(Path(out_dir).resolve())).with_overrides({
        "strategy": "horovod", "launcher": "horovodrun", "model.name": "mlp", "steps": steps,
        "world.workers_per_node": workers, "world.max_restarts": 3, "world.commit_every": commit_every,
        "world.rejoin_s": rejoin_s, "fault.detect_timeout_s": detect_timeout_s, **fault, **overrides})


def horovod_elastic_run(out_dir, steps: int = 40, fault_step: int = 14, timeout: float = 300, **options) -> dict:
    """Run `elastic_spec(out_dir, steps, fault_step, **options)` to the end; what the reset cost and where it ended.

    Keys: run_dir, finished (the run succeeded), status, world_sizes (a survivor's group sizes, in order), lost,
    failed_step (where the survivors noticed), resumed_step (the commit they rolled back to), rolled_back_steps,
    detect_s (kill -> the failed collective), recover_s (-> re-formed and synced), recovery_s (kill -> a step
    trained again), final_world_size, final_loss, elapsed_s, replay_max_diff (largest parameter difference to
    one process replaying the same steps, when the run finished).
    """
    from ..launch import launch
    from ..train.hvd_elastic import replay
    spec = elastic_spec(out_dir, steps, fault_step, **options)
    run = launch(spec)
    try:
        summary = run.wait(timeout=timeout, check=False)
    finally:
        run.stop()
    report = elastic_report(run.events())
    report.update(run_dir=str(run.run_dir), status=summary["status"], finished=summary["status"] == "succeeded",
                  elapsed_s=summary["elapsed_s"], replay_max_diff=None)
    if report["finished"]:
        final = torch.load(run.run_dir / "model.pt")
        reference = replay(spec)
        report["replay_max_diff"] = max(float((final[k] - reference[k]).abs().max()) for k in reference)
    return report


def elastic_report(events: list[dict], rank: int | None = None) -> dict:
    """What worker `rank`'s events say about its resets (default: the lowest worker that finished, a survivor):
    the group sizes, the first reset's steps and times."""
    if rank is None:
        rank = min((e["rank"] for e in events if e["type"] == "end"), default=0)
    mine = [e for e in events if e["rank"] == rank]
    starts = [e for e in mine if e["type"] == "start"]
    resets = [e for e in mine if e["type"] == "recovered"]
    ends = [e for e in mine if e["type"] == "end"]
    fault = next((e for e in events if e["type"] == "fault"), None)
    first = resets[0] if resets else None
    again = None
    if first is not None:  # the first step this worker finished after the group re-formed
        again = next((e for e in mine if e["type"] == "step" and e["t"] > first["t"]), None)
    return {
        "world_sizes": [s["world_size"] for s in starts[:1]] + [r["world_size"] for r in resets],
        "resets": len(resets),
        "lost": sorted({w for r in resets for w in r["lost"]}),
        "fault_step": fault["step"] if fault else None,
        "failed_step": first["failed_step"] if first else None,
        "resumed_step": first["resumed_step"] if first else None,
        "rolled_back_steps": first["rolled_back_steps"] if first else None,
        "detect_s": first["detected_t"] - fault["t"] if first and fault else None,
        "recover_s": first["recover_s"] if first else None,
        "recovery_s": again["t"] - fault["t"] if again and fault else None,
        "final_world_size": ends[-1]["world_size"] if ends else None,
        "final_loss": ends[-1]["final_loss"] if ends else None,
    }


__all__ = ["elastic_spec", "horovod_elastic_run", "elastic_report"]
