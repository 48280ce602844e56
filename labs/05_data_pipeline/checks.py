"""Lab 05 public checks: what a student can self-check on the numbers the notebook recorded (the hidden checks hold
them against the storage servers' logs)."""
from scalelab.grade.checks import check


@check(points=1, needs_run=True)
def scaling_measured(r):
    """1, 2 and 4 readers (or the parameters' counts) were measured; more readers, less bandwidth each."""
    rows = sorted(r["scaling"]["rows"], key=lambda row: row["readers"])
    assert len(rows) >= 3 and rows[0]["readers"] == 1, f"readers measured: {[x['readers'] for x in rows]}"
    for a, b in zip(rows, rows[1:]):
        assert b["per_reader_mb_s"] < a["per_reader_mb_s"], \
            f"{b['readers']} readers got {b['per_reader_mb_s']:.2f} MB/s each, {a['readers']} got {a['per_reader_mb_s']:.2f}"


@check(points=1, needs_run=True)
def shards_written(r):
    """Exercise 1: write_shards wrote an index, and the shards' epoch opened far fewer files than the samples."""
    e = r["epoch_layouts"]
    assert e["written"]["written"], f"no shards: {e['written']['why']}"
    assert "shards" in e, "the shards' epoch was not read"
    assert e["shards"]["opens"] * 5 <= e["files"]["opens"], \
        f"the shards' epoch opened {e['shards']['opens']} files, the file-per-sample one {e['files']['opens']}"
    assert e["shards"]["wrong_bytes"] == 0, f"{e['shards']['wrong_bytes']} samples read from the shards were wrong"


@check(points=1, needs_run=True)
def sampler_ran(r):
    """Exercise 2: the readers ran shard_sampler; every epoch disjoint, complete, balanced, and reshuffled."""
    v = r["sampler_run"]["verdict"]
    bad = [k for k in ("disjoint", "complete", "balanced", "reshuffled") if not v[k]]
    assert not bad, f"the sampler's epochs were not {', '.join(bad)}: {v['epochs']}"


@check(points=1, needs_run=True)
def fair_share_measured(r):
    """Exercise 3: FIFO and your policy were both run; your policy ran in the server without an error."""
    rows = {row["policy"]: row for row in r["fair_share"]["rows"]}
    assert "fifo" in rows and "my_policy:pick" in rows, f"policies run: {sorted(rows)}"
    errors = rows["my_policy:pick"]["policy_errors"]
    assert not errors, f"my_policy.pick failed in the server: {errors[0]}"


@check(points=1, needs_run=True)
def engine_read_through_the_server(r):
    """Both training runs read through the server from both ranks; beside the bulk copy, each request waited
    longer."""
    rows = {row["name"]: row for row in r["engine_runs"]}
    alone, beside = rows.get("engine-alone"), next((x for n, x in rows.items() if n.startswith("engine-beside")), None)
    assert alone and beside, f"runs recorded: {sorted(rows)}"
    for row in (alone, beside):
        assert row["ranks"] == [0, 1] and row["bytes"] > 0, f"{row['name']}: ranks {row['ranks']} read {row['bytes']} B"
    assert beside["mean_wait_ms"] > alone["mean_wait_ms"], "the run beside the bulk copy did not wait longer"


@check(points=1, needs_run=True)
def spread_and_cache_measured(r):
    """Exercise 4: the spread and the cache runs were recorded, each epoch's reads counted by where they came from."""
    runs = {row["run"] for row in r["spread"]["rows"]}
    assert runs >= {"shared", "spread"}, f"spread runs recorded: {sorted(runs)}"
    assert set(r["cache"]["cut"]) == {"none", "private", "node"}, f"cache runs recorded: {sorted(r['cache']['cut'])}"
    paths = {tuple(row["path"]) for row in r["spread"]["rows"] if row["run"] == "spread"}
    assert paths == {("my_reader:read_sample",)}, f"the spread run's read path: {paths}"


@check(points=1, needs_run=True)
def read_decode_balance_measured(r):
    """Every split of the read threads and decode workers was measured, with the model's rate beside it."""
    rows = r["balance"]["rows"]
    assert len(rows) >= 2 and all(row["samples_per_s"] > 0 and row["model_samples_per_s"] > 0 for row in rows), rows
