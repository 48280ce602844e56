"""Pipeline parallelism by hand: a model cut into stages, one per rank, fed micro-batches by a schedule.

Stage s runs layers [cut_s, cut_s+1) of the model. A step splits the batch into m micro-batches; each
micro-batch's activations go forward stage to stage (send/recv) and its gradients come back the same way. The
schedule (`pipeline.schedule`) orders each stage's work:

    gpipe   every forward, then every backward:     F0 F1 .. Fm-1 B0 B1 .. Bm-1
            a stage keeps the activations of all m micro-batches until their backward.
    1f1b    p-s-1 forwards to fill the pipe, then one forward, one backward, alternating; then the rest of the
            backwards. Same bubble as GPipe, but at most p-s micro-batches in flight: activation memory
            bounded by the depth of the pipe, not by m.
    module:function
            a schedule of the student's own: function(stage, stages, micro) -> [("F" | "B", micro-batch), ...],
            imported from the run's code/ folder (run/user_code.py). Before the first step every rank computes
            it for every stage and checks it (`check_plan`): every F and B of every micro-batch exactly once, B_i
            after F_i on its stage, neighbouring stages sending and receiving in one order, and no circle of
            stages waiting on each other (a deadlock); a schedule that fails is refused with an error naming
            pipeline.schedule, before any stage waits on another.
    torch-gpipe, torch-1f1b
            torch.distributed.pipelining's own ScheduleGPipe / Schedule1F1B on the same stage (its
            PipelineStage wraps this rank's module), for comparison with the hand-written ones: same gradients.
    torch-interleaved
            torch's ScheduleInterleaved1F1B (Megatron's interleaved schedule): the model is cut into p x 2
            chunks (virtual stages) and rank r holds chunks r and r + p, so each micro-batch goes round the
            ranks twice and the bubble shrinks by the number of chunks per rank. The micro-batches must be a
            multiple of max(1, m // p) (torch's rounds), and the model must have units for 2p stages.

With uniform stages, each stage idles for p-1 of the m+p-1 slots of a step: the bubble fraction
(p-1)/(m+p-1), which shrinks as m grows. The loss is the mean of the micro-batch losses, so gradients, and the
training trajectory, equal the unsplit batch's.

Activation memory is measured in bytes (`LiveSavedBytes`): saved-tensor hooks see every tensor autograd keeps
for backward as a forward saves it and learn when autograd lets it go (after that micro-batch's backward); the
peak of the bytes alive at once over a step is the stage's activation memory. Parameters (and views of them) are
state, not activations, and are left out.

Sends are non-blocking (`isend`, waited for at the end of the step) and receives block; every pair of stages
receives in the order it sends, which `check_plan` asks of every schedule.

In an engine run (strategies pp and 3d with parallel.pp > 1) `record_pipeline` has each rank write a `pipeline`
event per step into its event file: the schedule, the operations it ran in order, the peak activation bytes, the
micro-batches in flight, and the step's bubble replayed from every stage's compute timeline (`replay_bubble`), with
each stage's idle fraction.
"""
from __future__ import annotations

import copy
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..errors import SpecError
from ..run.combinations import PIPELINE_CHUNKS

SCHEDULES = ("gpipe", "1f1b")
TORCH_SCHEDULES = {"torch-gpipe": "ScheduleGPipe", "torch-1f1b": "Schedule1F1B",
                   "torch-interleaved": "ScheduleInterleaved1F1B"}
"""pipeline.schedule values run by torch.distributed.pipelining, and its class for each."""
CHUNKS_PER_RANK = PIPELINE_CHUNKS
"""The model chunks (virtual stages) each rank holds under a schedule; 1 unless named here (run/combinations.py
holds it: the spec's checks need it too)."""
FIELD = "pipeline.schedule"


def chunks_per_rank(schedule: str) -> int:
    """How many model chunks (virtual stages) each rank holds under `schedule`."""
    return CHUNKS_PER_RANK.get(schedule, 1)


def interleaved_rounds_fit(micro: int, stages: int) -> bool:
    """Whether torch's interleaved 1F1B takes `micro` micro-batches on `stages` ranks: it runs them in
    max(1, micro // stages) rounds of equal size."""
    return micro % max(1, micro // stages) == 0


def builtin_ops(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The engine's own schedules: gpipe and 1f1b."""
    if schedule == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, micro)
        ops = [("F", i) for i in range(warm)]
        for i in range(micro - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", i) for i in range(micro - warm, micro)]
    raise SpecError(FIELD, f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}, "
                           f"{', '.join(TORCH_SCHEDULES)} or module:function")


def schedule_ops(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The ("F"|"B", micro-batch) operations stage `stage` of `stages` runs in one step, in order: a built-in
    schedule's, or what the function `schedule` ("module:function") returns (not checked: see `plan_schedule`)."""
    if schedule in SCHEDULES or ":" not in schedule:
        return builtin_ops(schedule, stage, stages, micro)
    from ..run.user_code import resolve_code
    fn = resolve_code(schedule, FIELD)
    try:
        ops = fn(stage, stages, micro)
    except NotImplementedError:
        raise SpecError(FIELD, f"{schedule} is not implemented yet (it raised NotImplementedError)") from None
    except Exception as e:  # the student's code: say where it failed, in the field's name
        raise SpecError(FIELD, f"{schedule}({stage}, {stages}, {micro}) raised {type(e).__name__}: {e}") from e
    try:
        return [(str(op), int(i)) for op, i in ops]
    except (TypeError, ValueError):
        raise SpecError(FIELD, f"{schedule}({stage}, {stages}, {micro}) returned {str(ops)[:200]}: expected a list "
                               "of (\"F\" or \"B\", micro-batch number) pairs") from None


def plan_schedule(schedule: str, stages: int, micro: int) -> list[list[tuple[str, int]]]:
    """Every stage's operations under `schedule`, checked (`check_plan`): SpecError naming pipeline.schedule if
    the schedule is incomplete, out of order or would deadlock."""
    plan = [schedule_ops(schedule, s, stages, micro) for s in range(stages)]
    check_plan(plan, micro, schedule)
    return plan


def check_plan(plan: list[list[tuple[str, int]]], micro: int, name: str = "the schedule") -> None:
    """Raise SpecError(pipeline.schedule) unless the stages' operation lists make one step of a pipeline: every
    F and B of micro-batches 0..micro-1 exactly once per stage, B_i after F_i on its stage, stage s's forwards in
    the order stage s+1 runs them (activations arrive in the order they are sent), stage s+1's backwards in the
    order stage s runs them (gradients likewise), and no circle of stages each waiting for another (a stage
    blocks in its receive: forward i on stage s needs forward i of stage s-1, backward i needs backward i of
    stage s+1)."""
    stages = len(plan)
    want = {(op, i) for op in "FB" for i in range(micro)}
    for s, ops in enumerate(plan):
        seen: set = set()
        for k, item in enumerate(ops):
            op, i = item
            if op not in ("F", "B") or not 0 <= i < micro:
                raise SpecError(FIELD, f"{name}: stage {s}, operation {k} is {item!r}; every operation is (\"F\" or "
                                       f"\"B\", a micro-batch 0..{micro - 1})")
            if (op, i) in seen:
                raise SpecError(FIELD, f"{name}: stage {s} runs {op}{i} twice; each micro-batch goes forward once "
                                       "and backward once")
            if op == "B" and ("F", i) not in seen:
                raise SpecError(FIELD, f"{name}: stage {s} runs B{i} before F{i}; a backward needs its forward's "
                                       "activations")
            seen.add((op, i))
        if seen != want:
            missing = sorted(want - seen, key=lambda x: (x[1], x[0]))
            raise SpecError(FIELD, f"{name}: stage {s} never runs "
                                   f"{' '.join(f'{op}{i}' for op, i in missing[:8])}{' ...' if len(missing) > 8 else ''}"
                                   f" of {micro} micro-batches")
    for s in range(stages - 1):
        for op, sender, receiver in (("F", s, s + 1), ("B", s + 1, s)):
            sent = [i for o, i in plan[sender] if o == op]
            got = [i for o, i in plan[receiver] if o == op]
            if sent != got:
                raise SpecError(FIELD, f"{name}: stage {sender} runs its {op}s in the order {sent[:8]} but stage "
                                       f"{receiver} in the order {got[:8]}; what one stage sends the next receives "
                                       "in the order it was sent")
    position, done = [0] * stages, set()
    while any(position[s] < len(plan[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(plan[s]):
                op, i = plan[s][position[s]]
                dep = (("F", s - 1, i) if op == "F" and s > 0 else
                       ("B", s + 1, i) if op == "B" and s < stages - 1 else None)
                if dep is not None and dep not in done:
                    break
                done.add((op, s, i))
                position[s] += 1
                moved = True
        if not moved:
            waits = [f"stage {s} at {plan[s][position[s]][0]}{plan[s][position[s]][1]}" for s in range(stages)
                     if position[s] < len(plan[s])]
            raise SpecError(FIELD, f"{name} would deadlock: {', '.join(waits)} each wait for another stage "
                                   "(F_i needs F_i of the stage before, B_i the B_i of the stage after)")


class _Held:
    """What a saved-tensor hook hands autograd instead of the tensor: when autograd drops it, the bytes go."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class LiveSavedBytes:
    """`with LiveSavedBytes(module) as live:` forwards and backwards; `live.peak` = the most bytes of tensors
    autograd saved for backward that were alive at once, `live.bytes` those alive now. A tensor saved twice (a
    relu's output is the next layer's input) counts once; parameters of `module` and views of them are state and
    count not at all. Alive: from the forward that saves it until autograd releases it (the backward that used
    it, retain_graph aside)."""

    def __init__(self, module: nn.Module | None = None):
        self.bytes = self.peak = 0
        self._refs: dict = {}
        self._state = {p.untyped_storage().data_ptr() for p in module.parameters()} if module is not None else set()

    def __enter__(self):
        from torch.autograd.graph import saved_tensors_hooks
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.bytes

    def _pack(self, t):
        if isinstance(t, nn.Parameter) or t.device.type == "meta" or \
                t.untyped_storage().data_ptr() in self._state:
            return t
        key = (t.data_ptr(), t.numel(), t.dtype)
        count, size = self._refs.get(key, (0, t.numel() * t.element_size()))
        if count == 0:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
        self._refs[key] = (count + 1, size)
        held = _Held(t)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def _release(self, key) -> None:
        count, size = self._refs[key]
        if count == 1:
            del self._refs[key]
            self.bytes -= size
        else:
            self._refs[key] = (count - 1, size)


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


def hold_chunks(model: nn.Module, ranges: list[tuple[int, int]]) -> list[nn.Module]:
    """The chunks of an interleaved rank: one copy of `model` per unit range [first, last) of `ranges`, each cut
    by the model's keep_units (a module of its own, for torch's PipelineStage); then `model` itself keeps exactly
    those chunks' parts, the same objects (shared, not copied) under the serial model's names, so the optimizer,
    the checkpoints and the gathered state see one module holding this rank's parameters."""
    parts = []
    for first, last in ranges:
        part = copy.deepcopy(model)
        part.keep_units(first, last)
        parts.append(part)
    _adopt(model, parts)
    return parts


def _adopt(target: nn.Module, parts: list[nn.Module]) -> None:
    """Make `target` hold what any of `parts` (cut copies of it) holds: a part's parameter, buffer or submodule
    where one part has it; a container several parts keep some of (a Sequential, a ModuleList, an encoder) the
    union of their children, in the serial model's order."""
    for table in ("_parameters", "_buffers"):
        own = getattr(target, table)
        for name in list(own):
            own[name] = next((getattr(p, table)[name] for p in parts if getattr(p, table).get(name) is not None),
                             None)
    keys = list(dict.fromkeys(k for p in parts for k in p._modules))
    if keys and all(k.isdigit() for k in keys):
        keys.sort(key=int)
    modules: dict = {}
    for key in keys:
        present = [p._modules[key] for p in parts if p._modules.get(key) is not None]
        if len(present) > 1 and target._modules.get(key) is not None:
            _adopt(target._modules[key], present)
            modules[key] = target._modules[key]
        else:
            modules[key] = present[0] if present else None
    target._modules.clear()
    target._modules.update(modules)


class PipelineStage:
    """One rank's stage: runs a schedule's operations on micro-batches, timing its compute and measuring the bytes
    of activations it holds."""

    def __init__(self, module: nn.Module, stage: int, stages: int, group=None, uniform: bool = True,
                 chunks: list | None = None):
        self.module, self.stage, self.stages, self.group = module, stage, stages, group
        self.uniform = uniform
        self.chunks = chunks  # interleaved: [(module, virtual stage)] this rank holds (`module` holds them all)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(stages))
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < stages - 1 else None
        self._plans: dict = {}  # (schedule, micro) -> this stage's checked operations
        self._torch: dict = {}  # (schedule, micro) -> (torch's schedule, its stage, this step's timeline)
        self.last: dict = {}  # what the last step returned

    @property
    def is_last(self) -> bool:
        """True on the stage that computes the loss."""
        return self.next is None

    def ops(self, schedule: str, micro: int) -> list[tuple[str, int]]:
        """This stage's operations under `schedule`, every stage's checked first (once per micro count)."""
        key = (schedule, micro)
        if key not in self._plans:
            self._plans[key] = plan_schedule(schedule, self.stages, micro)[self.stage]
        return self._plans[key]

    def step(self, schedule: str, micro_x: list, micro_y: list, boundary_shape, loss_fn) -> dict:
        """One training step's forwards and backwards (no optimizer step): loss (last stage, else nan), the
        compute timeline [(op, micro, t0, t1)] relative to the step's start, busy and wall seconds, the most
        micro-batches whose activations were held at once and the most bytes of them (`activation_peak_bytes`)."""
        self.last = self._step(schedule, micro_x, micro_y, boundary_shape, loss_fn)
        return self.last

    def _step(self, schedule: str, micro_x: list, micro_y: list, boundary_shape, loss_fn) -> dict:
        if schedule in TORCH_SCHEDULES:
            return self._torch_step(schedule, micro_x, micro_y, loss_fn)
        m = len(micro_x)
        plan = self.ops(schedule, m)
        saved, sends, timeline = {}, [], []
        loss_total, in_flight, peak = 0.0, 0, 0
        start = time.perf_counter()
        with LiveSavedBytes(self.module) as live:
            for op, i in plan:
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
                    del x, y
                    in_flight -= 1
            wall = time.perf_counter() - start  # the last compute is done: what follows is the pipe draining
        for work, _ in sends:
            work.wait()
        busy = sum(t1 - t0 for _, _, t0, t1 in timeline)
        return {"loss": loss_total if self.is_last else float("nan"), "timeline": timeline, "busy_s": busy,
                "wall_s": wall, "peak_in_flight": peak, "activation_peak_bytes": live.peak}

    def _torch_step(self, schedule: str, micro_x: list, micro_y: list, loss_fn) -> dict:
        """The step run by torch.distributed.pipelining's schedule on this stage: its PipelineStage wraps the
        same module; its forward_one_chunk / backward_one_chunk are timed for the timeline; torch averages the
        gradients over the micro-batches (scale_grads), as the hand-written schedules' loss / m does."""
        from torch.distributed import pipelining
        m = len(micro_x)
        key = (schedule, m)
        if key not in self._torch:
            device = next(self.module.parameters()).device
            if chunks_per_rank(schedule) != len(self.chunks or [None]):
                raise SpecError(FIELD, f"{schedule} runs {chunks_per_rank(schedule)} model chunk(s) per rank; this "
                                       f"stage was built with {len(self.chunks or [None])}")
            parts = self.chunks or [(self.module, self.stage)]
            total = self.stages * len(parts)  # virtual stage v lives on rank v mod stages
            stages = [pipelining.PipelineStage(module, v, total, device, group=self.group) for module, v in parts]
            cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
            run = cls(stages if self.chunks else stages[0], m, loss_fn=loss_fn, scale_grads=True)
            timeline: list = []
            self._torch[key] = (run, stages, timeline)
            for stage, (_, v) in zip(stages, parts):
                for op, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
                    setattr(stage, name, self._timed(getattr(stage, name), op, timeline,
                                                     v if self.chunks else None))
        run, _, timeline = self._torch[key]
        timeline.clear()
        losses: list = []
        self._t0 = time.perf_counter()
        with LiveSavedBytes(self.module) as live:
            if self.prev is None:
                run.step(torch.cat(micro_x))
            elif self.is_last:
                run.step(target=torch.cat(micro_y), losses=losses)
            else:
                run.step()
            wall = time.perf_counter() - self._t0
        in_flight = peak = 0
        for op, *_ in timeline:  # interleaved: a micro-batch in each chunk counts once per chunk
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        loss = sum(float(x) for x in losses) / m if self.is_last else float("nan")
        return {"loss": loss, "timeline": list(timeline), "busy_s": sum(e[3] - e[2] for e in timeline),
                "wall_s": wall, "peak_in_flight": peak, "activation_peak_bytes": live.peak}

    def _timed(self, method, op: str, timeline: list, virtual: int | None = None):
        """`method` timed into the timeline as (op, micro, t0, t1), with the virtual stage last when interleaved."""
        def timed(i, *args, **kwargs):
            t0 = time.perf_counter()
            out = method(i, *args, **kwargs)
            entry = (op, i, t0 - self._t0, time.perf_counter() - self._t0)
            timeline.append(entry if virtual is None else (*entry, virtual))
            return out
        return timed


def bubble_formula(stages: int, micro: int) -> float:
    """The idle fraction of each stage in a step with uniform stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro + stages - 1)


def replay_bubble(timelines: list[list], typical: bool = True) -> dict:
    """Replay a step's schedule with the stages' measured compute times, every stage on a core of its own:
    forward i on stage s waits for forward i on s-1, backward i for backward i on s+1. Returns the step's span,
    each stage's busy time, the bubble fraction 1 - mean busy / span, and when each operation starts. Interleaved
    timelines name each operation's virtual stage fifth, (op, micro, t0, t1, virtual): the dependencies are then
    between virtual stages (virtual stage v runs on rank v mod ranks), the busy time and the clock per rank.

    typical: each operation takes its stage's fastest forward (or backward) time, what it costs with a core to
    itself: load from other processes only ever adds to an operation, and counted as schedule it made two equal
    stages look 3x apart (a bubble of 0.38 for a formula of 0.11, CI under load); false: each operation's own time.
    On a machine with a free core per stage the wall clock shows the same bubble; on a loaded laptop the stages'
    processes take turns on the cores and the wall clock shows that sharing, not the schedule's idle slots."""
    stages = len(timelines)
    if typical:
        timelines = [typical_timeline(t) for t in timelines]

    def virtual(s: int, entry) -> int:
        return entry[4] if len(entry) > 4 else s
    last = max((virtual(s, e) for s, t in enumerate(timelines) for e in t), default=stages - 1)
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
            entry = timelines[s][position[s]]
            op, i, t0, t1 = entry[:4]
            v = virtual(s, entry)
            dep = ("F", v - 1, i) if op == "F" and v > 0 else ("B", v + 1, i) if op == "B" and v < last else None
            if dep is not None and dep not in end:
                continue  # its input has not been produced yet in the replay: another stage goes first
            start = max(clock[s], end.get(dep, 0.0))
            starts[s].append(start)
            clock[s] = end[(op, v, i)] = start + (t1 - t0)
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
    """The timeline with every forward (backward) lasting the fastest forward (backward) of this stage (an
    interleaved timeline's virtual stages kept)."""
    fastest = {}
    for kind in ("F", "B"):
        fastest[kind] = min((e[3] - e[2] for e in timeline if e[0] == kind), default=0.0)
    return [(e[0], e[1], 0.0, fastest[e[0]], *e[4:]) for e in timeline]


def record_pipeline(strategy, spec, info) -> None:
    """Have a pipelined engine strategy (train/mesh.py) write a `pipeline` event after each of its steps into this
    rank's event file: schedule, micro, stage, stages, the operations run in order (`ops`, e.g. "F0 F1 B0 ...";
    interleaved, each with its virtual stage: "F0/0 F1/0 F0/2 ..."),
    activation_peak_bytes, peak_in_flight, busy_s, wall_s, the step's bubble replayed from every stage's timeline
    (gathered over the pipeline's group: every stage reports the same value) and each stage's idle fraction of
    that replayed step (`stage_idle`, by stage; their mean is the bubble)."""
    from ..run.events import EventWriter
    inner = strategy.forward_backward
    writer: list = []

    def forward_backward(model, x, y, accum):
        loss = inner(model, x, y, accum)
        stage = strategy.stage
        r = stage.last if stage is not None else {}
        if not r:
            return loss
        timelines = [None] * stage.stages
        dist.all_gather_object(timelines, r["timeline"], group=stage.group)
        try:
            replay = replay_bubble(timelines)
            bubble = replay["bubble"]
            span = replay["span_s"]
            idle = [1 - busy / span if span > 0 else 0.0 for busy in replay["busy_s"]]
        except ValueError:
            bubble, idle = None, None
        if not writer:
            writer.append(EventWriter(spec.output_dir, info.rank))
        writer[0].emit("pipeline", schedule=spec.pipeline.schedule, micro=spec.pipeline.micro_batches,
                       stage=stage.stage, stages=stage.stages,
                       ops=" ".join(f"{e[0]}{e[1]}" + (f"/{e[4]}" if len(e) > 4 else "") for e in r["timeline"]),
                       activation_peak_bytes=r["activation_peak_bytes"], peak_in_flight=r["peak_in_flight"],
                       busy_s=r["busy_s"], wall_s=r["wall_s"], bubble=bubble, stage_idle=idle)
        return loss

    strategy.forward_backward = forward_backward
