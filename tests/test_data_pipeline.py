"""Prefetch, sampling order, caches and stragglers: the pipeline tools of Lab 05, tested on their own."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from scalelab.data.batches import resumable_batches
from scalelab.data.formats import open_dataset, write_dataset
from scalelab.data.order import OrderAwarePrefetcher, reuse_distances, sampler_order, simulate_cache
from scalelab.data.prefetch import Prefetcher, batch_reader, batches_of
from scalelab.data.store import ThrottledStore
from scalelab.experiments.straggler import simulate_steps, synchronous_reads
from scalelab.data.synthetic import heat_fields


def _slow_read(seconds):
    def read(i):
        time.sleep(seconds)
        return i
    return read


def test_prefetch_keeps_order_and_overlaps_reads_with_consumption():
    def run(workers, depth):
        pipe = Prefetcher(_slow_read(0.01), 20, decode=lambda i: i * 10, workers=workers, depth=depth)
        t0 = time.perf_counter()
        got = []
        for item in pipe:
            time.sleep(0.01)  # the "training step"
            got.append(item)
        return got, time.perf_counter() - t0, pipe.trace
    plain, t_plain, trace_plain = run(1, 0)
    ahead, t_ahead, trace = run(4, 4)
    assert plain == ahead == [i * 10 for i in range(20)]
    assert t_ahead < 0.75 * t_plain  # reads hidden behind the steps
    s = trace.summary()
    assert s["items"] == 20 and s["max_occupancy"] <= 4 and s["mean_occupancy"] > 0.5
    assert s["stall_s"] < trace_plain.summary()["stall_s"]
    assert {"read", "decode", "consume"} <= {sp.kind for sp in trace.spans}
    assert {sp.who for sp in trace.spans if sp.kind == "read"} <= {f"worker-{k}" for k in range(4)}


def test_a_failed_read_is_raised_to_the_consumer():
    def read(i):
        if i == 3:
            raise OSError("disk on fire")
        return i
    with pytest.raises(OSError, match="disk on fire"):
        list(Prefetcher(read, 10, workers=2, depth=2))


def test_trace_is_json_ready():
    pipe = Prefetcher(_slow_read(0.001), 5, workers=1, depth=2)
    list(pipe)
    d = pipe.trace.to_dict()
    assert len(d["spans"]) >= 15 and all(len(row) == 5 for row in d["spans"]) and d["summary"]["items"] == 5


def test_sampler_order_is_what_the_distributed_sampler_draws():
    ds = TensorDataset(torch.arange(50))
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=True)
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected += list(sampler)
    assert sampler_order(50, rank=1, world=2, seed=7, epochs=3).tolist() == expected


def _naive_distances(order):
    out = []
    for t, item in enumerate(order):
        before = [p for p in range(t) if order[p] == item]
        out.append(len(set(order[before[-1] + 1:t])) if before else -1)
    return out


def test_reuse_distance_is_the_lru_stack_distance():
    order = sampler_order(40, seed=2, epochs=3).tolist()
    assert reuse_distances(order).tolist() == _naive_distances(order)
    d = reuse_distances(order)
    for capacity in (5, 20, 40):
        hits = simulate_cache(order, capacity, "lru")["hits"]
        assert hits == int(((d >= 0) & (d < capacity)).sum())


def test_knowing_the_future_beats_lru_under_shuffling():
    order = sampler_order(1000, seed=0, epochs=3)
    lru = simulate_cache(order, 250, "lru")["hit_rate"]
    future = simulate_cache(order, 250, "future")["hit_rate"]
    assert future > 5 * lru
    assert future == pytest.approx(2 * 250 / 3000, rel=0.05)  # keep 250 samples for both later epochs
    assert simulate_cache(order, 1000, "lru")["hit_rate"] == pytest.approx(2 / 3)  # everything fits


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    x, y = heat_fields(120, 8, 3, seed=0)
    return write_dataset(x, y, tmp_path_factory.mktemp("pipe") / "files", "files")


def test_order_aware_prefetcher_delivers_the_order_and_reads_less(files_dir):
    store = ThrottledStore(files_dir, open_latency_s=0.001)
    ds = open_dataset(files_dir, store)
    order = sampler_order(len(ds), seed=1, epochs=2)
    pf = OrderAwarePrefetcher(ds, order, capacity=60, lookahead=16, workers=2)
    labels = [int(label) for _, label in pf]
    assert labels == [int(ds.labels[i]) for i in order]
    best_possible = len(order) - simulate_cache(order, 60, "future")["hits"]
    assert pf.stats["fetches"] <= best_possible + 16  # ~Belady: a few extra reads from read-ahead
    assert pf.stats["fetches"] < len(order)


def test_batch_reader_stacks_samples_in_batch_order(files_dir):
    ds = open_dataset(files_dir)
    batches = batches_of(sampler_order(len(ds), seed=0), 8)
    read, decode = batch_reader(ds, batches)
    first = decode(read(0))
    assert first.shape == (8, 1, 8, 8)
    assert torch.equal(first[3], ds[batches[0][3]][0])


def test_one_slow_reader_sets_the_pace_of_a_synchronous_step(files_dir):
    even = synchronous_reads(files_dir, ranks=3, steps=3, batch=4, open_latency_s=0.002)
    slow = synchronous_reads(files_dir, ranks=3, steps=3, batch=4, open_latency_s=0.002, straggler=2, slowdown=5)
    assert slow["step_s"] > 2.5 * even["step_s"]
    assert slow["efficiency"] < 0.7 < even["efficiency"]
    assert slow["wait_s"][0] > slow["wait_s"][2]  # the fast ranks are the ones that wait


def test_simulated_straggler_efficiency_is_mean_over_max():
    s = simulate_steps(ranks=4, steps=5, work_s=1.0, straggler=0, slowdown=2.0)
    assert s["step_s"] == pytest.approx(2.0) and s["efficiency"] == pytest.approx(5 / 8)


def test_resumed_batches_equal_the_tail_of_an_uninterrupted_stream():
    ds = TensorDataset(torch.arange(40).float()[:, None], torch.arange(40))
    loader = DataLoader(ds, batch_size=4, drop_last=True,
                        sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5, drop_last=True))
    full = resumable_batches(loader, 0, "cpu")
    expected = [next(full)[1].tolist() for _ in range(25)]
    resumed = resumable_batches(loader, 13, "cpu")  # mid-epoch 2 (10 batches per epoch)
    assert [next(resumed)[1].tolist() for _ in range(12)] == expected[13:]


def test_pipeline_view_draws_every_lane_and_saves_a_png(tmp_path):
    from scalelab.widgets import PipelineView
    from widgets.pipeline_view import lanes
    pipe = Prefetcher(_slow_read(0.002), 8, workers=2, depth=2)
    for _ in pipe:
        time.sleep(0.002)
    trace = pipe.trace.to_dict()
    assert lanes(trace) == ["consumer", "worker-0", "worker-1"]
    view = PipelineView(trace)
    assert view.image.value.startswith("<img src='data:image/png;base64,") and "stall_s" in view.table.value
    assert view.save(tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
