"""Lab 10's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 1: the objective tells optuna the trial is pruned but leaves its engine run training to the end: the
    # pruner saves nothing
    ("    run = launch(spec)",
     """run = launch(spec)
pruned = False
for event in run.follow("eval"):
    if event["rank"] == 0 and not pruned:
        trial.report(event["accuracy"], event["step"])
        pruned = trial.should_prune()
result = run.wait()
if pruned:
    raise optuna.TrialPruned()
return result["eval_accuracy"]"""),
    # exercise 5: the buffer, once full, overwrites a random slot with every new sample: it holds only the newest
    # samples, the task being learnt, and rehearses nothing old
    ("    if seen <= capacity:",
     "return seen - 1 if seen <= capacity else int(rng.integers(0, capacity))"),
]
