"""Horovod elastic: the training loop under `hvd.elastic.run`, so a lost worker costs a rollback, not the run.

    spec = preset("tiny").with_overrides({"strategy": "horovod", "launcher": "horovodrun",
                                          "world.workers_per_node": 3, "world.max_restarts": 2})
    horovodrun -np 3 --min-np 1 --max-np 3 --host-discovery-script <run dir>/elastic/discover_hosts.sh \\
        --reset-limit 2 --gloo python -m scalelab.train.worker ...     (launch/horovodrun.py writes both)

The state (model, optimizer, step) is an `hvd.elastic.TorchState`, committed to host memory every
`world.commit_every` steps. When a worker dies, the survivors' next allreduce fails (HorovodInternalError): each
restores the last commit, shuts Horovod down, meets the driver again (which blacklists the failed worker's host) and
goes on from the committed step with the smaller world. A worker that joins later (the host's `world.rejoin_s`
cooldown is over, or the discovery script lists a new host) interrupts the others at their next commit
(HostsUpdatedInterrupt) and is synced from rank 0's state before anyone trains on.

Why the data position is the step (no ElasticSampler): step s trains on global batch s, a fixed slice of a seeded
permutation of the training set, and each worker takes its share of that slice; losses are summed over the share
and divided by the global batch, gradients summed over the workers. The global batch, the learning rate and the
trajectory thus do not depend on how many workers there are — after a reset each survivor takes a larger share —
and a run that lost a worker ends where one process replaying the same steps ends (`replay`), up to the order of
the float sums (about 1e-7 over tens of steps; a long run amplifies even that, fault or not).

Every worker writes its own event file: the first ones as their launch rank, a worker that joins later as the next
free number (`claim_worker`). A `recovered` event (mode elastic) names the workers lost and added, the world before
and after, the step resumed from (the last commit) and the seconds from detection to training again.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import build_dataset
from ..data.loader import build_eval_set
from ..dist import threads_per_rank
from ..run.events import events_dir
from ..run.combinations import horovod_elastic
from .faults import maybe_inject, targets
from .build import autocast_for, build_training
from .optim import lr_of
from .strategies import pick_device


def is_elastic(spec) -> bool:
    """Whether `spec` runs under Horovod elastic (strategy horovod, launcher horovodrun, world.max_restarts > 0)."""
    return horovod_elastic(spec)


def elastic_dir(spec) -> Path:
    """This launch's folder of worker claims and fault markers (the launcher names it in SCALELAB_ELASTIC_DIR)."""
    return Path(os.environ.get("SCALELAB_ELASTIC_DIR") or Path(spec.output_dir) / "elastic")


def claim_worker(spec, info):
    """`info` with the rank this worker's events go under: its launch rank if no worker of this launch has taken it,
    else the next number from the world size up (a worker Horovod started later, in place of a lost one)."""
    claims = elastic_dir(spec) / "workers"
    claims.mkdir(parents=True, exist_ok=True)
    events_dir(spec.output_dir).mkdir(parents=True, exist_ok=True)
    wid = info.rank
    while True:
        try:
            os.close(os.open(claims / str(wid), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return dataclasses.replace(info, rank=wid)
        except FileExistsError:
            wid = max(wid + 1, spec.world_size)


def batch_indices(step: int, samples: int, global_batch: int, seed: int) -> torch.Tensor:
    """The samples of global batch `step`: its slice of a seeded permutation of the training set (one per epoch)."""
    per_epoch = max(samples // global_batch, 1)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return order[k * global_batch:(k + 1) * global_batch]


def share(indices: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Worker `rank`'s part of a global batch among `world` workers (sizes differ by one at most)."""
    return indices.tensor_split(world)[rank]


def _setup(spec, device=None):
    """Data, model, optimizer and learning rate, as every worker and `replay` build them (on `device`: CPU)."""
    dataset = build_dataset(spec.data, spec.seed)
    x, y = dataset.tensors
    device = device if device is not None else torch.device("cpu")
    model, optimizer, peak_lr = build_training(spec, dataset, device, spec.seed)
    return x.to(device), y.to(device), model, optimizer, peak_lr


def _autocast(spec, device):
    """bf16 only: an elastic run has no GradScaler, so fp16 runs unscaled in fp32."""
    return autocast_for("bf16" if spec.precision == "bf16" else "fp32", device)


def replay(spec, steps: int | None = None) -> dict[str, torch.Tensor]:
    """The model after `steps` (default spec.steps) of the same trajectory in this one process: each global batch
    whole, its summed loss divided by the global batch — what an elastic run ends at, whatever its resets."""
    x, y, model, optimizer, peak_lr = _setup(spec)
    g = spec.global_batch
    for step in range(spec.steps if steps is None else steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_of(spec.optim, step, peak_lr, spec.steps)
        idx = batch_indices(step, len(y), g, spec.seed)
        optimizer.zero_grad()
        with _autocast(spec, torch.device("cpu")):
            loss = F.cross_entropy(model(x[idx]).float(), y[idx], reduction="sum") / g
        loss.backward()
        optimizer.step()
    return model.state_dict()


class _Membership:
    """Who is in the group, and what the last reset cost: turned into `recovered` / `joined` events."""

    def __init__(self, hvd, wid, events):
        self.hvd, self.wid, self.events = hvd, wid, events
        self.members: list[int] | None = None
        self.rank = 0
        self.failure: dict | None = None
        self.resets = 0

    def lost(self, step: int, reason: str) -> None:
        """A collective failed (reason failure) or hosts changed (hosts_changed) at `step`: remember when."""
        if self.failure is None:
            self.failure = {"reason": reason, "failed_step": step, "detected_t": time.time()}

    def formed(self, step: int) -> None:
        """The group is (re)formed and the state synced at `step`: learn the members, report what changed."""
        hvd = self.hvd
        members = [int(m) for m in hvd.allgather_object(self.wid)]  # worker ids in current rank order
        before, self.members = self.members, members
        if before is None and step > 0:  # a worker started after a reset: synced from rank 0's state
            self.events.emit("joined", step=step, members=members, world_size=len(members), hvd_rank=hvd.rank())
        elif before is not None:
            f = self.failure or {"reason": "hosts_changed", "failed_step": step, "detected_t": time.time()}
            self.resets += 1
            self.events.emit("recovered", mode="elastic", reason=f["reason"], generation=self.resets,
                             lost=[w for w in before if w not in members], added=[w for w in members if w not in before],
                             members=members, world_before=len(before), world_size=len(members),
                             rank_before=self.rank, hvd_rank=hvd.rank(), failed_step=f["failed_step"],
                             resumed_step=step, rolled_back_steps=f["failed_step"] - step,
                             detected_t=f["detected_t"], recover_s=time.time() - f["detected_t"])
        self.rank, self.failure = hvd.rank(), None


def _maybe_fault(spec, wid: int, step: int, events) -> None:
    """The spec's fault, fired once per launch: a worker started later at the same rank and step does not fail."""
    f = spec.fault
    if f.kind in ("none", "slow") or not targets(f, wid) or step != f.step:
        maybe_inject(f, wid, step, events)  # nothing, or a straggler's sleep
        return
    try:
        os.close(os.open(elastic_dir(spec) / f"fault-{wid}-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    maybe_inject(f, wid, step, events)


def train(spec, info, events) -> dict:
    """Run `spec` as worker `info.rank` under hvd.elastic.run; returns the end event's fields."""
    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    started = time.perf_counter()
    threads = threads_per_rank(spec, spec.world.workers_per_node)  # every pseudo-host is this node: share its CPUs
    torch.set_num_threads(threads)
    hvd.init()
    # on one node every slot is its own host (local rank 0): the worker number spreads the GPUs instead
    device = pick_device(spec, info.rank)
    x_all, y_all, model, optimizer, peak_lr = _setup(spec, device)
    g, total, run_dir = spec.global_batch, spec.steps, Path(spec.output_dir)
    # op=Sum: each worker's loss is already its share of the global mean, whatever the world size
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Sum)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    group = _Membership(hvd, info.rank, events)
    autocast = _autocast(spec, device)
    events.emit("start", world_size=hvd.size(), local_rank=info.local_rank, rank_source=info.source,
                backend="horovod-gloo", device=str(device), threads=threads, wait="block", pid=os.getpid(),
                host=socket.gethostname(), horovod_host=os.environ.get("HOROVOD_HOSTNAME"), total_steps=total,
                start_step=0, resumed_from=None, global_batch=g, peak_lr=peak_lr, elastic=True, hvd_rank=hvd.rank(),
                commit_every=spec.world.commit_every, parameters=sum(p.numel() for p in model.parameters()),
                strategy=spec.strategy)

    def steps(state) -> dict:
        loss_value = float("nan")
        while state.step < total:
            step = state.step
            _maybe_fault(spec, info.rank, step, events)
            lr = lr_of(spec.optim, step, peak_lr, total)
            for pg in optimizer.param_groups:
                pg["lr"] = lr
            t0 = time.perf_counter()
            idx = share(batch_indices(step, len(y_all), g, spec.seed), hvd.rank(), hvd.size()).to(device)
            x, y = x_all[idx], y_all[idx]
            data_s = time.perf_counter() - t0
            optimizer.zero_grad()
            with autocast:
                loss = F.cross_entropy(model(x).float(), y, reduction="sum") / g
            loss.backward()
            t_comm = time.perf_counter()
            optimizer.synchronize()  # where a dead peer shows: HorovodInternalError
            comm_s = time.perf_counter() - t_comm
            with optimizer.skip_synchronize():
                optimizer.step()
            state.step = done = step + 1
            if done % spec.log_every == 0 or done == total:  # every worker decides alike: a collective is safe
                loss_value = float(hvd.allreduce(loss.detach(), op=hvd.Sum, name="scalelab.loss"))
                step_s = time.perf_counter() - t0
                events.emit("step", step=done, loss=loss_value, lr=lr, samples=len(idx), step_s=step_s,
                            data_s=data_s, compute_s=max(step_s - data_s - comm_s, 0.0), comm_s=comm_s,
                            samples_per_s=len(idx) / step_s, world_size=hvd.size(), hvd_rank=hvd.rank())
            if done % spec.world.commit_every == 0 or done == total:
                t_commit = time.perf_counter()
                state.commit()  # a copy to host memory, then a check for hosts added or removed
                events.emit("commit", step=done, world_size=hvd.size(), commit_s=time.perf_counter() - t_commit)
        return {"final_loss": loss_value, "eval_accuracy": _evaluate(hvd, model, spec, autocast, device)}

    @hvd.elastic.run
    def elastic_steps(state) -> dict:
        try:
            group.formed(state.step)
            return steps(state)
        except HorovodInternalError:
            group.lost(state.step, "failure")
            raise
        except HostsUpdatedInterrupt:
            group.lost(state.step, "hosts_changed")
            raise

    result = elastic_steps(state)
    if hvd.rank() == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, run_dir / "model.pt")
    end = dict(steps=total, **result, elapsed_s=time.perf_counter() - started, world_size=hvd.size(),
               resets=group.resets, members=group.members)
    events.emit("end", **end)
    hvd.shutdown()
    return end


@torch.no_grad()
def _evaluate(hvd, model, spec, autocast, device) -> float:
    """Accuracy on the held-out set, split over the current workers (correct answers summed, not averaged)."""
    x, y = build_eval_set(spec.data, spec.seed)
    x, y = x.tensor_split(hvd.size())[hvd.rank()].to(device), y.tensor_split(hvd.size())[hvd.rank()].to(device)
    model.eval()
    with autocast:
        correct = float((model(x).argmax(dim=1) == y).sum()) if len(y) else 0.0
    model.train()
    counts = hvd.allreduce(torch.tensor([correct, float(len(y))], dtype=torch.float64), op=hvd.Sum,
                           name="scalelab.eval")
    return float(counts[0] / counts[1]) if counts[1] else 0.0


__all__ = ["is_elastic", "claim_worker", "elastic_dir", "batch_indices", "share", "replay", "train"]
