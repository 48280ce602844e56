"""Lab 01's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 1: a timer that never waits for the device: right on a CPU, launch time only on a GPU (and the probe)
    ("    sync()  # the timed steps' work is done only now",
     """for _ in range(warmup):
    step()
start = time.perf_counter()
for _ in range(steps):
    step()
return (time.perf_counter() - start) / steps"""),
    # exercise 4: autocast for the device of the tutorial it was copied from: on a CPU it is switched off (a warning)
    ("    with torch.autocast(device_type=x.device.type, dtype=dtype):",
     """with torch.autocast(device_type="cuda", dtype=dtype):
    loss = F.cross_entropy(model(x), y)
if scaler is not None:
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
else:
    loss.backward()
    optimizer.step()
optimizer.zero_grad()
return loss.item()"""),
]
