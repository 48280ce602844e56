"""Forward recovery: when a rank is lost, the survivors re-form the group and carry on from the state they hold in
memory — no rollback to a checkpoint, no restart of the processes (`fault.recovery = "forward"`).

Data parallelism makes this possible: every rank holds the whole model and optimizer state, identical after each
step, so any survivor's copy is the run's state. The gradients are averaged by an explicit all-reduce after
backward (not DDP's reducer, which is bound to one process group for life). When that all-reduce fails because a
peer died, each survivor:

1. leaves the broken group;
2. announces itself in `<run dir>/recovery/gen-<g>/` and waits for the peers whose processes are still alive (a
   hung peer that never announces itself is left behind after `JOIN_S`, and the new leader SIGKILLs it: fencing);
3. the lowest surviving rank writes the member list; everyone on it joins a new gloo group over a file store;
4. the same step's gradients are all-reduced again among the survivors — the step is not lost.

Each survivor keeps its own data shard, so the global batch shrinks to survivors x batch_per_worker; the learning
rate is scaled by the same factor (the linear scaling rule) to keep the per-sample step size. A `recovered` event
names the lost ranks, the new world, and how long detection and re-forming took.
Restart-from-checkpoint (torchrun's max_restarts) is the alternative: it loses the steps since the checkpoint and
the start-up time of new processes, but keeps the global batch.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..run.events import EventReader, EventWriter
from ..run.procs import is_peer_failure
from .strategies import DDPStrategy

JOIN_S = 10.0
"""How long survivors wait for a live peer to announce itself before leaving it behind."""


class ForwardRecoveryDDP(DDPStrategy):
    """Data parallel with an explicit gradient all-reduce that survives the loss of ranks."""

    name = "ddp"

    def __init__(self, spec, info, device):
        super().__init__(spec, info, device)
        self.members = list(range(info.world_size))
        """The original ranks still in the group."""
        self.generation = 0
        self.run_dir = Path(spec.output_dir)
        self._events = None

    @property
    def world(self) -> int:
        """Ranks in the group now."""
        return len(self.members)

    @property
    def lr_factor(self) -> float:
        """The learning rate's scale: survivors / original ranks (the global batch shrank by as much)."""
        return self.world / self.info.world_size

    def wrap(self, model, optimizer):
        """No DDP wrapper: start from rank 0's parameters, average gradients in `step`."""
        if self.world > 1:
            for p in model.parameters():
                dist.broadcast(p.data, 0)
        return model, optimizer

    def no_sync(self, model):
        """Accumulation micro-batches just add up locally (nothing is reduced before `step`)."""
        return contextlib.nullcontext()

    def step(self, optimizer, scaler=None) -> None:
        """Average the gradients over the survivors (re-forming the group if a peer is lost), then step."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        t0 = time.perf_counter()
        flat = self._resilient(lambda: self._sum(grads))
        if flat is not None:
            flat /= self.world
            torch.nn.utils.vector_to_parameters(flat, grads)  # writes the averages back into the grad tensors
        self.comm_s += time.perf_counter() - t0
        for group in optimizer.param_groups:
            group["lr"] *= self.lr_factor  # the loop sets the lr afresh each step
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    def _sum(self, grads):
        if self.world == 1:
            return None
        flat = torch.cat([g.reshape(-1) for g in grads])  # a fresh buffer: a failed all-reduce leaves grads intact
        dist.all_reduce(flat)
        return flat

    def mean(self, value: float) -> float:
        """Average a scalar over the survivors."""
        def reduce():
            if self.world == 1:
                return value
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t)
            return float(t.item()) / self.world
        return self._resilient(reduce)

    def barrier(self) -> None:
        """Wait for every survivor."""
        self._resilient(lambda: dist.barrier() if self.world > 1 else None)

    def shutdown(self) -> None:
        """Leave the group; close the recovery event writer."""
        super().shutdown()
        if self._events is not None:
            self._events.close()

    # -- recovery -------------------------------------------------------------------------------------
    def _resilient(self, collective):
        """Run `collective`; when a peer's death breaks it, re-form the group and run it again."""
        while True:
            try:
                return collective()
            except Exception as e:  # noqa: BLE001 - only a peer's failure is recovered from; the rest re-raise
                if not (is_peer_failure(e) or "Timed out" in str(e)):  # a dead peer, or a silent one (hung)
                    raise
                self._reform(e)

    def _reform(self, error) -> None:
        detected = time.time()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self.generation += 1
        gen_dir = self.run_dir / "recovery" / f"gen-{self.generation}"
        gen_dir.mkdir(parents=True, exist_ok=True)
        me = self.info.rank
        (gen_dir / f"joined-{me}").write_text(str(os.getpid()))
        pids = _start_pids(self.run_dir)
        # Asked again at each poll: a peer whose death broke the collective may still be exiting when this rank
        # notices (its sockets close before its process is gone); counted once, it made the survivors wait the whole
        # JOIN_S for a rank that was already dead (CI: forward recovery 10.06 s against 0.03 s).
        members = _agree(gen_dir, me, lambda: [r for r in self.members if r == me or _pid_alive(pids.get(r))])
        if me not in members:
            raise RuntimeError(f"rank {me} was left out of the re-formed group {members} (it announced itself late)")
        lost = [r for r in self.members if r not in members]
        self.members = members
        if members[0] == me:
            _fence(pids, lost)
        if self.world > 1:
            dist.init_process_group("gloo", init_method=f"file://{gen_dir / 'store'}", rank=members.index(me),
                                    world_size=self.world, timeout=timedelta(seconds=self.spec.fault.detect_timeout_s))
        if self._events is None:
            self._events = EventWriter(self.run_dir, me)
        self._events.emit("recovered", lost=lost, members=members, world_size=self.world, generation=self.generation,
                          lr_factor=self.lr_factor, recover_s=time.time() - detected, detected_t=detected,
                          error=str(error).splitlines()[0][:200])


def _start_pids(run_dir: Path) -> dict[int, int]:
    """{rank: the pid of its latest process}, from the ranks' start events."""
    return {e["rank"]: e["pid"] for e in EventReader(run_dir).poll() if e["type"] == "start"}


def _pid_alive(pid: int | None) -> bool:
    """Whether process `pid` still runs on this machine (a zombie does not)."""
    from ..run.procs import alive
    import psutil
    if pid is None:
        return False
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _fence(pids: dict[int, int], lost: list[int]) -> None:
    """SIGKILL left-behind ranks that still run (a hung rank): it must not wake up and rejoin, nor outlive the run.
    `pids` are the ranks' start pids as `_reform` read them."""
    import signal
    for rank in lost:
        if _pid_alive(pids.get(rank)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pids[rank], signal.SIGKILL)


def _agree(gen_dir: Path, me: int, expected) -> list[int]:
    """The member list of this generation: the lowest announced rank writes it once the peers `expected()` names
    (asked at each poll: those still alive) have announced themselves, or JOIN_S passed; the others read it."""
    listing = gen_dir / "members.json"
    deadline = time.monotonic() + JOIN_S
    while time.monotonic() < deadline + JOIN_S:
        if listing.exists():
            return json.loads(listing.read_text())
        joined = sorted(int(p.name.split("-")[1]) for p in gen_dir.glob("joined-*"))
        if joined and joined[0] == me and (time.monotonic() > deadline or set(expected()) <= set(joined)):
            tmp = gen_dir / f"members.{me}.tmp"
            tmp.write_text(json.dumps(joined))
            os.replace(tmp, listing)
            return joined
        time.sleep(0.05)
    raise RuntimeError(f"no member list appeared in {gen_dir} within {2 * JOIN_S:g} s")


__all__ = ["ForwardRecoveryDDP", "JOIN_S"]
