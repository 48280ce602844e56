"""Lab 10: a simulation in the training loop — a heat-equation solver produces fields while a surrogate trains on them.

    ranks = run_spmd("scalelab.experiments.online:online_rank", world=2, kwargs={"out_dir": str(out / "online"),
                     "buffer": 256, "keep": "my_buffer:keep"})
    ranks[-1]["error"]          # the surrogate's relative L2 error on held-out solver outputs, per regime
    ranks[-1]["speedup"]        # solver seconds per sample / surrogate seconds per sample, measured here
    read_stream_events(out / "online")   # what each rank wrote: produced, consumed, trained, evaluated

Online training (Argonne's and others' "simulation in the loop"): the simulation does not write a data set that a
training job reads later; its ranks produce samples while training ranks consume them. Here the first world-1
ranks are **solvers**: each integrates the 2-D heat equation u_t = kappa * laplacian(u) (periodic, explicit, fine
grid 3 times finer and the time steps that grid allows, averaged back — the accurate, expensive way) from random initial fields, chunk after chunk, and publishes each chunk
to a stream folder (written to a temporary name and renamed: a reader never sees half a chunk). The last rank is
the **trainer**: it waits for chunk after chunk, in order, trains a small convolutional surrogate that maps
(initial field, kappa) to the field at time T on it, and keeps a rehearsal buffer (`workflows.ReplayBuffer`, the
student's keep() from `my_buffer.py` when given). The regime drifts: the first half of the chunks comes from low
diffusivities, the second from high ones, so a surrogate trained on the newest chunks only forgets the first
regime. At the end the trainer measures the surrogate's error on held-out solver outputs of every regime and its
speed against the solver's (one core each here: a figure of this machine, not of a real simulation code).

Every rank appends JSON lines to `<out_dir>/stream-events/<role>-<rank>.jsonl` (`produced`, `consumed`, `trained`,
`evaluated`, with wall-clock times and pids): the lab's checks read both roles' files and see them run at once.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import random_blobs
from ..errors import SpecError

REGIMES = ((0.02, 0.06), (0.18, 0.24))
"""Diffusivity ranges of the drift, in the order the solvers produce them (stable: kappa * dt <= 0.25)."""
EVENTS_DIR = "stream-events"
STREAM_DIR = "stream"
WAIT_S = 120.0
"""How long the trainer waits for the next chunk before it gives up (a solver that died)."""


def solve(u0: np.ndarray, kappa: np.ndarray, steps: int, refine: int = 3) -> np.ndarray:
    """The field after `steps` time units of u_t = kappa * laplacian(u) on a periodic grid, solved the accurate
    way: on a grid `refine` times finer (each cell split in refine x refine), with the explicit Euler step that
    grid allows (dt = 1 / (4 refine^2): stable for kappa <= 1), then averaged back onto the coarse grid."""
    u = np.repeat(np.repeat(u0.astype(np.float32), refine, 1), refine, 2)
    substeps = 4 * refine * refine
    k = (kappa.astype(np.float32) * refine * refine / substeps)[:, None, None]  # kappa dt / dx^2 on the fine grid
    for _ in range(steps * substeps):
        u += k * (np.roll(u, 1, 1) + np.roll(u, -1, 1) + np.roll(u, 1, 2) + np.roll(u, -1, 2) - 4 * u)
    n, h, w = u0.shape
    return u.reshape(n, h, refine, w, refine).mean(axis=(2, 4))


def solver_samples(rng, n: int, size: int, regime, steps: int, refine: int = 3):
    """(inputs (n, 2, size, size): initial field and kappa, targets (n, 1, size, size), seconds the solve took)."""
    u0 = random_blobs(rng, n, size)
    kappa = rng.uniform(*regime, n).astype(np.float32)
    t0 = time.perf_counter()
    u = solve(u0, kappa, steps, refine)
    took = time.perf_counter() - t0
    x = np.stack([u0, np.broadcast_to(kappa[:, None, None], u0.shape)], 1).astype(np.float32)
    return x, u[:, None].astype(np.float32), took


def surrogate(seed: int = 0) -> nn.Module:
    """Three periodic 5x5 convolutions: (initial field, kappa) -> the field at time T."""
    torch.manual_seed(seed)
    conv = dict(kernel_size=5, padding=2, padding_mode="circular")
    return nn.Sequential(nn.Conv2d(2, 16, **conv), nn.GELU(), nn.Conv2d(16, 16, **conv), nn.GELU(),
                         nn.Conv2d(16, 1, **conv))


def regime_of(chunk: int, chunks: int, regimes=REGIMES) -> int:
    """The regime chunk `chunk` of `chunks` comes from: the stream drifts through `regimes` in equal parts."""
    return chunk * len(regimes) // chunks


class _Log:
    def __init__(self, out: Path, role: str, rank: int):
        (out / EVENTS_DIR).mkdir(parents=True, exist_ok=True)
        self.path = out / EVENTS_DIR / f"{role}-{rank}.jsonl"
        self.path.write_text("")
        self.base = {"role": role, "rank": rank, "pid": os.getpid()}

    def __call__(self, kind: str, **fields) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"type": kind, "t": time.time(), **self.base, **fields}) + "\n")


def online_rank(out_dir: str, chunks: int = 12, chunk_size: int = 48, size: int = 24, steps: int = 8,
                refine: int = 3, steps_per_chunk: int = 10, batch: int = 16, buffer: int = 0,
                keep: str | None = None, lr: float = 2e-3, seed: int = 0, held_out: int = 48) -> dict:
    """One rank of the online run (an SPMD target): rank < world - 1 solves and publishes chunks, the last rank
    trains on them as they arrive (see the module's docstring). `out_dir` must hold no earlier run's stream
    (`compare` empties it). Returns what this rank did."""
    from ..dist import get_rank, get_world_size
    rank, world = get_rank(), get_world_size()
    if world < 2:
        raise SpecError("world", "online training needs at least 2 ranks: solvers and a trainer")
    torch.set_num_threads(1)
    out = Path(out_dir)
    (out / STREAM_DIR).mkdir(parents=True, exist_ok=True)
    if rank < world - 1:
        return _solver(out, rank, world - 1, chunks, chunk_size, size, steps, refine, seed)
    return _trainer(out, rank, chunks, size, steps, refine, steps_per_chunk, batch, buffer, keep, lr, seed,
                    held_out)


def _solver(out: Path, rank: int, solvers: int, chunks: int, chunk_size: int, size: int, steps: int,
            refine: int, seed: int) -> dict:
    log = _Log(out, "solver", rank)
    solved = 0.0
    mine = list(range(rank, chunks, solvers))
    for chunk in mine:
        regime = regime_of(chunk, chunks)
        x, y, took = solver_samples(np.random.default_rng([seed, chunk]), chunk_size, size, REGIMES[regime],
                                    steps, refine)
        solved += took
        tmp = out / STREAM_DIR / f".chunk-{chunk:04d}.npz.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, x=x, y=y)
        os.replace(tmp, out / STREAM_DIR / f"chunk-{chunk:04d}.npz")  # a reader sees all of it or none
        log("produced", chunk=chunk, regime=regime, samples=chunk_size, solve_s=took)
    return {"role": "solver", "rank": rank, "chunks": mine, "solve_s": solved,
            "solve_s_per_sample": solved / max(1, len(mine) * chunk_size)}


def _trainer(out: Path, rank: int, chunks: int, size: int, steps: int, refine: int, steps_per_chunk: int,
             batch: int, buffer: int, keep: str | None, lr: float, seed: int, held_out: int) -> dict:
    from .workflows import ReplayBuffer, reservoir_keep
    log = _Log(out, "trainer", rank)
    keep_fn, code = reservoir_keep, {}
    if keep and buffer:
        from .own_code import load_own
        keep_fn, code = load_own(keep)
    model = surrogate(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    replay = ReplayBuffer(buffer, seed + 7, keep_fn) if buffer else None
    g = torch.Generator().manual_seed(seed)
    waited, losses, errors_after = 0.0, [], []
    held = [solver_samples(np.random.default_rng([seed, 10_000 + r]), held_out, size, regime, steps, refine)
            for r, regime in enumerate(REGIMES)]
    for chunk in range(chunks):
        path, t0 = out / STREAM_DIR / f"chunk-{chunk:04d}.npz", time.monotonic()
        while not path.exists():
            if time.monotonic() - t0 > WAIT_S:
                raise TimeoutError(f"chunk {chunk} did not arrive in {WAIT_S:.0f} s: did a solver rank die?")
            time.sleep(0.01)
        waited += time.monotonic() - t0
        with np.load(path) as f:
            x, y = torch.from_numpy(f["x"]), torch.from_numpy(f["y"])
        regime = regime_of(chunk, chunks)
        log("consumed", chunk=chunk, regime=regime, wait_s=time.monotonic() - t0)
        for _ in range(steps_per_chunk):
            idx = torch.randint(0, len(x), (batch,), generator=g)
            xb, yb = x[idx], y[idx]
            if replay is not None and replay.x:
                rx, ry = replay.sample(batch)
                xb, yb = torch.cat([xb, rx]), torch.cat([yb, ry])
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(float(loss))
        if replay is not None:
            replay.add(x, y, regime)
        log("trained", chunk=chunk, loss=float(loss), steps=steps_per_chunk)
        if chunk + 1 == chunks or regime_of(chunk + 1, chunks) != regime:
            errors_after.append(_errors(model, held))
    error = errors_after[-1]
    per_sample = _inference_s(model, held[0][0])
    solve_per_sample = sum(h[2] for h in held) / sum(len(h[0]) for h in held)
    log("evaluated", error=error, errors_after=errors_after, surrogate_s_per_sample=per_sample,
        solver_s_per_sample=solve_per_sample, buffer=buffer,
        buffer_regimes=replay.by_task(len(REGIMES)) if replay is not None else [0] * len(REGIMES), code=code)
    return {"role": "trainer", "rank": rank, "error": error, "errors_after": errors_after, "losses": losses,
            "waited_s": waited, "surrogate_s_per_sample": per_sample, "solver_s_per_sample": solve_per_sample,
            "speedup": solve_per_sample / per_sample, "buffer": buffer, "code": code,
            "buffer_regimes": replay.by_task(len(REGIMES)) if replay is not None else [0] * len(REGIMES),
            "forgetting": errors_after[-1][0] - errors_after[0][0]}


@torch.no_grad()
def _errors(model: nn.Module, held) -> list[float]:
    """Relative L2 error of the surrogate on each regime's held-out solver outputs."""
    return [float((model(torch.from_numpy(x)) - torch.from_numpy(y)).norm() / torch.from_numpy(y).norm())
            for x, y, _ in held]


@torch.no_grad()
def _inference_s(model: nn.Module, x: np.ndarray, repeats: int = 5) -> float:
    """Seconds per sample of the surrogate on `x` (after one warm-up pass; the best of `repeats`)."""
    xt = torch.from_numpy(x)
    model(xt)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(xt)
        best = min(best, time.perf_counter() - t0)
    return best / len(x)


def compare(out_dir, buffers=(0, 256), keep: str | None = None, world: int = 2, timeout: float = 300,
            **kwargs) -> dict:
    """An online run (`online_rank` on `world` SPMD ranks: world-1 solvers, one trainer) for each buffer size,
    each in `out_dir`/buffer-<size>; `keep` ("my_buffer:keep") is every buffer's policy. A keep() that raises
    NotImplementedError (an exercise not written yet) is found before launching: its runs are left out.
    Returns {"runs": {str(size): {"dir", "trainer", "solvers"}}, "not_implemented": [sizes]}."""
    from ..launch.spmd import run_spmd
    from .own_code import load_own, not_written
    runs, missing = {}, []
    for b in buffers:
        if b and keep:
            try:
                load_own(keep)[0](1, 1, np.random.default_rng(0))
            except NotImplementedError:
                missing.append(b)
                print(not_written(keep))
                continue
        folder = Path(out_dir) / f"buffer-{b}"
        shutil.rmtree(folder, ignore_errors=True)  # a stream folder holds this run's chunks only
        ranks = run_spmd("scalelab.experiments.online:online_rank", world=world, timeout=timeout,
                         kwargs={"out_dir": str(folder), "buffer": b, "keep": keep, **kwargs})
        runs[str(b)] = {"dir": str(folder), "trainer": ranks[-1], "solvers": ranks[:-1]}
    return {"runs": runs, "not_implemented": missing}


def read_stream_events(out_dir) -> dict[str, list[dict]]:
    """{file stem ("solver-0", "trainer-1"): its events} of an online run's folder."""
    folder = Path(out_dir) / EVENTS_DIR
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in sorted(folder.glob("*.jsonl"))}


def overlap(events: dict[str, list[dict]]) -> dict:
    """How the roles ran in time: when the solvers produced their first and last chunk, when the trainer consumed
    and trained, and how many chunks the trainer had trained on before the last one was produced (> 0: the two ran
    at the same time)."""
    produced = {e["chunk"]: e["t"] for k, evs in events.items() if k.startswith("solver")
                for e in evs if e.get("type") == "produced"}
    trained = {e["chunk"]: e["t"] for k, evs in events.items() if k.startswith("trainer")
               for e in evs if e.get("type") == "trained"}
    last = max(produced.values()) if produced else float("nan")
    return {"chunks_produced": len(produced), "chunks_trained": len(trained),
            "trained_before_last_produced": sum(t < last for t in trained.values()),
            "consumed_before_produced": sum(1 for c, t in trained.items() if c not in produced or t < produced[c])}


__all__ = ["REGIMES", "solve", "solver_samples", "surrogate", "regime_of", "online_rank", "compare",
           "read_stream_events", "overlap", "EVENTS_DIR"]
