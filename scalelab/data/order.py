"""The sampling order is known in advance: use it (the idea behind Argonne's Lobster).

A seeded shuffling sampler (torch's DistributedSampler, as every scalelab run uses) is a pure function of
(seed, epoch, rank, world size): each rank can list the samples it will ask for, epochs ahead. This module
computes that order, the *reuse distance* of each access (how many distinct other samples are touched before
the same sample comes back), what a cache of a given size hits under LRU versus an order-aware policy that
evicts the sample needed farthest in the future (Belady's MIN), and a prefetcher that reads ahead along the
known order into such a cache.

    order = sampler_order(n=4096, rank=0, world=2, seed=0, epochs=2)
    d = reuse_distances(order)           # -1 for a first access
    simulate_cache(order, capacity=1024, policy="lru")["hit_rate"]      # ~ small
    simulate_cache(order, capacity=1024, policy="future")["hit_rate"]   # ~ capacity / samples per rank
"""
from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from .prefetch import PipelineTrace

NEVER = np.iinfo(np.int64).max


def sampler_order(n: int, rank: int = 0, world: int = 1, seed: int = 0, epochs: int = 1,
                  start_epoch: int = 0) -> np.ndarray:
    """The indices rank `rank` of `world` draws from a DistributedSampler(shuffle, drop_last), epoch after epoch."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    out = []
    for epoch in range(start_epoch, start_epoch + epochs):
        sampler.set_epoch(epoch)
        out.extend(sampler)
    return np.asarray(out, dtype=np.int64)


def reuse_distances(order) -> np.ndarray:
    """LRU stack distance of each access: distinct other items touched since its last access; -1 the first time.

    An LRU cache of capacity C hits exactly the accesses with 0 <= distance < C. O(n log n) with a Fenwick tree
    over positions that marks, for each item, only its most recent access.
    """
    order = np.asarray(order, dtype=np.int64)
    n = len(order)
    tree = np.zeros(n + 1, dtype=np.int64)

    def add(pos, value):
        pos += 1
        while pos <= n:
            tree[pos] += value
            pos += pos & -pos

    def prefix(pos):  # marks in positions [0, pos)
        total = 0
        while pos > 0:
            total += tree[pos]
            pos -= pos & -pos
        return total

    last: dict[int, int] = {}
    out = np.full(n, -1, dtype=np.int64)
    for t, item in enumerate(order.tolist()):
        p = last.get(item)
        if p is not None:
            out[t] = prefix(t) - prefix(p + 1)
            add(p, -1)
        add(t, 1)
        last[item] = t
    return out


def next_use(order) -> np.ndarray:
    """For each position, the next position at which the same item is accessed again (NEVER if not)."""
    order = np.asarray(order, dtype=np.int64)
    out = np.full(len(order), NEVER, dtype=np.int64)
    seen: dict[int, int] = {}
    for t in range(len(order) - 1, -1, -1):
        item = int(order[t])
        out[t] = seen.get(item, NEVER)
        seen[item] = t
    return out


def simulate_cache(order, capacity: int, policy: str = "lru") -> dict:
    """Hits of a cache of `capacity` items on `order`: lru, fifo, or future (evict the item needed farthest
    ahead, and do not even admit an item needed later than everything cached: Belady's MIN)."""
    order = np.asarray(order, dtype=np.int64)
    if policy == "future":
        hits = _simulate_future(order, capacity)
    elif policy in ("lru", "fifo"):
        hits = _simulate_recency(order, capacity, policy == "lru")
    else:
        raise ValueError(f"unknown cache policy {policy!r}; choose lru, fifo or future")
    n = len(order)
    return {"policy": policy, "capacity": capacity, "accesses": n, "hits": hits, "hit_rate": hits / n if n else 0.0}


def _simulate_recency(order, capacity, refresh_on_hit):
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for item in order.tolist():
        if item in cache:
            hits += 1
            if refresh_on_hit:
                cache.move_to_end(item)
        elif capacity > 0:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[item] = None
    return hits


def _simulate_future(order, capacity):
    nxt = next_use(order)
    cached: dict[int, int] = {}  # item -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, item), stale entries skipped
    hits = 0
    for t, item in enumerate(order.tolist()):
        if item in cached:
            hits += 1
        cached_next = int(nxt[t])
        if item in cached or len(cached) < capacity:
            if capacity > 0:
                cached[item] = cached_next
                heapq.heappush(heap, (-cached_next, item))
            continue
        while heap and cached.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        if heap and -heap[0][0] > cached_next:  # the farthest cached item is needed later than this one
            _, victim = heapq.heappop(heap)
            del cached[victim]
            cached[item] = cached_next
            heapq.heappush(heap, (-cached_next, item))
    return hits


class OrderAwarePrefetcher:
    """Read samples ahead along the known `order` into a cache of `capacity` samples that keeps the ones
    needed soonest (Belady's MIN), and hand them to the consumer in order.

    `lookahead` bounds how far ahead of the consumer the reader runs; with capacity >= the samples of one
    epoch every sample is read once for all epochs. `stats` counts hits (sample was ready), misses (the
    consumer had to wait for it) and fetches (reads from the store).
    """

    def __init__(self, dataset, order, capacity: int, lookahead: int = 64, workers: int = 1,
                 trace: PipelineTrace | None = None):
        if capacity < 1 or lookahead < 1 or workers < 1:
            raise ValueError("capacity, lookahead and workers must be >= 1")
        self.dataset, self.order = dataset, np.asarray(order, dtype=np.int64)
        self.capacity, self.lookahead, self.workers = capacity, lookahead, workers
        self.trace = trace or PipelineTrace()
        self.stats = {"hits": 0, "misses": 0, "fetches": 0, "evictions": 0}
        self._nxt = next_use(self.order)

    def _fetch(self, who: str, index: int) -> Any:
        with self.trace.span(who, "read", index):
            raw = self.dataset.read(index)
        with self.trace.span(who, "decode", index):
            return self.dataset.decode(raw)

    def __iter__(self):
        one = _Pass(self)
        threads = [threading.Thread(target=one.work, args=(f"reader-{k}",), daemon=True) for k in range(self.workers)]
        for th in threads:
            th.start()
        try:
            for t, item in enumerate(self.order.tolist()):
                start = self.trace.now()
                value, hit = one.take(t, item, int(self._nxt[t]))
                if not hit:
                    self.trace.add("consumer", "wait", start, self.trace.now(), item)
                start = self.trace.now()
                yield value, self.dataset.labels[item]
                self.trace.add("consumer", "consume", start, self.trace.now(), item)
        finally:
            one.close()
            for th in threads:
                th.join(timeout=10)


class _Pass:
    """One pass of an OrderAwarePrefetcher over its order: the cache, what the readers have in flight and the
    consumer's position, all under one condition."""

    def __init__(self, owner: OrderAwarePrefetcher):
        self.owner, self.order = owner, owner.order
        self.cache: dict[int, Any] = {}
        self.need_at: dict[int, int] = {}  # cached or in-flight item -> position of its next use
        self.inflight: set[int] = set()
        self.cond = threading.Condition()
        self.pos = self.scan = 0
        self.stop = False

    def claim(self) -> int | None:
        """Under cond: the next item to fetch, or None to wait."""
        self.scan = max(self.scan, self.pos)  # positions already consumed need nothing
        while self.scan < min(len(self.order), self.pos + self.owner.lookahead):
            t = self.scan
            self.scan += 1
            item = int(self.order[t])
            if item in self.cache or item in self.inflight:
                self.need_at[item] = min(self.need_at.get(item, NEVER), t)
                continue
            if len(self.cache) + len(self.inflight) >= self.owner.capacity and not self._evict_for(t):
                self.scan -= 1  # full of items needed sooner: wait for the consumer to move on
                return None
            self.inflight.add(item)
            self.need_at[item] = t
            return item
        return None

    def _evict_for(self, t: int) -> bool:
        victims = [i for i in self.cache if self.need_at.get(i, NEVER) > t]
        if not victims:
            return False
        victim = max(victims, key=lambda i: self.need_at.get(i, NEVER))
        del self.cache[victim]
        self.need_at.pop(victim, None)
        self.owner.stats["evictions"] += 1
        return True

    def work(self, name: str) -> None:
        """A reader thread: claim, fetch, put in the cache, until the pass stops."""
        cond = self.cond
        while True:
            with cond:
                item = self.claim()
                while item is None and not self.stop:
                    cond.wait(0.05)
                    item = self.claim()
                if self.stop:
                    return
            value = self.owner._fetch(name, item)
            with cond:
                self.inflight.discard(item)
                self.cache[item] = value
                self.owner.stats["fetches"] += 1
                self.owner.trace.level(len(self.cache))
                cond.notify_all()

    def take(self, t: int, item: int, following: int) -> tuple[Any, bool]:
        """The consumer at position `t`: `item` once it is cached (kept for its next use `following`, else
        dropped). (its value, whether it was there already)"""
        with self.cond:
            hit = item in self.cache
            while item not in self.cache:
                self.cond.wait()
            value = self.cache[item]
            if following == NEVER:
                del self.cache[item]
                self.need_at.pop(item, None)
            else:
                self.need_at[item] = following
            self.pos = t + 1
            self.owner.stats["hits" if hit else "misses"] += 1
            self.owner.trace.level(len(self.cache))
            self.cond.notify_all()
        return value, hit

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


__all__ = ["sampler_order", "reuse_distances", "next_use", "simulate_cache", "OrderAwarePrefetcher"]
