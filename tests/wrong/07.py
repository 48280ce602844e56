"""Lab 07's plausible mistakes, one per code exercise of section 4b (graded as the submission wrong_code:
tests/labtests.py)."""
WRONG = [
    # exercise 4b: the last stage starts its backwards with the micro-batch it finished last (a stack), the others
    # in order: stage 0 would take micro-batch 7's gradient for micro-batch 0's; the engine refuses the plan
    ('    return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]',
     """ops = [("F", i) for i in range(micro)]
if stage == stages - 1:
    return ops + [("B", i) for i in reversed(range(micro))]
return ops + [("B", i) for i in range(micro)]"""),
    # exercise 4c: the pipe "filled" with every micro-batch before the first backward: GPipe under another name,
    # holding all m micro-batches' activations
    ("    warm = min(stages - stage - 1, micro)",
     """warm = micro
ops = [("F", i) for i in range(warm)]
for i in range(micro - warm):
    ops += [("F", warm + i), ("B", i)]
return ops + [("B", i) for i in range(micro - warm, micro)]"""),
]
