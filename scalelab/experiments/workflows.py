"""Lab 10: workflows for science — a lineage store of models that share tensors with their parents, continual
learning on a drifting stream of heat-equation fields (forgetting, then a rehearsal buffer spread over the
ranks), and (lab 11, ML for HPC) a performance model fitted on a grid of the course's own engine runs and tested
on runs between the grid's points.

    store = LineageStore(out / "lineage"); store.put("child", model.state_dict(), parent="parent")
    acc = continual_run(tasks=3, buffer=200, keep="my_buffer:keep")  # or on ranks: run_spmd(".../continual_run")
    sweep = perf_sweep(out / "perf", [16, 64, 256], [16, 64], [1, 2])  # 12 runs on the grid, 4 between its points
    fit = fit_perf_model(train_rows); error = holdout_error(fit, held_rows)
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import heat_fields


# -- a lineage store -----------------------------------------------------------------------------------------
class LineageStore:
    """Models as manifests of content-addressed tensors (EvoStore-style): a tensor a child shares with its parent
    (a transferred layer it did not change) is stored once. `objects/<sha256>.npy` holds one tensor each;
    `models/<id>.json` maps parameter names to hashes and names the parent."""

    def __init__(self, root):
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        (self.root / "models").mkdir(parents=True, exist_ok=True)

    @staticmethod
    def digest(t: torch.Tensor) -> str:
        """sha256 of a tensor's dtype, shape and bytes."""
        t = t.detach().contiguous().cpu()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def put(self, model_id: str, state: dict, parent: str | None = None, meta: dict | None = None) -> dict:
        """Store a state dict; returns {"new_bytes", "shared": names stored already}."""
        if not model_id or "/" in model_id or model_id.startswith("."):
            raise ValueError(f"model id {model_id!r}: use a plain name (letters, digits, - and _)")
        if parent is not None and not (self.root / "models" / f"{parent}.json").exists():
            raise KeyError(f"parent {parent!r} is not in the store at {self.root}: put it first")
        tensors, new_bytes, shared = {}, 0, []
        for name, t in state.items():
            key = self.digest(t)
            path = self.root / "objects" / f"{key}.npy"
            if path.exists():
                shared.append(name)
            else:
                tmp = path.with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    np.save(f, t.detach().cpu().numpy())
                os.replace(tmp, path)
                new_bytes += path.stat().st_size
            tensors[name] = key
        manifest = {"id": model_id, "parent": parent, "tensors": tensors, "meta": meta or {},
                    "full_bytes": sum(t.numel() * t.element_size() for t in state.values())}
        (self.root / "models" / f"{model_id}.json").write_text(json.dumps(manifest, indent=1))
        return {"new_bytes": new_bytes, "shared": shared}

    def manifest(self, model_id: str) -> dict:
        path = self.root / "models" / f"{model_id}.json"
        if not path.exists():
            raise KeyError(f"no model {model_id!r} in the store at {self.root}")
        return json.loads(path.read_text())

    def get(self, model_id: str) -> dict:
        """The state dict of a stored model, tensor for tensor."""
        return {name: torch.from_numpy(np.load(self.root / "objects" / f"{key}.npy", allow_pickle=False))
                for name, key in self.manifest(model_id)["tensors"].items()}

    def lineage(self, model_id: str) -> list[str]:
        """The model, its parent, its grandparent ... back to a root."""
        chain = [model_id]
        while (parent := self.manifest(chain[-1])["parent"]) is not None:
            chain.append(parent)
        return chain

    def sizes(self) -> dict:
        """Bytes the store's tensors take on disk against the bytes of a full copy of every model."""
        models = [json.loads(p.read_text()) for p in sorted((self.root / "models").glob("*.json"))]
        stored = sum(p.stat().st_size for p in (self.root / "objects").glob("*.npy"))
        full = sum(m["full_bytes"] for m in models)
        return {"models": len(models), "stored_bytes": stored, "full_copy_bytes": full,
                "dedup_ratio": full / stored if stored else 1.0}


# -- continual learning ---------------------------------------------------------------------------------------
def drifting_tasks(tasks: int = 3, per_task: int = 600, size: int = 16, seed: int = 0):
    """The stream: task t holds the heat fields of diffusivity classes 2t and 2t+1 (a regime shift: the fields of
    each task are smoother than the last's). Returns [(x_train, y_train, x_test, y_test)] per task."""
    classes = 2 * tasks
    x, y = heat_fields(per_task * tasks * 5 // 4, size, classes, seed)  # per task: 4/5 train, 1/5 test
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    out = []
    for t in range(tasks):
        idx = torch.nonzero((y == 2 * t) | (y == 2 * t + 1)).flatten()
        cut = len(idx) * 4 // 5
        out.append((x[idx[:cut]], y[idx[:cut]], x[idx[cut:]], y[idx[cut:]]))
    return out


def reservoir_keep(seen: int, capacity: int, rng) -> int | None:
    """Reservoir sampling (Vitter's algorithm R), the library's answer to lab 10's exercise 5: the `seen`-th sample
    of the stream (1-based) takes slot seen - 1 while the buffer has room, then replaces a random slot with
    probability capacity / seen: every sample seen so far is in the buffer with the same chance."""
    if seen <= capacity:
        return seen - 1
    j = int(rng.integers(0, seen))
    return j if j < capacity else None


class ReplayBuffer:
    """A rehearsal buffer of at most `capacity` samples; `keep(seen, capacity, rng)` decides where each new sample
    goes (a slot to fill or replace, None: dropped). Tracks which task each kept sample came from."""

    def __init__(self, capacity: int, seed: int, keep=reservoir_keep):
        self.capacity, self.seen, self.x, self.y, self.task = capacity, 0, [], [], []
        self.keep, self.rng = keep, np.random.default_rng(seed)

    def add(self, xb, yb, task: int = 0):
        for xi, yi in zip(xb, yb):
            self.seen += 1
            slot = self.keep(self.seen, self.capacity, self.rng)
            if slot is None:
                continue
            if isinstance(slot, (np.integer,)):
                slot = int(slot)
            if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot <= min(len(self.x),
                                                                                         self.capacity - 1):
                raise ValueError(f"keep({self.seen}, {self.capacity}, rng) returned {slot!r}: it must return a slot "
                                 f"0..{min(len(self.x), self.capacity - 1)} (the buffer holds {len(self.x)} samples; "
                                 f"slot {len(self.x)} appends) or None to drop the sample")
            if slot == len(self.x):
                self.x.append(xi)
                self.y.append(yi)
                self.task.append(task)
            else:
                self.x[slot], self.y[slot], self.task[slot] = xi, yi, task

    def sample(self, n: int):
        idx = self.rng.integers(0, len(self.x), n)
        return torch.stack([self.x[i] for i in idx]), torch.stack([self.y[i] for i in idx])

    def by_task(self, tasks: int) -> list[int]:
        """How many buffered samples came from each task."""
        return [self.task.count(t) for t in range(tasks)]


def _cl_model(size: int, classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, classes))


@torch.no_grad()
def _accuracy(model, x, y) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def continual_run(tasks: int = 3, buffer: int = 0, steps_per_task: int = 150, batch: int = 32, lr: float = 0.05,
                  per_task: int = 600, seed: int = 0, keep: str | None = None) -> dict:
    """Train one model on the tasks in order. With `buffer` > 0, each rank keeps a rehearsal buffer of buffer/W past
    samples and half of every batch is replayed from it (on W ranks the buffer is spread over them; gradients
    are averaged, so the model sees the whole buffer). `keep` ("module:function" beside the notebook, e.g.
    "my_buffer:keep", loaded afresh: experiments/own_code.py) decides what the buffer keeps; default: reservoir
    sampling. Returns acc[i][j]: accuracy on task j's test set after training task i, the final mean accuracy on
    the old tasks, forgetting per task (best minus final), and the buffer's samples per task after each task
    (`buffer_tasks`) with the SHA-256 of the `keep` code that ran (`code`)."""
    torch.set_num_threads(1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() \
        else (0, 1)
    keep_fn, code = reservoir_keep, {}
    if keep and buffer:
        from .own_code import load_own
        keep_fn, code = load_own(keep)
    stream = drifting_tasks(tasks, per_task, seed=seed)
    model = _cl_model(stream[0][0].shape[-1], 2 * tasks, seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    replay = ReplayBuffer(buffer // world, seed + 1000 + rank, keep_fn) if buffer else None
    buffer_tasks = []
    g = torch.Generator().manual_seed(seed + rank)
    acc = []
    for t, (x, y, _, _) in enumerate(stream):
        mine = torch.arange(rank, len(x), world)  # this rank's share of the task's stream
        for _ in range(steps_per_task):
            idx = mine[torch.randint(0, len(mine), (batch,), generator=g)]
            xb, yb = x[idx], y[idx]
            if replay is not None and replay.x:
                rx, ry = replay.sample(batch // 2)
                xb, yb = torch.cat([xb[: batch - batch // 2], rx]), torch.cat([yb[: batch - batch // 2], ry])
            F.cross_entropy(model(xb), yb).backward()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            opt.zero_grad()
            if replay is not None:
                replay.add(x[idx], y[idx], t)
        acc.append([_accuracy(model, xt, yt) for (_, _, xt, yt) in stream])
        buffer_tasks.append(replay.by_task(tasks) if replay is not None else [0] * tasks)
    old = [acc[-1][j] for j in range(tasks - 1)]
    return {"acc": acc, "old_accuracy": sum(old) / len(old) if old else float("nan"),
            "final_accuracy": sum(acc[-1]) / tasks, "buffer": buffer, "buffer_per_rank": buffer // world,
            "forgetting": [max(acc[i][j] for i in range(j, tasks)) - acc[-1][j] for j in range(tasks - 1)],
            "world": world, "rank": rank, "steps_per_task": steps_per_task, "batch": batch,
            "buffer_tasks": buffer_tasks, "seen": replay.seen if replay is not None else 0, "code": code}


def continual_compare(buffers, keep: str | None = None, **kwargs) -> dict:
    """`continual_run` for each buffer size (`keep` deciding what each buffer keeps): {"runs": {str(size):
    result}, "not_implemented": [sizes whose keep raised NotImplementedError: an exercise not written yet]}."""
    from .own_code import not_written
    runs, missing = {}, []
    for b in buffers:
        try:
            runs[str(b)] = continual_run(buffer=b, keep=keep, **kwargs)
        except NotImplementedError:
            missing.append(b)
    if missing:
        print(not_written(keep or "my_buffer:keep"))
    return {"runs": runs, "not_implemented": missing}


# -- a performance model from the course's own runs ---------------------------------------------------------
FEATURES = ("log_params", "log_batch", "log_ranks", "log_nodes", "log_link")


def run_rows(root, links: dict | None = None) -> list[dict]:
    """One row per finished engine run under `root` (every folder with spec.json and events): its shape
    (parameters, batch per rank, ranks, nodes, link rate) and its measured samples/s. `links` maps a run folder
    to the rate its links were shaped to (e.g. "100mbit"); others count as unshaped."""
    from ..run.events import EventReader
    from ..run.metrics import summarize
    rows = []
    for spec_path in sorted(Path(root).rglob("spec.json")):
        run_dir = spec_path.parent
        if not (run_dir / "events").is_dir():
            continue
        spec = json.loads(spec_path.read_text())
        world = spec["world"]["workers_per_node"] * spec["world"]["nodes"]
        events = last_launch(EventReader(run_dir).poll())
        params = next((e.get("parameters") for e in events if e["type"] == "start" and e.get("parameters")), None)
        s = summarize(events, world)
        if not s.get("samples_per_s") or not params:
            continue
        rows.append({"run_dir": str(run_dir), "params": params, "batch": spec["optim"]["batch_per_worker"],
                     "ranks": world, "nodes": spec["world"]["nodes"],
                     "link_mbit": link_mbit((links or {}).get(str(run_dir), "")),
                     "samples_per_s": s["samples_per_s"]})
    return rows


def perf_shapes(widths, batches, ranks) -> tuple[list[tuple], list[tuple]]:
    """The performance model's runs: (width, batch per rank, ranks) on the full grid of `widths` x `batches` x
    `ranks` (what the model is fitted on), and held-out shapes *between* the grid's points (the geometric means of
    neighbouring widths, at the geometric mean of the smallest two batches, on each rank count): runs the model
    has to interpolate, not repeat. 3 widths x 2 batches x 2 rank counts give 12 fitted runs and 4 held out."""
    widths, batches, ranks = (sorted({int(v) for v in xs}) for xs in (widths, batches, ranks))
    for name, xs, least in (("perf_widths", widths, 2), ("perf_batches", batches, 2), ("perf_ranks", ranks, 1)):
        if len(xs) < least or xs[0] < 1:
            raise ValueError(f"{name} {xs}: give at least {least} different positive values (a model fitted on one "
                             "value of a feature cannot learn its effect)")
    grid = [(w, b, n) for w in widths for b in batches for n in ranks]
    mid_b = round(math.sqrt(batches[0] * batches[1]))
    held = [(round(math.sqrt(a * b)), mid_b, n) for a, b in zip(widths, widths[1:]) for n in ranks]
    return grid, [h for h in held if h not in grid]


def perf_sweep(out, widths, batches, ranks, *, steps: int = 8, device: str = "cpu", samples: int = 2048,
               timeout: float = 300) -> dict:
    """Run the performance model's engine runs (`perf_shapes`), one after another (they must not compete for
    the cores they time), each the tiny preset's MLP at its width and batch per rank, one thread per rank, under
    `out`/w<width>-b<batch>-r<ranks>. Returns {"rows": run_rows(out) of these runs, "held_out": the held-out runs'
    folders}."""
    from ..launch import launch
    from ..run.spec import preset
    grid, held = perf_shapes(widths, batches, ranks)
    if max(b * n for _, b, n in grid + held) > samples:
        raise ValueError(f"a run's global batch (batch per rank x ranks) exceeds its {samples} samples: lower "
                         "perf_batches or perf_ranks")
    dirs = {}
    for width, batch, n in grid + held:
        tag = f"w{width}-b{batch}-r{n}"
        spec = preset("tiny").replace(name=f"perf-{tag}", output_dir=str(Path(out) / tag)).with_overrides({
            "device": device, "model.name": "mlp", "model.width": width, "optim.batch_per_worker": batch,
            "world.workers_per_node": n, "world.threads_per_worker": 1, "steps": steps, "data.samples": samples})
        launch(spec).wait(timeout=timeout)
        dirs[(width, batch, n)] = spec.output_dir
    mine = set(dirs.values())
    rows = [r for r in run_rows(out) if r["run_dir"] in mine]
    return {"rows": rows, "held_out": [dirs[h] for h in held]}


def last_launch(events: list[dict]) -> list[dict]:
    """Each rank's events from its last start event on: a relaunch into the same folder appends a new launch
    to the rank files, and the row describes the run as it was last made (as Run.wait() reported it)."""
    last = {}
    for i, e in enumerate(events):
        if e.get("type") == "start":
            last[e["rank"]] = i
    return [e for i, e in enumerate(events) if i >= last.get(e.get("rank"), 0)]


def link_mbit(text: str) -> float:
    """A tc rate ('100mbit', '1gbit', '512kbit') in Mbit/s; empty: 10 Gbit/s (loopback, unshaped)."""
    units = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return 1e4


def features(row: dict) -> list[float]:
    """The model's inputs: logs of parameters, batch per rank, ranks, nodes, link rate (and a constant)."""
    return [1.0, math.log(row["params"]), math.log(row["batch"]), math.log(row["ranks"]), math.log(row["nodes"]),
            math.log(row["link_mbit"])]


def fit_perf_model(rows: list[dict], ridge: float = 1e-3) -> dict:
    """log(samples/s) as a linear function of the log features (a power law), by ridge least squares."""
    if len(rows) < 3:
        raise ValueError(f"{len(rows)} runs: a performance model needs at least 3 to fit")
    a = np.array([features(r) for r in rows])
    b = np.log([r["samples_per_s"] for r in rows])
    coef = np.linalg.solve(a.T @ a + ridge * np.eye(a.shape[1]), a.T @ b)
    return {"coef": coef.tolist(), "features": ["const", *FEATURES], "runs": len(rows)}


def predict(model: dict, row: dict) -> float:
    """Predicted samples/s of a run shape."""
    return float(math.exp(np.dot(model["coef"], features(row))))


def holdout_error(model: dict, rows: list[dict]) -> dict:
    """Mean and largest relative error of the model on runs it did not see."""
    errors = [abs(predict(model, r) - r["samples_per_s"]) / r["samples_per_s"] for r in rows]
    return {"mean_rel_error": sum(errors) / len(errors), "max_rel_error": max(errors), "runs": len(rows)}
