"""Asynchronous prefetch: producer threads load items ahead into a bounded queue; the consumer (the
training step) takes them in order. A `PipelineTrace` records what each worker did when (read, decode),
what the consumer did (consume, or wait: a stall), and how many ready items sat in the queue over time.

    pipe = Prefetcher(batch_loader(ds, batches), len(batches), workers=2, depth=4)
    for x, y in pipe:
        train_step(x, y)                 # time between items counts as "consume"
    pipe.trace.summary()                 # stall_s, mean occupancy, read/decode time per worker, ...

Why threads and not processes: the expensive part of a slow store is waiting (latency, bandwidth), and
waiting releases the GIL; threads also let the trace share one clock. Decoding heavy formats in Python is
where processes (DataLoader workers) win instead; the lab measures both.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch


@dataclass
class Span:
    """One interval of work: `who` (a worker name or 'consumer') did `kind` to item `item`."""

    who: str
    kind: str
    """read, decode, consume or wait (the consumer found nothing ready: a stall)."""
    start: float
    end: float
    item: int = -1


@dataclass
class PipelineTrace:
    """Spans and queue occupancy of one pipeline run, on one clock (seconds since `t0`)."""

    t0: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    occupancy: list[tuple[float, int]] = field(default_factory=list)
    """(time, ready items in the queue) at every put and take."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def now(self) -> float:
        """Seconds since the trace started."""
        return time.perf_counter() - self.t0

    def add(self, who: str, kind: str, start: float, end: float, item: int = -1) -> None:
        """Record one span (thread-safe)."""
        with self._lock:
            self.spans.append(Span(who, kind, start, end, item))

    @contextmanager
    def span(self, who: str, kind: str, item: int = -1):
        """Time the block as a span."""
        start = self.now()
        try:
            yield
        finally:
            self.add(who, kind, start, self.now(), item)

    def level(self, ready: int) -> None:
        """Record the queue's ready count now."""
        with self._lock:
            self.occupancy.append((self.now(), ready))

    def total(self, kind: str, who: str | None = None) -> float:
        """Seconds spent in `kind` (by `who`, or by everyone)."""
        return sum(s.end - s.start for s in self.spans if s.kind == kind and (who is None or s.who == who))

    def mean_occupancy(self) -> float:
        """Time-weighted mean of ready items in the queue."""
        occ = sorted(self.occupancy)
        if len(occ) < 2:
            return float(occ[0][1]) if occ else 0.0
        times = np.array([t for t, _ in occ])
        levels = np.array([n for _, n in occ], dtype=float)
        span = times[-1] - times[0]
        return float((levels[:-1] * np.diff(times)).sum() / span) if span > 0 else float(levels.mean())

    def summary(self) -> dict:
        """The numbers a lab records: elapsed, stall and its fraction, busy time per kind, mean occupancy."""
        ends = [s.end for s in self.spans]
        elapsed = max(ends) if ends else 0.0
        workers = sorted({s.who for s in self.spans if s.who != "consumer"})
        return {"items": sum(1 for s in self.spans if s.kind == "consume"), "elapsed_s": elapsed,
                "stall_s": self.total("wait", "consumer"),
                "stall_fraction": self.total("wait", "consumer") / elapsed if elapsed else 0.0,
                "consume_s": self.total("consume", "consumer"), "read_s": self.total("read"),
                "decode_s": self.total("decode"), "mean_occupancy": self.mean_occupancy(),
                "max_occupancy": max((n for _, n in self.occupancy), default=0), "workers": workers}

    def to_dict(self) -> dict:
        """JSON-ready: spans as [who, kind, start, end, item] rows, occupancy as [t, n] rows, and the summary."""
        return {"spans": [[s.who, s.kind, s.start, s.end, s.item] for s in self.spans],
                "occupancy": [list(o) for o in self.occupancy], "summary": self.summary()}


class Prefetcher:
    """Load items 0..n-1 with `workers` producer threads, at most `depth` loaded ahead of the consumer.

    `read(i)` does the I/O of item i and `decode(raw)` the CPU work (split so the trace can tell them apart).
    depth=0 means no prefetch: the consumer loads each item itself when it needs it.
    """

    def __init__(self, read: Callable[[int], Any], n: int, decode: Callable[[Any], Any] = lambda raw: raw,
                 workers: int = 1, depth: int = 2, trace: PipelineTrace | None = None):
        if workers < 1 or depth < 0:
            raise ValueError(f"workers must be >= 1 and depth >= 0, got workers={workers}, depth={depth}")
        self.read, self.decode, self.n = read, decode, n
        self.workers, self.depth = workers, depth
        self.trace = trace or PipelineTrace()

    def _load(self, who: str, i: int):
        with self.trace.span(who, "read", i):
            raw = self.read(i)
        with self.trace.span(who, "decode", i):
            return self.decode(raw)

    def __iter__(self) -> Iterator[Any]:
        return self._synchronous() if self.depth == 0 else self._prefetched()

    def _synchronous(self):
        for i in range(self.n):
            start = self.trace.now()
            item = self._load("consumer", i)
            self.trace.add("consumer", "wait", start, self.trace.now(), i)  # no prefetch: loading is stalling
            yield from self._hand_over(item, i)

    def _hand_over(self, item, i):
        start = self.trace.now()
        yield item
        self.trace.add("consumer", "consume", start, self.trace.now(), i)

    def _prefetched(self):
        ready: dict[int, Any] = {}
        cond = threading.Condition()
        slots = threading.Semaphore(self.depth)
        state = {"next": 0, "stop": False}

        def work(name):
            while True:
                slots.acquire()
                with cond:
                    if state["stop"] or state["next"] >= self.n:
                        slots.release()
                        return
                    i = state["next"]
                    state["next"] += 1
                try:
                    item = self._load(name, i)
                except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                    item = _Failed(e)
                with cond:
                    ready[i] = item
                    self.trace.level(len(ready))
                    cond.notify_all()

        threads = [threading.Thread(target=work, args=(f"worker-{k}",), daemon=True) for k in range(self.workers)]
        for t in threads:
            t.start()
        try:
            for i in range(self.n):
                start = self.trace.now()
                with cond:
                    while i not in ready:
                        cond.wait()
                    item = ready.pop(i)
                    self.trace.level(len(ready))
                if self.trace.now() - start > 1e-4:
                    self.trace.add("consumer", "wait", start, self.trace.now(), i)
                slots.release()
                if isinstance(item, _Failed):
                    raise item.error
                yield from self._hand_over(item, i)
        finally:
            with cond:
                state["stop"] = True
            for _ in threads:
                slots.release()
            for t in threads:
                t.join(timeout=10)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def batch_reader(dataset, batches: list[list[int]]):
    """(read, decode) for Prefetcher over a StoredDataset: batch k is `batches[k]`; decode stacks tensors."""
    def read(k):
        return [dataset.read(int(i)) for i in batches[k]]

    def decode(raws):
        k_items = [dataset.decode(r) for r in raws]
        return torch.from_numpy(np.stack(k_items))
    return read, decode


def batches_of(order, batch: int) -> list[list[int]]:
    """Consecutive whole batches of an index order (the remainder is dropped, like drop_last=True)."""
    order = list(map(int, order))
    return [order[k:k + batch] for k in range(0, len(order) - batch + 1, batch)]


__all__ = ["Span", "PipelineTrace", "Prefetcher", "batch_reader", "batches_of"]
