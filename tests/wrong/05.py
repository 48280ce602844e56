"""Lab 05's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 1: one shard file per sample (a "shard" is still a small file): the epoch opens one file per sample
    ("        name = f\"shard-{k // per_shard:05d}.bin\"",
     """folder = Path(folder)
index = []
for i, sample in enumerate(samples):
    name = f"shard-{i:05d}.bin"
    (folder / name).write_bytes(sample)
    index.append({"shard": name, "offset": 0, "length": len(sample)})
(folder / "index.json").write_text(json.dumps(index))"""),
    # exercise 2: each rank shuffles with its own seed and takes n // world samples: ranks overlap, some samples are
    # never read, and the tail is dropped
    ("    order = np.random.default_rng([seed, epoch]).permutation(n)",
     """order = np.random.default_rng([seed, epoch, rank]).permutation(n)
return order[: n // world].tolist()"""),
    # exercise 3: the job with the most requests waiting goes first (it looks busiest): FIFO's shares, or worse
    ("    return min(range(len(queue)), key=lambda i: (served.get(queue[i][\"job\"], 0), i))",
     """jobs = [q["job"] for q in queue]
return max(range(len(queue)), key=lambda i: (jobs.count(jobs[i]), -i))"""),
    # exercise 4: the read path ignores the spread data set and the node cache: every read goes to the shared FS
    ("    elif reader.index.owner_of(i) == reader.node:",
     """return reader.from_shared(i)"""),
]
