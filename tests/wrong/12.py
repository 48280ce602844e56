"""Lab 12's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 1: the warm-up counts from 0, so step 0 trains at rate 0 and the peak comes one step late
    ("        return peak_lr * (step + 1) / warmup_steps",
     """if step < warmup_steps:
    return peak_lr * step / warmup_steps
progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
return 0.5 * peak_lr * (1.0 + math.cos(math.pi * progress))"""),
]
