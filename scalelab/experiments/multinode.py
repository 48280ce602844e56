"""Lab 04's runs across nodes: the same global batch as 1 node × 2 ranks and as 2 nodes × 1 rank, and (when asked)
once more with every node's link shaped slow, on a multi-node Slurm (`scalelab cluster up --nodes 2`); and a batch
script of the student's own, submitted as an engine run.

    rows = cross_node_runs(preset("tiny"), out / "nodes", slow_link="100mbit")
    row = submit_job_script("weak_scaling.sbatch", spec, out / "job")    # the student's #SBATCH lines and srun

Each row: layout, nodes, ranks_per_node, link, samples_per_s, comm_fraction (exposed all-reduce share of a step),
comm_ms_per_step (that share of the mean step time), comm_in_flight, hosts (where the ranks ran, from their start events) and run_dir (for the grader's evidence).
Shaping a link changes the cluster (tc on each node's veth), so it needs root and the namespace cluster that
$SLURM_CONF names; the shaping is taken off again afterwards, whatever happened.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import LaunchError

PLACEHOLDER = 'NotImplementedError("exercise")'
"""What a released copy's unsolved solution block holds (scalelab.course.release)."""


def cross_node_runs(base, out_dir: str | Path, slow_link: str = "", timeout: float = 600) -> list[dict]:
    """Launch the layouts one after another (launcher slurm) and return one row per run."""
    from ..launch import launch
    layouts = [("1 node x 2 ranks", 1, 2, None), ("2 nodes x 1 rank", 2, 1, None)]
    if slow_link:
        layouts.append((f"2 nodes x 1 rank, {slow_link} links", 2, 1, slow_link))
    cluster = _shaper() if slow_link else None
    rows = []
    try:
        for label, nodes, per_node, rate in layouts:
            if cluster is not None:
                cluster.set_link_rate(rate)
            spec = base.with_overrides({"name": f"nodes-{nodes}x{per_node}" + (f"-{rate}" if rate else ""),
                                        "launcher": "slurm", "world.nodes": nodes, "world.workers_per_node": per_node,
                                        "output_dir": str(Path(out_dir) / label.replace(" ", "").replace(",", "-"))})
            run = launch(spec)
            summary = run.wait(timeout=timeout)
            step_s = spec.global_batch / summary["samples_per_s"] if summary["samples_per_s"] else 0.0
            rows.append({"layout": label, "nodes": nodes, "ranks_per_node": per_node, "link": rate or "unshaped",
                         "samples_per_s": summary["samples_per_s"],
                         "comm_fraction": summary["time_fraction"]["comm"],
                         "comm_ms_per_step": 1000 * summary["time_fraction"]["comm"] * step_s,
                         "comm_in_flight": summary["comm_in_flight"],
                         "hosts": sorted({e.get("host", "") for e in run.events() if e.get("type") == "start"}),
                         "run_dir": str(run.run_dir)})
    finally:
        if cluster is not None:
            cluster.set_link_rate(None)
    return rows


def submit_job_script(script: str | Path, spec, out_dir: str | Path, timeout: float = 600,
                      env: dict | None = None) -> dict:
    """sbatch a batch script of the student's own as an engine run of `spec`, wait for it, and return its row.

    The run folder gets spec.json (as every launcher writes it) and the script as job.sh; sbatch runs the script
    there (--chdir, its output in logs/) with this Python first on PATH, so `srun python -m scalelab.train.worker
    --spec spec.json` in it starts the ranks. What the script asks Slurm for is what runs: the row's hosts and
    world_size come from the ranks' start events. `env`: the environment sbatch runs in (default this process's).
    Row: run_dir, job_id, hosts, world_size, samples_per_s, final_loss, steps."""
    from ..cluster.slurm import slurm_command, slurm_env
    from ..launch.base import prepare_run_dir, start_process
    from ..launch.slurm import SlurmRun
    from ..run.procs import scrub_env
    text = Path(script).read_text()
    if PLACEHOLDER in text:
        raise NotImplementedError(f"{script} is not written yet: write the batch script in its %%writefile cell, "
                                  "run that cell, then this one")
    spec, run_dir, reader = prepare_run_dir(spec.with_overrides({"launcher": "slurm",
                                                                 "output_dir": str(Path(out_dir).resolve())}))
    job = run_dir / "job.sh"
    job.write_text(text)
    env = slurm_env(scrub_env(env))  # no SLURM_* of an enclosing allocation leaks into the job
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    r = slurm_command(["sbatch", "--parsable", "--chdir", str(run_dir),
                       "--output", str(run_dir / "logs" / "slurm-%j.out"), str(job)], env)
    if r.returncode:
        raise LaunchError(f"sbatch refused {script}: {(r.stderr or r.stdout).strip()}")
    job_id = r.stdout.strip().split(";")[0]
    run = SlurmRun(spec, run_dir, job_id, env, reader)
    # cancels the job if this process dies without stopping the run (a SIGKILL, a dead kernel)
    run.guard = start_process([sys.executable, "-m", "scalelab.cluster.guard", job_id], env,
                              run_dir / "logs" / "guard.log")
    try:
        summary = run.wait(timeout=timeout)
    finally:
        if run.poll() in ("pending", "running"):  # timed out or interrupted: the job must not run on
            run.stop()
    starts = [e for e in run.events() if e.get("type") == "start"]
    return {"run_dir": str(run_dir), "job_id": job_id, "hosts": sorted({e.get("host", "") for e in starts}),
            "world_size": len({e["rank"] for e in starts}), "samples_per_s": summary["samples_per_s"],
            "final_loss": summary["final_loss"], "steps": summary["steps"]}


def _shaper():
    """The namespace cluster behind $SLURM_CONF, to shape its links; LaunchError saying what is needed otherwise."""
    from ..cluster.nodes import NodesCluster
    conf = os.environ.get("SLURM_CONF", "")
    if os.geteuid() != 0:
        raise LaunchError("shaping the nodes' links needs root (tc on each node's link): leave slow_link empty, or "
                          "start the cluster shaped: sudo scalelab cluster up --nodes 2 --link-rate 100mbit")
    if not conf or not (Path(conf).parent / "nodes.json").exists():
        raise LaunchError(f"slow_link needs the namespace cluster (scalelab cluster up --nodes 2) as $SLURM_CONF; "
                          f"SLURM_CONF is {conf or 'not set'}")
    return NodesCluster(Path(conf).parent)


__all__ = ["cross_node_runs", "submit_job_script"]
