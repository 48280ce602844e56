"""Lab 09's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 1: the trust ratio without the trust coefficient eta: every layer steps by lr x its weight norm
    ("    return eta * w_norm / (g_norm + weight_decay * w_norm)",
     "return w_norm / (g_norm + weight_decay * w_norm)"),
    # exercise 2: every large-batch run counted, a run that never reached the target as 0 s to it (so large-batch
    # SGD, which stalls in every race: test_reference_numbers_tell_the_lab_story). Not "the fastest over every
    # batch": whether small-batch SGD beats the fastest large-batch run in seconds depends on the machine's load
    ('best_large_batch = min(hits, key=lambda r: r["reached"]["seconds"])["label"] if hits else None',
     'hits = [r for r in race if r["batch"] == big]\n'
     'best_large_batch = min(hits, key=lambda r: (r["reached"] or {}).get("seconds", 0))["label"] if hits else None'),
    # exercise 3: the wall speedup as the iteration saving times the step cost (it is the saving over the cost)
    ('wall_speedup = runs["sgd"]["reached"]["seconds"] / runs["kfac"]["reached"]["seconds"]',
     'runs = {r["label"]: r for r in kfac_race}\n'
     'iteration_saving = runs["sgd"]["reached"]["steps"] / runs["kfac"]["reached"]["steps"]\n'
     'step_cost = runs["kfac"]["seconds_per_step"] / runs["sgd"]["seconds_per_step"]\n'
     'wall_speedup = iteration_saving * step_cost'),
    # exercise 4: the eigenvectors only, the eigenvalues forgotten
    ("comm_opt_bytes = sum(4 * (a + a * a + g + g * g) for a, g in dims)",
     "comm_opt_bytes = sum(4 * (a * a + g * g) for a, g in dims)"),
    # exercise 5: the sum of outer products, not their mean (the factor grows with the rows: batch x positions)
    ("    return rows.t() @ rows / rows.shape[0]",
     "return rows.t() @ rows"),
]
