"""One slow reader slows everyone: in synchronous data parallelism a step ends when the slowest rank is done.

`synchronous_reads` measures it for real: one thread per simulated rank reads its batch through its own
store (one of them slower: a rank on a busy OST, a node with a failing disk), then all meet at a barrier,
like the gradient allreduce. `simulate_steps` is the same arithmetic without I/O, for sweeps.

    result = synchronous_reads(dataset_dir, ranks=4, steps=10, batch=16, open_latency_s=0.002,
                               straggler=3, slowdown=4.0)
    result["efficiency"]        # mean rank busy time / step time: 1.0 means nobody waited
"""
from __future__ import annotations

import threading
import time

import numpy as np

from ..data.formats import open_dataset
from ..data.order import sampler_order
from ..data.store import ThrottledStore


def simulate_steps(ranks: int, steps: int, work_s: float, straggler: int | None = None, slowdown: float = 1.0,
                   jitter: float = 0.0, seed: int = 0) -> dict:
    """Per-rank work times (lognormal jitter, one rank `slowdown` times slower) and the synchronous step time."""
    rng = np.random.default_rng(seed)
    work = work_s * np.exp(rng.normal(0.0, jitter, (steps, ranks))) if jitter else np.full((steps, ranks), work_s)
    if straggler is not None:
        work[:, straggler] *= slowdown
    return _summary(work)


def synchronous_reads(directory, ranks: int, steps: int, batch: int, open_latency_s: float = 0.002,
                      bandwidth: float = 0.0, straggler: int | None = None, slowdown: float = 1.0,
                      seed: int = 0) -> dict:
    """Real reads: each rank thread reads `batch` samples per step in its sampler order, then a barrier.

    Rank `straggler` reads through a store whose latency is `slowdown` times larger (and bandwidth smaller).
    """
    barrier = threading.Barrier(ranks)
    work = np.zeros((steps, ranks))
    errors: list[BaseException] = []

    def rank_main(r):
        slow = r == straggler
        store = ThrottledStore(directory, open_latency_s * (slowdown if slow else 1.0),
                               bandwidth / slowdown if (slow and bandwidth) else bandwidth)
        ds = open_dataset(directory, store)
        order = sampler_order(len(ds), r, ranks, seed, epochs=1 + steps * batch * ranks // max(len(ds), 1))
        try:
            for s in range(steps):
                t0 = time.perf_counter()
                for i in order[s * batch:(s + 1) * batch]:
                    ds.decode(ds.read(int(i)))
                work[s, r] = time.perf_counter() - t0
                barrier.wait()  # the allreduce: nobody starts the next step before the slowest is done
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return _summary(work)


def _summary(work: np.ndarray) -> dict:
    step = work.max(axis=1)
    waited = step[:, None] - work
    return {"ranks": int(work.shape[1]), "steps": int(work.shape[0]),
            "rank_busy_s": work.mean(axis=0).tolist(), "step_s": float(step.mean()),
            "wait_s": waited.mean(axis=0).tolist(), "efficiency": float(work.mean() / step.mean()) if step.mean() else 1.0}


__all__ = ["simulate_steps", "synchronous_reads"]
