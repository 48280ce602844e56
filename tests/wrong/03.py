"""Lab 03's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 1: the port wraps and broadcasts the parameters but not the optimizer state (rank 0 resumed with
    # another learning rate: the others keep theirs, and the replicas drift apart from the first step)
    ("    hvd.broadcast_optimizer_state(optimizer, root_rank=0)",
     """optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)"""),
    # exercise 2: the metric summed over the ranks, not averaged
    ("    return hvd.allreduce(torch.tensor(float(value)), name=name, op=hvd.Average).item()",
     "return hvd.allreduce(torch.tensor(float(value)), name=name, op=hvd.Sum).item()"),
    # exercise 4: every ALLREDUCE span counted as a fused all-reduce of its own (the fusion never seen)
    ("            if groups and start < groups[-1][1]:",
     """reduces, negotiations = defaultdict(list), defaultdict(list)
for activity, start, end, tensor in sorted(timeline["spans"], key=lambda s: s[1]):
    if tensor.startswith("allreduce.") and activity == "ALLREDUCE":
        reduces[tensor].append((start, end))
    elif tensor.startswith("allreduce.") and activity == "NEGOTIATE_ALLREDUCE":
        negotiations[tensor].append((start, end))
steps = min((len(spans) for spans in reduces.values()), default=0)
firsts = [min(spans[k][0] for spans in negotiations.values() if len(spans) > k) for k in range(steps)]
gaps = [b - a for a, b in zip(firsts, firsts[1:])]
fused = sum(len(spans[:steps]) for spans in reduces.values())
return {"steps": steps, "tensors": len(reduces), "fused_per_step": fused / steps if steps else 0.0,
        "tensors_per_fused": len(reduces) * steps / fused if fused else 0.0,
        "step_ms": 1e3 * statistics.median(gaps) if gaps else 0.0}"""),
]
