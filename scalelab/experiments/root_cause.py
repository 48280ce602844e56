"""Lab 11 (ML for HPC): which rank, which phase? Root cause of a slow distributed run, from its own event files.

    dirs = [r["run_dir"] for r in slow_runs(out, held_out_cases(4))]     # real 2-rank DDP runs, one rank slowed
    table = phase_table(EventReader(dirs[0]).poll())                      # {rank: mean data_s, compute_s, ...}
    scored = evaluate(my_diagnose.diagnose, dirs)                         # your answers against each run's fault
    scored = evaluate("my_diagnose:diagnose", dirs)                       # the same, from my_diagnose.py (hashed)
    verify(scored, events_of, spec_of, grading_nonce)                     # the grader's side

Each run is an engine run (`launch(spec).wait()`) whose `fault` is kind slow on one rank in one phase
(train/faults.py): `data` sleeps `slow_s` in that rank's batch fetch (its data_s grows), `compute` before its
forward (its compute_s grows). Every rank's step events say where its time went (train/loop.py): data_s, compute_s
(step_s - data_s: forward, backward and any wait for the others) and comm_s (from a gradient bucket's all-reduce
start to its end). In data parallelism the ranks meet in every step's all-reduce, so the slow rank's lost time
shows on the *other* ranks too — as a long all-reduce: their comm_s, and with it their compute_s, grow by about
`slow_s`. A rank whose compute_s is long because it waited has a comm_s as long; the straggler's own extra
compute has none. `reference_diagnose` reads that: each rank's own work per phase is data_s and
compute_s - comm_s, and the straggler is the (rank, phase) whose own work exceeds the other ranks' most.

The cases (which rank, which phase) are drawn from the grading's nonce (`held_out_cases`), so answers copied from
another grading, or hard-coded, do not fit; the grader re-reads every run's events and spec (`verify`).
"""
from __future__ import annotations

import random
from pathlib import Path

from ..errors import SpecError
from ..run.nonce import mix_seed, nonce

PHASES = ("data", "compute")
"""The phases a straggler is slowed in, and the answers `diagnose` may give."""
COLUMNS = ("data_s", "compute_s", "comm_s", "step_s")
STEPS = 8
"""Steps of each run: the first is left out (start-up), the other 7 carry the slowness."""
SLOW_S = 0.08
"""Seconds the slow rank sleeps per step: a tiny-MLP step is ~10 ms; on a loaded 2-core machine the noise of one
step's phases stays well under this."""
CASES_SEED = 1101
"""Held-out cases are drawn from this seed outside a grading, from it mixed with the grading's nonce inside one."""
CURRENT = object()


def run_spec(out, case: dict, *, world: int = 2, steps: int = STEPS, slow_s: float = SLOW_S, device: str = "cpu",
             tag: str = "slow"):
    """The RunSpec of one slow run, in `out`/`tag`: the tiny preset's MLP on `world` ranks (gloo, one thread
    each), `case["rank"]` slowed by `slow_s` in `case["phase"]` from its second step on."""
    from ..run.spec import preset
    rank, phase = _case(case, world)
    return preset("tiny").replace(name=tag, output_dir=str(Path(out).resolve() / tag)).with_overrides({
        "device": device, "backend": "gloo", "model.name": "mlp", "world.workers_per_node": world,
        "world.threads_per_worker": 1, "steps": steps, "fault.kind": "slow", "fault.rank": rank,
        "fault.phase": phase, "fault.slow_s": float(slow_s), "fault.step": 1})


def slow_runs(out, cases, *, world: int = 2, steps: int = STEPS, slow_s: float = SLOW_S, device: str = "cpu",
              timeout: float = 300) -> list[dict]:
    """One engine run per case ({"rank": r, "phase": "data" | "compute"}), one after another, into `out`/slow-0,
    slow-1, ... (named by order, not by case: a folder's name gives nothing away; one already there is replaced, it
    would mix two launches' events). Returns [{"run_dir", "case", "summary"}] in the order of `cases`; the case is
    what the run's spec.json says too."""
    import shutil

    from ..launch import launch
    cases = list(cases)
    if not cases:
        raise SpecError("cases", "got no case: give at least one {'rank': r, 'phase': 'data' | 'compute'}")
    specs = [run_spec(out, case, world=world, steps=steps, slow_s=slow_s, device=device, tag=f"slow-{i}")
             for i, case in enumerate(cases)]  # every case checked before the first run starts
    rows = []
    for spec in specs:
        shutil.rmtree(spec.output_dir, ignore_errors=True)
        summary = launch(spec).wait(timeout=timeout)
        rows.append({"run_dir": spec.output_dir, "case": {"rank": spec.fault.rank, "phase": spec.fault.phase},
                     "summary": summary})
    return rows


def held_out_cases(n: int, world: int = 2, grading_nonce=CURRENT) -> list[dict]:
    """`n` cases (rank, phase) drawn from the grading's nonce (this process's by default; run/nonce.py), every
    phase and every rank present when `n` allows: a diagnosis that always answers one of them scores below full.
    Outside a grading the draw is fixed (CASES_SEED)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecError("n", f"need at least one held-out case, got {n!r}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 2:
        raise SpecError("world", f"got {world!r}; a straggler needs other ranks to be slower than: use 2 or more")
    g = nonce() if grading_nonce is CURRENT else grading_nonce
    rng = random.Random(mix_seed(CASES_SEED, g))
    pairs = [(r, p) for r in range(world) for p in PHASES]
    rng.shuffle(pairs)  # each pair once before any repeats: rank and phase both vary
    draws = [pairs[i % len(pairs)] for i in range(n)]
    return [{"rank": r, "phase": p} for r, p in draws]


def phase_table(events: list[dict], skip_first: bool = True) -> dict[int, dict]:
    """{rank: {"data_s", "compute_s", "comm_s", "step_s": the mean over its step events}}, the first step left out
    (its one-off start-up costs hide any straggler) unless `skip_first` is False."""
    steps: dict[int, list[dict]] = {}
    for e in events:
        if isinstance(e, dict) and e.get("type") == "step":
            steps.setdefault(int(e["rank"]), []).append(e)
    if not steps:
        raise SpecError("events", "hold no step event: pass a run's events (EventReader(run_dir).poll())")
    table = {}
    for rank, evs in sorted(steps.items()):
        evs = sorted(evs, key=lambda e: e["step"])
        kept = evs[1:] if skip_first and len(evs) > 1 else evs
        table[rank] = {c: sum(float(e.get(c, 0.0)) for e in kept) / len(kept) for c in COLUMNS}
    return table


def own_time(table: dict[int, dict]) -> dict[int, dict]:
    """Each rank's own work per phase: data_s, and compute_s less the time it waited in the all-reduce (comm_s)."""
    return {r: {"data": row["data_s"], "compute": max(row["compute_s"] - row["comm_s"], 0.0)}
            for r, row in table.items()}


def excess(table: dict[int, dict]) -> dict[tuple[int, str], float]:
    """(rank, phase) -> seconds per step by which that rank's own work in the phase exceeds the other ranks' mean."""
    own = own_time(table)
    if len(own) < 2:
        raise SpecError("events", f"come from {len(own)} rank(s); a straggler is found by comparing ranks")
    out = {}
    for r in own:
        for p in PHASES:
            others = [own[o][p] for o in own if o != r]
            out[(r, p)] = own[r][p] - sum(others) / len(others)
    return out


def reference_diagnose(events: list[dict]) -> dict:
    """The library's answer: the (rank, phase) whose own work exceeds the other ranks' most (`excess`)."""
    gaps = excess(phase_table(events))
    rank, phase = max(gaps, key=gaps.get)
    return {"rank": rank, "phase": phase}


def truth(spec_data: dict) -> dict:
    """The case a run was made with, from its spec.json (a dict): {"rank", "phase"}."""
    fault = (spec_data or {}).get("fault") or {}
    if fault.get("kind") != "slow" or fault.get("phase") not in PHASES:
        raise SpecError("fault", f"the run's spec has fault {fault!r}: not a slow run of slow_runs()")
    return {"rank": int(fault["rank"]), "phase": fault["phase"]}


def read_run(run_dir) -> tuple[list[dict], dict]:
    """A run's events (every rank's, EventReader) and its spec.json, read back from its folder."""
    import json

    from ..run.events import EventReader
    path = Path(run_dir) / "spec.json"
    if not path.is_file():
        raise SpecError("run_dirs", f"{str(run_dir)!r} holds no spec.json: pass the run_dir of slow_runs' rows")
    return EventReader(run_dir).poll(), json.loads(path.read_text())


def _answer(diagnose, events: list[dict], world: int) -> dict:
    """The student's answer, checked for shape; a malformed one raises SpecError with what came back."""
    got = diagnose(list(events))
    ok = isinstance(got, dict) and isinstance(got.get("rank"), int) and not isinstance(got.get("rank"), bool) \
        and 0 <= got["rank"] < world and got.get("phase") in PHASES
    if not ok:
        raise SpecError("diagnose", f"returned {got!r}; it must return {{'rank': 0..{world - 1}, 'phase': "
                                    f"{' or '.join(repr(p) for p in PHASES)}}}")
    return {"rank": got["rank"], "phase": got["phase"]}


def evaluate(diagnose, run_dirs) -> dict:
    """Call `diagnose(events)` on each run's events (a list of event dicts, every rank's; not its spec) and score
    it against the fault each run was made with: {"answers", "truths", "run_dirs", "right", "total", "score",
    "not_implemented", "code"}. `diagnose` is a function or "module:function" (e.g. "my_diagnose:diagnose", loaded
    afresh from the working folder: `code` then names the file with its SHA-256). A diagnose that raises
    NotImplementedError (an exercise not written yet) gives not_implemented=True and no answers, without raising."""
    code = {}
    if isinstance(diagnose, str):
        from .own_code import load_own
        diagnose, code = load_own(diagnose)
    run_dirs = [str(d) for d in run_dirs]
    if not run_dirs:
        raise SpecError("run_dirs", "got no run: pass the run_dir of each row slow_runs() returned")
    answers, truths = [], []
    for d in run_dirs:
        events, spec = read_run(d)
        truths.append(truth(spec))
        world = spec.get("world", {})
        ranks = int(world.get("workers_per_node", 2)) * int(world.get("nodes", 1))
        try:
            answers.append(_answer(diagnose, events, ranks))
        except NotImplementedError:
            return {"answers": [], "truths": truths, "run_dirs": run_dirs, "right": 0, "total": len(run_dirs),
                    "score": 0.0, "not_implemented": True, "code": code}
    right = sum(a == t for a, t in zip(answers, truths))
    return {"answers": answers, "truths": truths, "run_dirs": run_dirs, "right": right, "total": len(run_dirs),
            "score": right / len(run_dirs), "not_implemented": False, "code": code}


def verify_runs(run_dirs, events_of, spec_of, grading_nonce, *, n: int | None = None, world: int = 2) -> list[str]:
    """The grader's side, the runs: what is wrong with them (the empty list: nothing). `events_of(run_dir)` and
    `spec_of(run_dir)` re-read a run's events and spec.json (from the working copy, as data that may be hostile);
    `grading_nonce` is the grading's. Holds: the runs are this grading's held-out cases (`held_out_cases(n, world,
    grading_nonce)`, in order), each run's spec names its case, every start event carries the nonce, and each run
    shows its case: the slowed rank's own work in the slowed phase exceeds the others' by at least half its slow_s
    (the run was slowed as its spec says, not a spec.json rewritten afterwards)."""
    dirs = list(run_dirs or [])
    want = held_out_cases(n or len(dirs) or 1, world, grading_nonce)
    if len(dirs) != len(want):
        return [f"{len(dirs)} slow runs were made; the grading's held-out cases are {len(want)}"]
    problems = []
    for d, case in zip(dirs, want):
        spec, events = spec_of(d), events_of(d)
        try:
            made = truth(spec)
        except SpecError as e:
            problems.append(f"{d}: {e}")
            continue
        if made != case:
            problems.append(f"{d}: the run slowed {made}, this grading's held-out case is {case}")
            continue
        starts = [e for e in events if e.get("type") == "start"]
        if len(starts) != world or any(e.get("nonce") != grading_nonce for e in starts):
            problems.append(f"{d}: its {len(starts)} start events do not all carry this grading's nonce")
            continue
        seconds = float(spec["fault"].get("slow_s", 0.0))
        gap = excess(phase_table(events)).get((case["rank"], case["phase"]), 0.0)
        if seconds <= 0 or gap < 0.5 * seconds:
            problems.append(f"{d}: rank {case['rank']}'s own {case['phase']} time exceeds the others' by "
                            f"{gap * 1e3:.1f} ms per step, not the {seconds * 1e3:.0f} ms its spec slowed it by")
    return problems


def verify(recorded: dict, events_of, spec_of, grading_nonce, *, n: int | None = None, world: int = 2) -> list[str]:
    """The grader's side, the answers: `verify_runs` on the recorded runs, then the recorded truths and count of
    right answers against this grading's cases (the empty list: nothing wrong)."""
    dirs, answers = list(recorded.get("run_dirs") or []), list(recorded.get("answers") or [])
    if problems := verify_runs(dirs, events_of, spec_of, grading_nonce, n=n, world=world):
        return problems
    if len(answers) != len(dirs):
        return [f"{len(answers)} answers for {len(dirs)} runs (diagnose not implemented yet?)"]
    want = held_out_cases(len(dirs), world, grading_nonce)
    right = sum(a == c for a, c in zip(answers, want))
    problems = []
    if recorded.get("truths") != want:
        problems.append("the recorded truths are not the runs' faults")
    if recorded.get("right") != right:
        problems.append(f"{recorded.get('right')!r} answers recorded right; against the runs {right} are")
    return problems


def _case(case, world: int) -> tuple[int, str]:
    if not isinstance(case, dict) or set(case) != {"rank", "phase"}:
        raise SpecError("cases", f"got {case!r}; a case is {{'rank': r, 'phase': 'data' | 'compute'}}")
    rank, phase = case["rank"], case["phase"]
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise SpecError("cases", f"got rank {rank!r}; the runs have {world} ranks (0..{world - 1})")
    if phase not in PHASES:
        raise SpecError("cases", f"got phase {phase!r}; choose one of {', '.join(PHASES)}")
    return rank, phase


__all__ = ["PHASES", "STEPS", "SLOW_S", "run_spec", "slow_runs", "held_out_cases", "phase_table", "own_time",
           "excess", "reference_diagnose", "truth", "read_run", "evaluate", "verify_runs", "verify"]
