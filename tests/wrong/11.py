"""Lab 11's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 2: blames the longest raw phase: the rank that waited in the all-reduce has the longest compute_s,
    # so a slow data phase is blamed on the other rank's compute (2 of 4 right)
    ("    table = phase_table(events)  # {rank: mean data_s, compute_s, comm_s, step_s over the steps}",
     """table = phase_table(events)
rank, phase = max(((r, p) for r in table for p in ("data", "compute")), key=lambda rp: table[rp[0]][rp[1] + "_s"])
return {"rank": rank, "phase": phase}"""),
    # exercise 3: the policy waits for the checkpoint before it submits: reactive submission in disguise, the next
    # link queues again after every link
    ("    return view.left_h <= wait_model.predict(view.features())",
     "return view.left_h <= 0"),
]
