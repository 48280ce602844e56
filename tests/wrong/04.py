"""Lab 04's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 3: the cosine decay counted from step 0, not from the end of the warm-up (the rate drops below the
    # peak at the last warm-up step, and the decay is off by the warm-up all the way down)
    ("    progress = (step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1)",
     """if step < warmup_steps:
    return peak_lr * (step + 1) / warmup_steps
progress = step / (total_steps - 1)
return 0.5 * peak_lr * (1 + math.cos(math.pi * progress))"""),
    # exercise 6: a script asking for one node (both ranks on it): it runs, but not across nodes. Only a multi-node
    # Slurm shows it (the grading runs at nodes = 1): tests/test_lab04_scaling.py submits it on the namespace cluster
    ("#SBATCH --nodes=2",
     """#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:10:00
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
srun --kill-on-bad-exit=1 python -m scalelab.train.worker --spec spec.json --log-dir logs"""),
]
