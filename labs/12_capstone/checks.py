"""Lab 12 public checks: the team's choices are on the menu, and the run came to its end."""
from scalelab.grade.checks import check

MENU_KEYS = {"global_batch", "lr", "lr_scaling", "schedule", "warmup_steps", "optimizer", "strategy", "workers",
             "nodes", "data_format", "checkpoint_every", "steps", "samples"}


@check(points=1, needs_run=True)
def choices_are_on_the_menu(r):
    """Exercise 2: `choices` names only the challenge's levers (capstone.checked_choices filled in the rest), and
    the notebook made the run."""
    c = r["choices"]
    assert isinstance(c, dict) and set(c) <= MENU_KEYS, f"not choices of the challenge: {sorted(set(c) - MENU_KEYS)}"
    assert c["global_batch"] % (c["workers"] * c["nodes"]) == 0, "the global batch must split over the ranks"


@check(points=1, needs_run=True)
def run_came_to_its_end(r):
    """The run finished (after its restart, if one of its ranks was killed) and reported its accuracy."""
    cap = r["capstone"]
    assert isinstance(cap.get("eval_accuracy"), float), "the run reported no final accuracy: did it finish?"
    kill = r["lab12_params"]["kill_at_step"]
    if 0 < kill < r["choices"]["steps"]:
        assert cap["launches"] >= 2, f"a rank was killed before step {kill}, yet the run had {cap['launches']} launch"
