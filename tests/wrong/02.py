"""Lab 02's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 6: the all-reduce in fp32 (no cast): right values, twice the bytes of fp16
    ("    half = grad.to(torch.float16).div_(dist.get_world_size())",
     "grad.div_(dist.get_world_size())\nreturn dist.all_reduce(grad, async_op=True).get_future()"),
    # exercise 7: the residual is kept but never added back (error feedback without its effect)
    ("    k = max(1, int(state.ratio * full.numel()))",
     """grad = bucket.buffer()
world = dist.get_world_size()
full = grad.clone()
k = max(1, int(state.ratio * full.numel()))
_, idx = full.abs().topk(k, sorted=False)
values = full[idx].to(torch.float16)
if state.error_feedback:
    residual = full.clone()
    residual[idx] = 0
    state.memory[bucket.index()] = residual
all_values = [torch.empty_like(values) for _ in range(world)]
all_idx = [torch.empty(k, dtype=torch.int32) for _ in range(world)]
dist.all_gather(all_values, values)
dist.all_gather(all_idx, idx.to(torch.int32))
dense = torch.zeros_like(grad)
for v, i in zip(all_values, all_idx):
    dense.index_add_(0, i.long(), v.to(grad.dtype))
grad.copy_(dense.div_(world))
fut = torch.futures.Future()
fut.set_result(grad)
return fut"""),
]
