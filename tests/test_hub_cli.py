"""`scalelab hub` and `scalelab kernels install`: the CLI surface, what it prepares, and what it runs."""
from __future__ import annotations

import json

import pytest

from scalelab.cli import build_parser, main
from scalelab.errors import SetupError
from scalelab.cli import hub as hubcli
from scalelab.hub.settings import load_settings


def test_cli_surface():
    p = build_parser()
    args = p.parse_args(["hub", "--config", "x.yaml", "--mode", "slurm", "--check"])
    assert (args.config, args.mode, args.check, args.func) == ("x.yaml", "slurm", True, hubcli.run_hub)
    args = p.parse_args(["kernels", "install", "--preset", "cluster", "--user"])
    assert (args.preset, args.user, args.prefix, args.func) == ("cluster", True, None, hubcli.run_kernels_install)
    with pytest.raises(SystemExit):
        p.parse_args(["hub", "--mode", "kubernetes"])


def test_default_is_the_local_mode_from_the_shipped_course_file(capsys):
    assert main(["hub", "--check"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["mode"] == "local" and cfg["hub"]["ip"] == "127.0.0.1"


def test_mode_flag_overrides_the_file(capsys):
    assert main(["hub", "--check", "--mode", "slurm"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "slurm"


def test_bad_settings_exit_1_with_the_fix(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("hub:\n  prot: 1\n")
    assert main(["hub", "--config", str(bad), "--check"]) == 1
    err = capsys.readouterr().err
    assert "unknown setting 'prot' (did you mean 'port'?)" in err


def test_an_unsafe_posture_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"hub:\n  state_dir: {tmp_path / 'state'}\nservers:\n  run_as: student-accounts\n")
    monkeypatch.setattr(hubcli, "_preflight", lambda cfg: None)
    monkeypatch.setattr(hubcli.os, "execve", lambda *a: pytest.fail("the hub must not start"))
    assert main(["hub", "--config", str(cfg)]) == 1
    assert "sign in as any existing Unix account" in capsys.readouterr().err
    assert main(["hub", "--config", str(cfg), "--check"]) == 1
    assert "UNSAFE: auth.type: shared-password" in capsys.readouterr().err


class FakeCluster:
    started = 0

    def __init__(self, *a, **kw):
        pass

    def up(self):
        FakeCluster.started += 1
        return self

    def env(self):
        return {"SLURM_CONF": "/state/slurm.conf"}


def test_slurm_on_one_machine_starts_the_local_cluster(monkeypatch):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setattr(hubcli.Path, "exists", lambda self: False if str(self) == "/etc/slurm/slurm.conf"
                        else True)
    monkeypatch.setattr("scalelab.cluster.local.LocalCluster", FakeCluster)
    over, cluster = hubcli.slurm_overrides(load_settings(overrides={"mode": "slurm"}))
    assert isinstance(cluster, FakeCluster) and FakeCluster.started == 1
    assert over == {"slurm": {"conf": "/state/slurm.conf", "server_ip": "127.0.0.1", "node_address": "127.0.0.1"}}


def test_slurm_uses_the_configured_or_exported_cluster(monkeypatch):
    monkeypatch.setattr("scalelab.cluster.local.LocalCluster", None)  # must not be touched
    cfg = load_settings(overrides={"mode": "slurm", "slurm": {"conf": "/site/slurm.conf"}})
    assert hubcli.slurm_overrides(cfg) == ({}, None)
    monkeypatch.setenv("SLURM_CONF", "/exported/slurm.conf")
    cfg = load_settings(overrides={"mode": "slurm"})
    assert hubcli.slurm_overrides(cfg) == ({"slurm": {"conf": "/exported/slurm.conf"}}, None)


def test_missing_proxy_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("scalelab.hub.config.find_proxy", lambda cfg: None)
    with pytest.raises(SetupError, match="make hub"):
        hubcli._preflight(load_settings())


def test_run_hub_prints_how_to_log_in_and_execs_jupyterhub(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"hub:\n  state_dir: {tmp_path / 'state'}\n  port: 8123\nauth:\n  allowed_users: [ann, bob]\n")
    installed, execd = [], {}
    monkeypatch.setattr("scalelab.hub.kernels.install_kernels", lambda preset: installed.append(preset))
    monkeypatch.setattr(hubcli, "_preflight", lambda cfg: None)
    monkeypatch.setattr(hubcli.os, "execve", lambda exe, argv, env: execd.update(argv=argv, env=env))
    monkeypatch.chdir(tmp_path)
    assert main(["hub", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    password = (tmp_path / "state" / "password").read_text().strip()
    kept = tmp_path / "state" / "student_passwords.csv"
    assert "http://127.0.0.1:8123/" in out and f"as one of ann, bob, each with a password of their own: {kept}" in out
    own = dict(line.split(",") for line in kept.read_text().splitlines())
    assert set(own) == {"ann", "bob"} and password not in out and not any(pw in out for pw in own.values())
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert installed == ["local"]
    assert execd["argv"][1:4] == ["-m", "jupyterhub", "-f"] and execd["argv"][4].endswith("jupyterhub_config.py")
    assert execd["env"]["SCALELAB_HUB_SETTINGS"] == str(cfg)
    assert json.loads(execd["env"]["SCALELAB_HUB_OVERRIDES"]) == {}
