"""Course settings: defaults + course file (YAML or TOML) + overrides, checked with messages that say the fix."""
from __future__ import annotations

import json

import pytest

from scalelab.hub.settings import (SettingsError, deep_merge, hub_config_dir, load_settings, load_settings_from_env,
                                   read_settings_file)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shipped_course_file_and_defaults_are_valid():
    cfg = load_settings()
    assert cfg["mode"] == "local"
    assert cfg["hub"]["ip"] == "127.0.0.1"
    assert [p["name"] for p in cfg["slurm"]["profiles"]] == ["cpu-2h", "gpu1-2h", "node4gpu", "nodes2x4gpu"]
    assert cfg["hub"]["state_dir"] == str(hub_config_dir().parent / ".scalelab" / "hub")


def test_yaml_and_toml_give_the_same_settings(tmp_path):
    y = write(tmp_path, "c.yaml", "mode: slurm\nslurm:\n  reservation: course\n  poll_max: 8\n")
    t = write(tmp_path, "c.toml", 'mode = "slurm"\n[slurm]\nreservation = "course"\npoll_max = 8\n')
    a, b = load_settings(y), load_settings(t)
    assert a == b
    assert a["slurm"]["reservation"] == "course" and a["slurm"]["poll_max"] == 8
    assert a["slurm"]["profiles"], "profiles not named in the file keep their defaults"


def test_relative_paths_resolve_against_the_file_that_sets_them(tmp_path):
    sub = tmp_path / "course"
    sub.mkdir()
    p = write(sub, "c.yaml", "hub:\n  state_dir: state\nlabs:\n  source: ../mylabs\n")
    cfg = load_settings(p)
    assert cfg["hub"]["state_dir"] == str(sub / "state")
    assert cfg["labs"]["source"] == str(tmp_path / "mylabs")


def test_lists_replace_and_mappings_merge():
    merged = deep_merge({"a": {"x": 1, "y": [1, 2]}, "b": 2}, {"a": {"y": [3]}})
    assert merged == {"a": {"x": 1, "y": [3]}, "b": 2}


def test_overrides_win_over_the_file(tmp_path):
    p = write(tmp_path, "c.yaml", "mode: local\n")
    assert load_settings(p, {"mode": "slurm"})["mode"] == "slurm"


def test_env_handover_matches_direct_load(tmp_path):
    p = write(tmp_path, "c.yaml", "hub:\n  port: 9999\n")
    env = {"SCALELAB_HUB_SETTINGS": str(p), "SCALELAB_HUB_OVERRIDES": json.dumps({"mode": "slurm"})}
    cfg = load_settings_from_env(env)
    assert cfg["hub"]["port"] == 9999 and cfg["mode"] == "slurm"


@pytest.mark.parametrize("text, expected", [
    ("mode: slurmm\n", ["mode: 'slurmm' is not valid", "one of ['local', 'slurm']"]),
    ("hub:\n  port: '80'\n", ["hub.port", "type integer"]),
    ("hub:\n  prot: 80\n", ["unknown setting 'prot'", "did you mean 'port'?"]),
    ("slurm:\n  profiles:\n    - {name: x, display_name: X, partition: cpu, walltime: 2h}\n",
     ["slurm.profiles[0].walltime: '2h'", "H:MM:SS", "e.g. '2:00:00'"]),
    ("slurm:\n  profiles:\n    - {name: x, display_name: X, walltime: '1:00:00'}\n",
     ["'partition' is a required property; add it"]),
    ("slurm:\n  profiles:\n    - {name: x, display_name: X, partition: 'cpu\\n#SBATCH --x', walltime: '1:00:00'}\n",
     ["slurm.profiles[0].partition", "a Slurm name"]),
    ("slurm:\n  profiles:\n    - {name: x, display_name: X, partition: cpu, walltime: '1:00:00', memory: 4GB}\n",
     ["memory", "e.g. '4G'"]),
    ("auth:\n  password: short\n", ["auth.password", "8 characters"]),
    ("slurm:\n  default_profile: nope\n", ["slurm.default_profile: 'nope' is not one of the profiles"]),
    ("servers:\n  home: /srv/homes\n", ["servers.home", "{username}"]),
])
def test_mistakes_name_the_setting_and_the_fix(tmp_path, text, expected):
    p = write(tmp_path, "bad.yaml", text)
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    for part in expected:
        assert part in str(e.value)
    assert str(p) in str(e.value)
    assert "course_defaults.yaml" in str(e.value), "the message says where every setting is described"


def test_a_course_file_holding_a_password_must_not_be_readable_by_students(tmp_path):
    # The checkout stays readable for students' servers: a password in a 644 course file was theirs to read.
    p = write(tmp_path, "course.yaml", "auth:\n  admin_password: " + "a" * 32 + "\n")
    p.chmod(0o644)
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    assert "auth.admin_password" in str(e.value) and f"chmod 600 {p}" in str(e.value)
    p.chmod(0o600)
    assert load_settings(p)["auth"]["admin_password"] == "a" * 32
    q = write(tmp_path, "open.yaml", "auth:\n  password: ''\n")  # no password in it: readable is fine
    q.chmod(0o644)
    assert load_settings(q)["auth"]["password"] == ""


def test_every_problem_is_listed_at_once(tmp_path):
    p = write(tmp_path, "bad.yaml", "mode: x\nhub:\n  port: -1\n")
    with pytest.raises(SettingsError, match=r"2 problem\(s\)"):
        load_settings(p)


def test_missing_file_and_bad_syntax_say_so(tmp_path):
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "nope.yaml")
    bad = write(tmp_path, "bad.toml", "mode = \n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        read_settings_file(bad)
    other = write(tmp_path, "c.json", "{}")
    with pytest.raises(SettingsError, match=r"\*.yaml or \*.toml"):
        read_settings_file(other)
    top = write(tmp_path, "list.yaml", "- a\n")
    with pytest.raises(SettingsError, match="mapping of sections"):
        read_settings_file(top)
