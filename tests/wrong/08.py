"""Lab 08's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 3: the accounting forgets the work a fault throws away (everything done counts as useful)
    ("    unsaved = 0.0  # work done since the last checkpoint: a fault throws it away",
     """useful = checkpoint = restart = 0.0
fault_t = None
for e in events:
    if e["type"] == "step":
        useful += e["step_s"]
    elif e["type"] == "checkpoint":
        checkpoint += e["blocked_s"]
    elif e["type"] == "fault" and fault_t is None:
        fault_t = e["t"]
    elif e["type"] == "start" and fault_t is not None:
        restart += e["t"] - fault_t
        fault_t = None
return {"wall_s": events[-1]["t"] - events[0]["t"], "useful_s": useful, "lost_s": 0.0,
        "checkpoint_s": checkpoint, "restart_s": restart}"""),
    # exercise 4: each rank stops on its own signal, without a vote: rank 1 stops alone, rank 0 goes on into the
    # next step's all-reduce (a collective mismatch), and no rank's checkpoint is a consistent one
    ("        flag = torch.tensor([1.0 if self.signal else 0.0], device=device)",
     "return self.signal is not None"),
]
