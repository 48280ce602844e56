"""Pipeline parallelism by hand: a model cut into stages, one per rank, fed micro-batches by a schedule.

Stage s runs layers [cut_s, cut_s+1) of the model. A step splits the batch into m micro-batches; each
micro-batch's activations go forward stage to stage (send/recv) and its gradients come back the same way. The
schedule orders each stage's work:

    gpipe   every forward, then every backward:     F0 F1 .. Fm-1 B0 B1 .. Bm-1
            a stage keeps the activations of all m micro-batches until their backward.
    1f1b    p-s-1 forwards to fill the pipe, then one forward, one backward, alternating; then the rest of the
            backwards. Same bubble as GPipe, but at most p-s micro-batches in flight: activation memory
            bounded by the depth of the pipe, not by m.

With uniform stages, each stage idles for p-1 of the m+p-1 slots of a step: the bubble fraction
(p-1)/(m+p-1), which shrinks as m grows. The loss is the mean of the micro-batch losses, so gradients, and the
training trajectory, equal the unsplit batch's.

Sends are non-blocking (`isend`, waited for at the end of the step) and receives block; every pair of stages
receives in the order it sends, so no schedule here can deadlock.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("gpipe", "1f1b")


def schedule_ops(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The ("F"|"B", micro-batch) operations stage `stage` of `stages` runs in one step, in order."""
    if schedule == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, micro)
        ops = [("F", i) for i in range(warm)]
        for i in range(micro - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", i) for i in range(micro - warm, micro)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def balanced_cuts(sizes: list[int], stages: int) -> list[int]:
    """Where to cut units of these parameter counts into `stages` consecutive pieces as equal as the units allow
    (each cut at the boundary nearest its share of the total): [0, cut_1, ..., len(sizes)]."""
    if stages > len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} layers into {stages} pipeline stages: use fewer stages or a "
                         "deeper model")
    prefix = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    cuts = [0]
    for k in range(1, stages):
        target = prefix[-1] * k / stages
        # a cut leaves at least one unit for every stage before and after it
        options = range(cuts[-1] + 1, len(sizes) - (stages - k) + 1)
        cuts.append(min(options, key=lambda i: (abs(prefix[i] - target), -i)))  # ties: later
    return cuts + [len(sizes)]


def split_layers(layers: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into `stages` consecutive pieces of about equal parameter count (balanced_cuts)."""
    cuts = balanced_cuts([sum(p.numel() for p in layer.parameters()) for layer in layers], stages)
    return [layers[a:b] for a, b in zip(cuts, cuts[1:])]


class PipelineStage:
    """One rank's stage: runs a schedule's operations on micro-batches, timing its compute."""

    def __init__(self, module: nn.Module, stage: int, stages: int, group=None, uniform: bool = True):
        self.module, self.stage, self.stages, self.group = module, stage, stages, group
        self.uniform = uniform
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(stages))
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < stages - 1 else None

    @property
    def is_last(self) -> bool:
        """True on the stage that computes the loss."""
        return self.next is None

    def step(self, schedule: str, micro_x: list, micro_y: list, boundary_shape, loss_fn) -> dict:
        """One training step's forwards and backwards (no optimizer step): loss (last stage, else nan), the
        compute timeline [(op, micro, t0, t1)] relative to the step's start, busy and wall seconds, and the most
        micro-batches whose activations were held at once."""
        m = len(micro_x)
        saved, sends, timeline = {}, [], []
        loss_total, in_flight, peak = 0.0, 0, 0
        start = time.perf_counter()
        for op, i in schedule_ops(schedule, self.stage, self.stages, m):
            if op == "F":
                if self.prev is None:
                    # the first stage's input needs no gradient; computing it anyway gives every stage the
                    # same backward work, the uniform stages the bubble formula assumes
                    x = micro_x[i].detach().requires_grad_(self.uniform)
                else:
                    x = torch.empty(boundary_shape(i), device=micro_x[i].device)
                    dist.recv(x, src=self.prev, group=self.group)
                    x.requires_grad_(True)
                t0 = time.perf_counter()
                y = self.module(x)
                if self.is_last:
                    y = loss_fn(y, micro_y[i]) / m
                    loss_total += float(y.detach())
                timeline.append(("F", i, t0 - start, time.perf_counter() - start))
                if not self.is_last:
                    out = y.detach().contiguous()
                    sends.append((dist.isend(out, dst=self.next, group=self.group), out))
                saved[i] = (x, y)
                in_flight += 1
                peak = max(peak, in_flight)
            else:
                x, y = saved.pop(i)
                grad = None
                if not self.is_last:
                    grad = torch.empty_like(y)
                    dist.recv(grad, src=self.next, group=self.group)
                t0 = time.perf_counter()
                y.backward(grad)
                timeline.append(("B", i, t0 - start, time.perf_counter() - start))
                if self.prev is not None:
                    g = x.grad.contiguous()
                    sends.append((dist.isend(g, dst=self.prev, group=self.group), g))
                in_flight -= 1
        wall = time.perf_counter() - start  # the last compute is done: what follows is the pipe draining
        for work, _ in sends:
            work.wait()
        busy = sum(t1 - t0 for _, _, t0, t1 in timeline)
        return {"loss": loss_total if self.is_last else float("nan"), "timeline": timeline, "busy_s": busy,
                "wall_s": wall, "peak_in_flight": peak}


def bubble_formula(stages: int, micro: int) -> float:
    """The idle fraction of each stage in a step with uniform stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro + stages - 1)


def replay_bubble(timelines: list[list], typical: bool = True) -> dict:
    """Replay a step's schedule with the stages' measured compute times, every stage on a core of its own:
    forward i on stage s waits for forward i on s-1, backward i for backward i on s+1. Returns the step's span,
    each stage's busy time, the bubble fraction 1 - mean busy / span, and when each operation starts.

    typical: each operation takes its stage's fastest forward (or backward) time, what it costs with a core to
    itself: load from other processes only ever adds to an operation, and counted as schedule it made two equal
    stages look 3x apart (a bubble of 0.38 for a formula of 0.11, CI under load); false: each operation's own time.
    On a machine with a free core per stage the wall clock shows the same bubble; on a loaded laptop the stages'
    processes take turns on the cores and the wall clock shows that sharing, not the schedule's idle slots."""
    stages = len(timelines)
    if typical:
        timelines = [typical_timeline(t) for t in timelines]
    starts: list[list[float]] = [[] for _ in range(stages)]
    end: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * stages, [0.0] * stages
    position = [0] * stages
    remaining = sum(len(t) for t in timelines)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(timelines[s]):
                continue
            op, i, t0, t1 = timelines[s][position[s]]
            dep = ("F", s - 1, i) if op == "F" and s > 0 else ("B", s + 1, i) if op == "B" and s < stages - 1 else None
            if dep is not None and dep not in end:
                continue  # its input has not been produced yet in the replay: another stage goes first
            start = max(clock[s], end.get(dep, 0.0))
            starts[s].append(start)
            clock[s] = end[(op, s, i)] = start + (t1 - t0)
            busy[s] += t1 - t0
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise ValueError("the stages' timelines wait on each other in a circle: not one step of one schedule")
    span = max(clock)
    return {"span_s": span, "busy_s": busy, "bubble": 1 - sum(busy) / stages / span if span > 0 else 0.0,
            "starts": starts, "timelines": timelines}


def typical_timeline(timeline: list) -> list:
    """The timeline with every forward (backward) lasting the fastest forward (backward) of this stage."""
    fastest = {}
    for kind in ("F", "B"):
        fastest[kind] = min((t1 - t0 for op, _, t0, t1 in timeline if op == kind), default=0.0)
    return [(op, i, 0.0, fastest[op]) for op, i, _, _ in timeline]
