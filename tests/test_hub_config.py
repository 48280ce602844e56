"""Each update_*(c, cfg) against a bare traitlets Config(): the hub gets exactly the settings' meaning."""
from __future__ import annotations

import os
import sys

import pytest
from traitlets.config import Config

from scalelab.hub import config as hubconf
from scalelab.hub.settings import load_settings

PASSWORDS = {"user": "user-password", "admin": None}


@pytest.fixture
def cfg(tmp_path):
    labs = tmp_path / "labs"
    (labs / "01_x").mkdir(parents=True)
    p = tmp_path / "c.yaml"
    # hub-account, allowed as root: these tests are about the config, not about who runs servers (test_hub_posture)
    p.write_text(f"hub:\n  state_dir: {tmp_path / 'state'}\nlabs:\n  source: {labs}\n"
                 "servers:\n  run_as: hub-account\n  allow_root_servers: true\nauth:\n  any_name: true\n")
    return load_settings(p)


def slurm_cfg(cfg, **slurm):
    cfg = dict(cfg, mode="slurm")
    cfg["slurm"] = {**cfg["slurm"], **slurm}
    return cfg


def test_update_hub_binds_loopback_and_keeps_state_in_state_dir(cfg, tmp_path):
    c = Config()
    hubconf.update_hub(c, cfg)
    state = tmp_path / "state"
    assert c.JupyterHub.ip == "127.0.0.1" and c.JupyterHub.hub_ip == "127.0.0.1"
    assert c.JupyterHub.db_url == f"sqlite:///{state / 'jupyterhub.sqlite'}"
    assert c.JupyterHub.cookie_secret_file == str(state / "jupyterhub_cookie_secret")
    assert c.ConfigurableHTTPProxy.api_url == "http://127.0.0.1:8001"
    assert c.JupyterHub.cleanup_servers is False, "a hub restart must leave servers running"
    assert c.JupyterHub.allow_named_servers is True and c.JupyterHub.named_server_limit_per_user == 3
    assert "hub_connect_ip" not in c.JupyterHub
    assert c.LocalProcessSpawner.interrupt_timeout == 3


def test_update_hub_uses_the_proxy_beside_the_course_python(cfg, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "configurable-http-proxy").write_text("#!/bin/sh\n")
    cfg["servers"]["python_bin"] = str(bindir)
    c = Config()
    hubconf.update_hub(c, cfg)
    assert c.ConfigurableHTTPProxy.command == [str(bindir / "configurable-http-proxy")]


def test_update_auth_shared_password_allows_anyone_with_it(cfg):
    c = Config()
    hubconf.update_auth(c, cfg, PASSWORDS)
    assert c.JupyterHub.authenticator_class == hubconf.AUTHENTICATOR  # shared password, throttled
    assert {"root", "nobody"} <= c.Authenticator.blocked_users
    assert c.SharedPasswordAuthenticator.user_password == "user-password"
    assert "admin_password" not in c.SharedPasswordAuthenticator
    assert c.Authenticator.allow_all is True
    assert c.Authenticator.username_pattern == hubconf.USERNAME_PATTERN


def test_update_auth_admins_and_allowed_users(cfg):
    cfg["hub"]["admin_users"] = ["prof"]
    cfg["auth"]["allowed_users"] = ["ann", "bob"]
    c = Config()
    hubconf.update_auth(c, cfg, {"user": "u" * 8, "admin": "a" * 32})
    assert c.Authenticator.admin_users == {"prof"}
    assert c.Authenticator.allowed_users == {"ann", "bob"}
    assert "allow_all" not in c.Authenticator
    assert c.SharedPasswordAuthenticator.admin_password == "a" * 32
    # the list is the whole gate: not every user of the hub's database (JupyterHub's allow_existing_users)
    assert c.Authenticator.allow_existing_users is False
    assert c.CourseSharedPasswordAuthenticator.class_list == {"ann", "bob", "prof"}


def test_update_auth_pam(cfg):
    cfg["auth"]["type"] = "pam"
    c = Config()
    hubconf.update_auth(c, cfg, PASSWORDS)
    assert c.JupyterHub.authenticator_class == "pam"
    assert "SharedPasswordAuthenticator" not in c


def test_update_servers_absolute_command_and_explicit_environment(cfg, tmp_path):
    c = Config()
    hubconf.update_servers(c, cfg)
    bindir = os.path.dirname(sys.executable)
    assert c.Spawner.cmd == [os.path.join(bindir, "jupyterhub-singleuser")]
    assert c.Spawner.env_keep == [], "nothing of the hub's environment leaks into servers"
    assert c.Spawner.environment["PATH"].split(":")[0] == bindir
    assert c.Spawner.default_url == "/lab"
    assert c.CourseSpawner.home_template == f"{tmp_path / 'state'}/homes/{{username}}"
    assert c.CourseSpawner.run_as == "hub-account"


def test_update_servers_slurm_puts_slurm_bin_on_path(cfg):
    c = Config()
    hubconf.update_servers(c, slurm_cfg(cfg, bin_dir="/opt/slurm/bin"))
    assert "/opt/slurm/bin" in c.Spawner.environment["PATH"].split(":")


def test_update_local_spawner(cfg):
    c = Config()
    hubconf.update_local_spawner(c, cfg)
    assert c.JupyterHub.spawner_class == hubconf.LOCAL_SPAWNER
    assert c.CourseLocalSpawner.ip == "127.0.0.1"
    assert c.CourseLocalSpawner.cmd[1:4] == ["-m", "scalelab.hub.singleuser", "--no-report"]
    assert c.CourseLocalSpawner.cmd[-1].endswith("/jupyterhub-singleuser")


def test_update_slurm_spawner_profiles_carry_course_account_and_reservation(cfg):
    c = Config()
    hubconf.update_slurm_spawner(c, slurm_cfg(cfg, account="proj1", reservation="course", conf="/etc/s.conf"))
    s = c.CourseSlurmSpawner
    assert c.JupyterHub.spawner_class == hubconf.SLURM_SPAWNER
    assert {p["reservation"] for p in s.profiles} == {"course"}
    assert {p["account"] for p in s.profiles} == {"proj1"}
    assert s.slurm_conf == "/etc/s.conf" and s.slurm_bin_dir == "/usr/bin"
    assert s.exec_prefix == "", "hub-account: Slurm commands run as the hub's account"
    assert s.poll_min == 0.5 and s.poll_max == 5.0
    assert s.singleuser_wrapper[1:] == ["-m", "scalelab.hub.singleuser"] and os.path.isabs(s.singleuser_wrapper[0])


def test_exec_prefix_sudo_for_student_accounts(cfg):
    cfg = slurm_cfg(cfg)
    cfg["servers"]["run_as"] = "student-accounts"
    assert hubconf.exec_prefix(cfg) == "sudo -E -u {username}"
    cfg["slurm"]["exec_prefix"] = "/usr/local/bin/slurm-as {username}"
    assert hubconf.exec_prefix(cfg) == "/usr/local/bin/slurm-as {username}"


def test_update_labs(cfg, tmp_path):
    c = Config()
    hubconf.update_labs(c, cfg)
    assert c.CourseSpawner.labs_source == str(tmp_path / "labs")
    assert c.CourseSpawner.labs_dest == "labs"
    assert "CourseSlurmSpawner" not in c
    c = Config()
    hubconf.update_labs(c, slurm_cfg(cfg))
    assert c.CourseSlurmSpawner.labs_where == "hub"


def test_update_labs_without_a_labs_folder_hands_out_nothing(cfg, tmp_path):
    cfg["labs"]["source"] = str(tmp_path / "missing")
    c = Config()
    hubconf.update_labs(c, cfg)
    assert c.CourseSpawner.labs_source == str(tmp_path / "missing")  # explicit: kept, provisioning skips it


def test_update_culler_is_a_managed_service_with_minimal_scopes(cfg):
    c = Config()
    c.JupyterHub.services = [{"name": "other", "url": "http://x"}]
    hubconf.update_culler(c, cfg)
    names = [s["name"] for s in c.JupyterHub.services]
    assert names == ["other", "idle-culler"]
    cmd = c.JupyterHub.services[1]["command"]
    assert cmd[:3] == [sys.executable, "-m", "scalelab.hub.culler"] and "--timeout=3600" in cmd
    role = c.JupyterHub.load_roles[-1]
    assert role["services"] == ["idle-culler"] and "admin:users" not in role["scopes"]
    hubconf.update_culler(c, cfg)
    assert [s["name"] for s in c.JupyterHub.services] == ["other", "idle-culler"], "idempotent"


def test_culler_off(cfg):
    cfg["culler"]["enabled"] = False
    c = Config()
    hubconf.update_culler(c, cfg)
    assert "services" not in c.JupyterHub


def test_apply_settings_generates_and_keeps_a_password(cfg, tmp_path):
    c1, c2 = Config(), Config()
    hubconf.apply_settings(c1, cfg)
    hubconf.apply_settings(c2, cfg)
    pw = c1.SharedPasswordAuthenticator.user_password
    assert len(pw) >= 8 and pw == c2.SharedPasswordAuthenticator.user_password
    assert (tmp_path / "state" / "password").stat().st_mode & 0o777 == 0o600


def test_each_listed_student_gets_a_password_of_their_own_kept_across_restarts(cfg, tmp_path):
    roster = tmp_path / "class.csv"
    roster.write_text("name,password\nann,ann-own-pass-1\n")
    cfg["auth"].update(allowed_users=["ann", "bob", "cy", "prof"], roster=str(roster))
    cfg["hub"]["admin_users"] = ["prof"]
    c1, c2 = Config(), Config()
    hubconf.apply_settings(c1, cfg)
    hubconf.apply_settings(c2, cfg)
    own = c1.CourseSharedPasswordAuthenticator.roster_passwords
    assert set(own) == {"ann", "bob", "cy"} and own["ann"] == "ann-own-pass-1"  # the admin keeps the admin password
    assert own == c2.CourseSharedPasswordAuthenticator.roster_passwords  # a restart locks nobody out
    assert len({own["bob"], own["cy"], c1.SharedPasswordAuthenticator.user_password}) == 3
    kept = tmp_path / "state" / "student_passwords.csv"
    assert kept.stat().st_mode & 0o777 == 0o600 and "ann" not in kept.read_text()  # the roster's is not copied
    cfg["auth"]["allowed_users"].append("dee")  # a student added later gets one; the others keep theirs
    c3 = Config()
    hubconf.apply_settings(c3, cfg)
    assert {k: v for k, v in c3.CourseSharedPasswordAuthenticator.roster_passwords.items() if k != "dee"} == own
    cfg["auth"]["per_student_passwords"] = False  # the try-out choice: one password for all, said at start
    c4 = Config()
    hubconf.apply_settings(c4, cfg)
    assert set(c4.CourseSharedPasswordAuthenticator.roster_passwords) == {"ann"}
    from scalelab.hub.posture import warnings
    assert any("any student can sign in as any classmate" in w for w in warnings(cfg))


def test_config_d_files_run_in_order(cfg, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "10-a.py").write_text("c.JupyterHub.port = 1\n")
    (d / "20-b.py").write_text("c.JupyterHub.port = c.JupyterHub.port + 1\nc.X.mode = cfg['mode']\n")
    cfg["hub"]["config_d"] = str(d)
    c = Config()
    assert hubconf.load_config_d(c, cfg) == [str(d / "10-a.py"), str(d / "20-b.py")]
    assert c.JupyterHub.port == 2 and c.X.mode == "local"


def test_jupyterhub_config_file_loads_with_a_bare_config(tmp_path, monkeypatch, cfg):
    p = tmp_path / "c2.yaml"
    p.write_text(f"mode: slurm\nhub:\n  state_dir: {tmp_path / 'st'}\nauth:\n  allowed_users: [ann, bob]\n")
    monkeypatch.setenv("SCALELAB_HUB_SETTINGS", str(p))
    c = Config()
    code = (hubconf.Path(__file__).resolve().parent.parent / "hub_config" / "jupyterhub_config.py").read_text()
    exec(compile(code, "jupyterhub_config.py", "exec"), {"get_config": lambda: c})
    assert c.JupyterHub.spawner_class == hubconf.SLURM_SPAWNER
    assert c.CourseSlurmSpawner.default_profile == "cpu-2h"
    # run_as auto: course accounts on a root hub, the hub's account otherwise; never students' code as root
    assert c.CourseSpawner.run_as == ("student-accounts" if os.geteuid() == 0 else "hub-account")


def test_subdomains_give_each_server_its_own_origin_and_their_absence_is_said(cfg):
    from scalelab.hub.posture import warnings
    cfg["hub"]["ip"] = "0.0.0.0"
    cfg["auth"].update(any_name=False, allowed_users=["ann", "bob"])
    said = [w for w in warnings(cfg) if w.startswith("hub.subdomain_host")]
    assert said and "Subdomains add what one address cannot" in said[0]  # serving the network, one address: said
    assert "an instructor included" in said[0] and "run sandboxed" in said[0]
    c = Config()
    hubconf.update_hub(c, cfg)  # one origin: a student's own server config never loads
    assert c.Spawner.disable_user_config is True
    cfg["hub"]["subdomain_host"] = "https://hub.example.org"
    c = Config()
    hubconf.update_hub(c, cfg)
    assert c.JupyterHub.subdomain_host == "https://hub.example.org" and c.JupyterHub.cookie_host_prefix_enabled
    assert not [w for w in warnings(cfg) if w.startswith("hub.subdomain_host")]
    cfg["hub"].update(subdomain_host="", ip="127.0.0.1")  # the laptop default: nothing to say
    assert not [w for w in warnings(cfg) if w.startswith("hub.subdomain_host")]
