"""Lab 12's further submissions, graded in its shared batch (tests/labtests.py: VARIANTS): two other teams' choices
(one slower to the target, one that misses it), two forgeries (checkpoints swapped for the final weights; a run
written by hand) and a hunt for the held-out set's seed from inside the notebook. tests/test_lab12_capstone.py ranks them from the grader's own results."""
from __future__ import annotations

CHOICES_LINE = '    choices = {"global_batch": 128, "workers": 2, "optimizer": "adamw", "lr": 0.003, "warmup_steps": 10,'
RUN_LINE = "run = launch(spec)"

SLOW = ('choices = {"global_batch": 128, "workers": 2, "optimizer": "adamw", "lr": 0.0001, "steps": 1200, '
        '"checkpoint_every": 20}')
"""A thirtieth of the reference's rate, constant: about 580 steps to 0.75 (740 to 0.8) instead of under 100 (measured here)."""
MISSED = ('choices = {"global_batch": 128, "workers": 2, "optimizer": "adamw", "lr": 0.00003, "steps": 100, '
          '"checkpoint_every": 20}')
"""A rate far too small for 100 steps: about 0.2 at the end, the target never reached."""

SWAPPED = '''
# the run's final weights copied into every checkpoint (the manifest's checksums redone): early checkpoints that score
# as well as the end, as if the target had been reached at the first one
import torch
from scalelab.ckpt.manifest import checksum_file
ck = Path(run.run_dir) / "checkpoints"
final = torch.load(Path(run.run_dir) / "model.pt", weights_only=True)
manifest = json.loads((ck / "manifest.json").read_text())
for entry in manifest["checkpoints"]:
    state = torch.load(ck / entry["file"], weights_only=True)
    state["model"] = final
    torch.save(state, ck / entry["file"])
    entry["checksum"] = checksum_file(ck / entry["file"])
(ck / "manifest.json").write_text(json.dumps(manifest))
'''

FORGED = '''
# no engine run: events written by hand (this grading's nonce read from the environment, as a forger who read the
# docs would), checkpoints of an untrained model in the engine's own format, an accuracy claimed at every step
import os, time
from scalelab.ckpt import save_checkpoint
from scalelab.run.field_groups import ModelSpec
from scalelab.train.models import build_model
import torch
run_dir = out / "capstone"
(run_dir / "events").mkdir(parents=True, exist_ok=True)
model = build_model(ModelSpec(**capstone.CHALLENGE["model"]), 1, 16, 4, seed=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
nonce = os.environ.get("SCALELAB_GRADE_NONCE")
steps = choices["steps"]
for rank in range(2):
    with open(run_dir / "events" / f"rank-{rank}.jsonl", "w") as f:
        def emit(**e):
            f.write(json.dumps({"rank": rank, "t": time.time(), **e}) + "\\n")
        emit(type="start", world_size=2, start_step=0, total_steps=steps, strategy="ddp", global_batch=128,
             nonce=nonce, threads=1)
        for step in range(1, steps + 1):
            emit(type="step", step=step, loss=1.4 - step / steps, lr=0.003, samples=64, step_s=0.01, data_s=0.0,
                 compute_s=0.01, comm_s=0.0, samples_per_s=6400.0)
            if step % 10 == 0 and step < steps:
                emit(type="eval", step=step, accuracy=0.9)
                if rank == 0:
                    save_checkpoint(run_dir / "checkpoints", step, model, optimizer, keep_last=100)
                emit(type="checkpoint", step=step, metric=0.5, blocked_s=0.0, mode="sync")
        emit(type="end", steps=steps, final_loss=0.4, eval_accuracy=0.9, elapsed_s=2.0)
torch.save(model.state_dict(), run_dir / "model.pt")
record("capstone", {"run_dir": str(run_dir), "eval_accuracy": 0.9, "launches": 1, "rank_seconds": 4.0,
                    "lost_s": [], "accuracy_curve": [[1.0, 100, 0.9]]})
view = {"accuracy_curve": [(1.0, 100, 0.9)], "lost_s": [], "launches": 1, "faults": []}
'''


def variants(edited_copy) -> dict:
    """{submission name: function(lab, dest)} for labtests.VARIANTS["12_capstone"]."""
    return {
        "slow_choices": lambda lab, dest: edited_copy(lab, dest, block=(CHOICES_LINE, SLOW)),
        "missed_target": lambda lab, dest: edited_copy(lab, dest, block=(CHOICES_LINE, MISSED)),
        "swapped_weights": lambda lab, dest: edited_copy(lab, dest, after=(RUN_LINE, SWAPPED)),
        "forged_events": lambda lab, dest: edited_copy(lab, dest, replace=(RUN_LINE, FORGED)),
        "seed_hunt": lambda lab, dest: edited_copy(lab, dest, after=(RUN_LINE, SEED_HUNT)),
    }

SEED_HUNT = '''
# a student looking for the grader's held-out seed wherever the notebook's process can read: its job folder, home,
# temporary folders, the environment, and every lab folder and checkout it can find
import os
needles = [str(730184966 + 1), "_".join(["730", "184", "967"])]  # built here: this cell's source holds neither
hits, looked = [], 0
roots = {str(Path.cwd().parent), os.path.expanduser("~"), "/tmp", "/var/tmp", "/dev/shm", "/work", "/opt", "/srv"}
for root in sorted(roots):
    for folder, dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:
                if os.path.getsize(path) < 2_000_000:
                    looked += 1
                    text = open(path, "rb").read().decode("utf-8", "replace")
                    if any(n in text for n in needles) or name == "hidden_checks.py":
                        hits.append(path)
            except OSError:
                pass
        if looked > 20000:
            break
hits += [f"environ:{k}" for k, v in os.environ.items() if any(n in v for n in needles)]
record("seed_hunt", {"hits": hits[:20], "looked": looked})
'''
