"""Lab 07: model parallelism and memory. SPMD experiments, run with `run_spmd` / an `SpmdPool`:

    tp = run_spmd("scalelab.experiments.model_parallel:tensor_parallel_check", world=2)[0]
    pp = run_spmd("scalelab.experiments.model_parallel:pipeline_measure", world=2,
                  kwargs={"schedule": "1f1b", "micro": 4})[0]

- `tensor_parallel_check`: the engine's MLP, its first two layers split column/row over the ranks (by
  `scalelab.train.tensor_parallel`, or a student's module with the same two autograd functions), against the
  serial layers: outputs and gradients, and the collectives it issued.
- `dtensor_parallel_check`: the same split done by PyTorch's DTensor `parallelize_module`, against the serial layers.
- `mesh_2d_state`: FSDP over DTensor tensor parallelism on a 2 x 2 mesh (4 ranks): the state each rank holds.
- `pipeline_measure`: the MLP cut into one stage per rank, trained a few steps with a GPipe or 1F1B schedule;
  bubble fraction measured from each stage's compute timeline against (p-1)/(m+p-1), activations held, and the
  losses of the same steps trained unsplit on one process.
- `pipeline_schedule_runs`: engine runs (strategy pp) of the same model under several pipeline schedules (the
  engine's, torch.distributed.pipelining's — torch-interleaved: several chunks per rank —, a student's
  module:function), each stage's peak activation bytes and operations and the bubble read from the runs'
  `pipeline` events.
- `layout_runs`: engine runs of one spec (the gpt, say) under several strategies one after another (DDP, FSDP,
  FSDP with CPU offload, tensor and pipeline parallel): losses, tokens/s and what rank 0 holds, from their events.
- `reshard_save` / `reshard_restore`: an FSDP-sharded model and its Adam state saved with
  torch.distributed.checkpoint at one world size and restored at another (2 -> 1 -> 2), compared exactly.
FSDP itself is the engine's strategy `fsdp`, and a dp x tp x pp mesh its strategy `3d` (`parallel.tp`,
`parallel.pp`; train/mesh.py): train them with `launch(spec)` and read their `memory` events.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ckpt.sharded import ShardedCheckpointer
from ..run.spec import ModelSpec
from ..train.memory import CommCounter
from ..train.models import build_model
from ..train.pipeline import PipelineStage, bubble_formula, replay_bubble, split_layers
from ..train import tensor_parallel as tp


def _mlp(width: int, depth: int, size: int = 16, classes: int = 4, seed: int = 0):
    """The engine's MLP on 1 x size x size fields."""
    return build_model(ModelSpec("mlp", width=width, depth=depth), 1, size, classes, seed)


def _rank_world() -> tuple[int, int]:
    """(rank, world) of this process; (0, 1) when no process group was started (a pool of one rank)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _batch(n: int, size: int = 16, classes: int = 4, seed: int = 1):
    """A seeded random batch of n fields (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


def tensor_parallel_check(width: int = 64, batch: int = 8, seed: int = 0, module: str = "") -> dict:
    """Split the engine MLP's first two layers over the ranks; compare output and gradients with the serial
    layers. `module`: a module with CopyToParallel and ReduceFromParallel to use instead of the engine's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    impl = importlib.import_module(module) if module else tp
    serial = _mlp(width, 2, seed=seed)
    first, second = serial.net[1], serial.net[3]
    x, _ = _batch(batch)
    x = x.flatten(1)
    parallel = tp.ParallelMLP(first, second, rank, world, copy=impl.CopyToParallel, reduce=impl.ReduceFromParallel)
    x_serial, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_serial = second(F.relu(first(x_serial)))
    with CommCounter() as counter:
        y_par = parallel(x_par)
        (y_par ** 2).sum().backward()
    (y_serial ** 2).sum().backward()
    want = tp.shard_of_serial_grads(first, second, rank, world)
    grads = {n: float((p.grad - want[n]).abs().max()) for n, p in parallel.named_parameters()}
    return {"rank": rank, "world": world, "out_diff": float((y_par - y_serial).abs().max()),
            "input_grad_diff": float((x_par.grad - x_serial.grad).abs().max()), "grad_diffs": grads,
            "param_elements": sum(p.numel() for p in parallel.parameters()),
            "serial_elements": sum(p.numel() for p in (*first.parameters(), *second.parameters())),
            "comm": counter.summary(), "output_bytes": y_par.numel() * y_par.element_size(),
            "input_bytes": x.numel() * x.element_size()}


def dtensor_parallel_check(width: int = 64, batch: int = 8, seed: int = 0) -> dict:
    """The same two layers split by PyTorch's DTensor (`parallelize_module` with ColwiseParallel and
    RowwiseParallel on a 1-D CPU mesh) against the serial layers: output, and weight gradients gathered back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    rank, world = dist.get_rank(), dist.get_world_size()
    serial = _mlp(width, 2, seed=seed)
    pair = torch.nn.Sequential(serial.net[1], torch.nn.ReLU(), serial.net[3])
    twin = _mlp(width, 2, seed=seed)
    twin_pair = torch.nn.Sequential(twin.net[1], torch.nn.ReLU(), twin.net[3])
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(twin_pair, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = _batch(batch)[0].flatten(1)
    with CommCounter() as counter:
        y_par = twin_pair(x)
        (y_par ** 2).sum().backward()
    y_serial = pair(x)
    (y_serial ** 2).sum().backward()
    grads = {n: float((p.grad.full_tensor() - q.grad).abs().max())
             for (n, p), q in zip(twin_pair.named_parameters(), pair.parameters())}
    return {"rank": rank, "out_diff": float((y_par - y_serial).abs().max()), "grad_diffs": grads,
            "local_elements": sum(p.to_local().numel() for p in twin_pair.parameters()),
            "serial_elements": sum(p.numel() for p in pair.parameters()), "comm": counter.summary()}


def mesh_2d_state(width: int = 128, batch: int = 8, seed: int = 0) -> dict:
    """FSDP over tensor parallelism on a dp x tp = 2 x 2 mesh of 4 ranks (FSDP2 on the dp axis, DTensor's
    column/row split on the tp axis) of a width x width MLP pair, one AdamW step: the state bytes this rank holds,
    for the planner's estimate to be held against, and the loss against the unsplit pair's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from ..train.memory import state_bytes
    world = dist.get_world_size()
    if world != 4:
        raise ValueError(f"mesh_2d_state runs on a 2 x 2 mesh: start it on 4 ranks, not {world}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def pair():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))

    serial, model = pair(), pair()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2 * batch, width, generator=g)
    dp_rank = mesh["dp"].get_local_rank()
    loss = (model(x[dp_rank * batch:(dp_rank + 1) * batch]) ** 2).mean()  # each dp rank its half of the batch
    loss.backward()
    opt.step()
    held = state_bytes(model, opt)
    total = torch.tensor([float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "params": sum(p.numel() for p in serial.parameters()), **held,
            "loss": float(total) / world, "serial_loss": float((serial(x) ** 2).mean())}  # tp ranks: same loss


def pipeline_measure(schedule: str = "gpipe", micro: int = 4, steps: int = 3, width: int = 1024, depth: int = 2,
                     size: int = 32, batch: int = 128, seed: int = 0, lr: float = 0.05) -> dict:
    """Train the engine's MLP as a pipeline of one stage per rank; per step: the losses (and those of the same
    steps unsplit), the bubble replayed from the stages' measured compute times (`replay_bubble`) and the
    wall-clock one. Defaults: a 32x32 input and width 1024, so the two stages have equal parameter counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch % micro:
        raise ValueError(f"batch {batch} does not split into {micro} equal micro-batches: choose micro dividing "
                         "batch")
    serial = _mlp(width, depth, size, seed=seed)
    stages = split_layers(serial.net, world)
    stage_module = _mlp(width, depth, size, seed=seed).net  # a second copy: trained as a pipeline, `serial` unsplit
    stage_module = split_layers(stage_module, world)[rank]
    stage = PipelineStage(stage_module, rank, world)
    cut_in = [sum(len(s) for s in stages[:k]) for k in range(world)]
    opt = torch.optim.SGD(stage_module.parameters(), lr=lr)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=lr)
    mb = batch // micro
    out = {"rank": rank, "stages": world, "micro": micro, "schedule": schedule, "losses": [], "serial_losses": [],
           "bubble": [], "wall_bubble": [], "wall_s": [], "busy_s": [],
           "stage_parameters": [sum(p.numel() for p in st.parameters()) for st in stages]}
    for step in range(steps):
        x, y = _batch(batch, size, seed=100 + step)
        xs, ys = list(x.split(mb)), list(y.split(mb))
        with torch.no_grad():  # the activation shape entering this stage, for its receives
            h = x[:mb]
            for layer in serial.net[:cut_in[rank]]:
                h = layer(h)
            shape = tuple(h.shape)
        dist.barrier()  # every stage starts the step together: the wall clock below is shared
        r = stage.step(schedule, xs, ys, lambda i: shape, F.cross_entropy)
        wall = torch.tensor([r["wall_s"]], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when its slowest stage's last compute does
        busy = torch.tensor([r["busy_s"]], dtype=torch.float64)
        dist.all_reduce(busy)
        timelines = [None] * world
        dist.all_gather_object(timelines, r["timeline"])
        loss = torch.tensor([r["loss"] if stage.is_last else 0.0], dtype=torch.float64)
        dist.broadcast(loss, src=world - 1)
        opt.step()
        opt.zero_grad()
        serial_loss = F.cross_entropy(serial(x), y)
        serial_loss.backward()
        serial_opt.step()
        serial_opt.zero_grad()
        out["losses"].append(float(loss))
        out["serial_losses"].append(float(serial_loss))
        out["wall_s"].append(float(wall))
        out["busy_s"].append(r["busy_s"])
        out["bubble"].append(replay_bubble(timelines)["bubble"])
        out["wall_bubble"].append(1 - float(busy) / world / float(wall))
    # the replayed bubble of the best step after the first (which pays for warm-up): load only ever adds to it;
    # the wall clock's is the median step's
    out.update(timelines=timelines, peak_in_flight=r["peak_in_flight"], formula=bubble_formula(world, micro),
               activation_bytes_per_micro=int(torch.Size(shape).numel()) * 4,
               measured_bubble=min(out["bubble"][1:] or out["bubble"]),
               measured_wall_bubble=_median(out["wall_bubble"][1:] or out["wall_bubble"]))
    return out


def pipeline_figure(result: dict, title: str = ""):
    """A step's per-stage timeline (forwards blue, backwards orange, micro-batch numbers on the boxes), replayed
    with each stage's typical compute times as `replay_bubble` counts them; the gaps are the bubble."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 0.7 + 0.6 * len(result["timelines"])))
    ax = fig.add_subplot()
    replayed = replay_bubble(result["timelines"])
    for s, timeline in enumerate(replayed["timelines"]):
        for (op, i, _, dur), start in zip(timeline, replayed["starts"][s]):
            ax.broken_barh([(start * 1e3, dur * 1e3)], (s - 0.4, 0.8), color="#4c72b0" if op == "F" else "#dd8452")
            ax.text((start + dur / 2) * 1e3, s, str(i), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(result["timelines"])), [f"stage {s}" for s in range(len(result["timelines"]))])
    ax.invert_yaxis()
    ax.set_xlabel("ms into the step (forward blue, backward orange)")
    ax.set_title(title or f"{result['schedule']}, {result['micro']} micro-batches: bubble "
                          f"{result['measured_bubble']:.2f} (formula {result['formula']:.2f})")
    return fig


def pipeline_schedule_runs(spec, schedules: dict[str, str], out_dir, timeout: float = 180) -> dict:
    """Train `spec` (strategy pp) once per schedule, {name: pipeline.schedule}: the engine's schedules (gpipe,
    1f1b), torch's (torch-gpipe, torch-1f1b) or a student's module:function, each into out_dir/<name>; the runs
    go side by side (started together: the bytes and losses do not depend on load, and the bubble is replayed from
    each operation's fastest time). Per name: schedule, run_dir, stages, micro, loss_curve, final_loss, and from the
    run's `pipeline` events (train/pipeline.py) the activation_peak_bytes and peak_in_flight of each stage, the
    operations each stage ran (`ops`), the bubble (the least after the first step) and its formula
    (p-1)/(m+p-1). A student's schedule is first checked here as every rank would check it (`plan_schedule`,
    reading <module>.py afresh from the working folder): one the engine would refuse (not implemented yet,
    incomplete, out of order, would deadlock) starts no run. A refused schedule, or a run that fails or outlasts
    `timeout`, gives {"schedule", "run_dir", "error"}, printed; the other schedules still run."""
    from ..errors import RunTimeout, ScalelabError
    from ..launch import launch
    rows, started = {}, {}
    for name, schedule in schedules.items():
        run_spec = spec.with_overrides({"strategy": "pp", "pipeline.schedule": schedule, "name": name,
                                        "output_dir": str(Path(out_dir) / name)})
        try:
            _precheck(schedule, run_spec.world_size, run_spec.pipeline.micro_batches)
            started[name] = (run_spec, launch(run_spec))
        except ScalelabError as e:
            rows[name] = _refused(name, schedule, run_spec.output_dir, e)
    for name, (run_spec, run) in started.items():
        schedule = run_spec.pipeline.schedule
        try:
            summary = run.wait(timeout=timeout)
        except ScalelabError as e:
            if isinstance(e, RunTimeout):
                run.stop()
            rows[name] = _refused(name, schedule, run.run_dir, e)
            continue
        last: dict = {}
        for e in run.events():
            if e["type"] == "pipeline":
                last.setdefault(e["stage"], []).append(e)
        stages = [last[s][-1] for s in sorted(last)]
        bubbles = [e["bubble"] for e in last.get(0, []) if e.get("bubble") is not None]
        p, m = run_spec.world_size, run_spec.pipeline.micro_batches
        rows[name] = {"schedule": schedule, "run_dir": str(run.run_dir), "stages": p, "micro": m,
                      "loss_curve": summary["loss_curve"], "final_loss": summary["final_loss"],
                      "activation_peak_bytes": [e["activation_peak_bytes"] for e in stages],
                      "peak_in_flight": [e["peak_in_flight"] for e in stages], "ops": [e["ops"] for e in stages],
                      "bubble": min(bubbles[1:] or bubbles) if bubbles else None, "formula": bubble_formula(p, m)}
    return {name: rows[name] for name in schedules}


def layout_runs(spec, layouts: dict[str, dict], out_dir, timeout: float = 300) -> dict:
    """Train `spec` once per layout, {name: spec changes} (e.g. {"ddp": {}, "tp": {"strategy": "tp"}}), into
    out_dir/<name>, one run after another (on a few cores, runs side by side would take each other's tokens/s).
    Per name: strategy, run_dir, world, loss_curve (each step's loss averaged over the ranks that report it: under
    ddp and fsdp a rank's is that of its own part of the batch, under tp and pp every rank reports the whole
    batch's), tokens_per_s (median of rank 0's steps after the first), and from rank 0's `memory` event the bytes
    of parameters, gradients and optimizer state it holds (state_bytes), its device peak where there is a device,
    and the step's collectives (comm)."""
    from ..launch import launch
    rows = {}
    for name, changes in layouts.items():
        run_spec = spec.with_overrides({**changes, "name": name, "output_dir": str(Path(out_dir) / name)})
        run = launch(run_spec)
        summary = run.wait(timeout=timeout)
        events = run.events()
        steps = [e for e in events if e["type"] == "step"]
        per_step: dict = {}
        for e in steps:
            per_step.setdefault(e["step"], []).append(e["loss"])
        memory = next(e for e in events if e["type"] == "memory" and e["rank"] == 0)
        speed = [e["tokens_per_s"] for e in steps if e["rank"] == 0 and e.get("tokens_per_s")][1:]
        rows[name] = {"strategy": run_spec.strategy, "run_dir": str(run.run_dir), "world": run_spec.world_size,
                      "offload": bool(run_spec.fsdp.offload and run_spec.strategy == "fsdp"),
                      "loss_curve": [sum(v) / len(v) for _, v in sorted(per_step.items())],
                      "final_loss": summary["final_loss"], "tokens_per_s": _median(speed) if speed else None,
                      **{k: memory[k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "state_bytes",
                                                "device_peak_bytes") if k in memory},
                      "comm": memory.get("comm", {})}
    return rows


def _precheck(schedule: str, stages: int, micro: int) -> None:
    """Check a student's schedule (module:function, <module>.py in the working folder, read afresh: the kernel may
    hold an older import) as every rank checks it before the first step; SpecError if the engine would refuse it."""
    import importlib.util
    import sys
    from ..train import pipeline
    module, _, function = schedule.partition(":")
    path = Path.cwd() / f"{module}.py"
    if not function or "." in module or not path.is_file():
        return  # a built-in or installed schedule: the ranks check it
    spec = importlib.util.spec_from_file_location(module, path)
    fresh = importlib.util.module_from_spec(spec)
    saved = sys.modules.get(module)
    sys.modules[module] = fresh
    try:
        try:
            spec.loader.exec_module(fresh)
        except Exception:
            return  # the ranks' import reports it, with the field
        pipeline.plan_schedule(schedule, stages, micro)
    finally:
        if saved is None:
            sys.modules.pop(module, None)
        else:
            sys.modules[module] = saved


def _refused(name: str, schedule: str, run_dir, error: Exception) -> dict:
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(f"{name}: {schedule} did not run: {message}")
    return {"schedule": schedule, "run_dir": str(run_dir), "error": message}


def _median(xs: list) -> float:
    return sorted(xs)[len(xs) // 2]


def _sharded_model(width: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = _mlp(width, 2, seed=seed)
    rank, world = _rank_world()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    for pid, state in osd.get("state", {}).items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                flat[f"optim.{pid}.{k}"] = v
    return flat


def reshard_save(ckpt_dir: str, width: int = 64, steps: int = 3, seed: int = 0) -> dict:
    """Train an (FSDP-sharded when world > 1) MLP with Adam a few steps, save it sharded at `steps`; returns the
    full state's checksums and the bytes this rank held."""
    model = _sharded_model(width, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = _batch(8, seed=step + _rank_world()[0] * 1000)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    rank, world = _rank_world()
    ckpt = ShardedCheckpointer(ckpt_dir, rank=rank, world=world)
    ckpt.save(steps, model, opt)
    ckpt.close()
    return {"world": world, "state": _digest(_full_state(model, opt))}


def reshard_restore(ckpt_dir: str, save_dir: str = "", width: int = 64, seed: int = 1) -> dict:
    """Restore the newest checkpoint of `ckpt_dir` into a freshly made model (a different seed: nothing but the
    checkpoint can make it equal) at this world size; save it again to `save_dir` if given."""
    model = _sharded_model(width, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(8)
    F.cross_entropy(model(x), y).backward()  # Adam's state must exist for the checkpoint's to load into it
    opt.step()
    opt.zero_grad()
    rank, world = _rank_world()
    ckpt = ShardedCheckpointer(ckpt_dir, rank=rank, world=world)
    step = ckpt.restore(model, opt)
    out = {"world": world, "step": step, "state": _digest(_full_state(model, opt))}
    if save_dir:
        again = ShardedCheckpointer(save_dir, rank=rank, world=world)
        again.save(step, model, opt)
        again.close()
    return out


def _digest(flat: dict) -> dict:
    """name -> [sum, sum of squares, first element] in float64: equal states give identical digests."""
    return {k: [float(v.double().sum()), float((v.double() ** 2).sum()), float(v.flatten()[0])]
            for k, v in sorted(flat.items())}


__all__ = ["tensor_parallel_check", "dtensor_parallel_check", "mesh_2d_state", "pipeline_measure", "pipeline_figure",
           "pipeline_schedule_runs", "reshard_save", "reshard_restore"]
