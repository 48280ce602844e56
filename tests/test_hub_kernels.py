"""The course kernel: this environment's Python with the distributed settings preset, installed where servers look."""
from __future__ import annotations

import json
import sys

import pytest

from scalelab.errors import SetupError
from scalelab.hub.kernels import install_kernels, kernel_names, kernel_spec


def test_the_course_kernel_is_shipped():
    assert "scalelab" in kernel_names()


def test_local_preset_runs_ranks_over_loopback():
    spec = kernel_spec("scalelab", "local")
    assert spec["argv"][0] == sys.executable and "{connection_file}" in spec["argv"]
    assert spec["env"]["GLOO_SOCKET_IFNAME"] == "lo" and spec["env"]["OMP_NUM_THREADS"] == "1"


def test_cluster_preset_leaves_the_network_to_the_site():
    spec = kernel_spec("scalelab", "cluster", python="/site/env/bin/python")
    assert spec["argv"][0] == "/site/env/bin/python"
    assert "GLOO_SOCKET_IFNAME" not in spec["env"] and spec["env"]["OMP_NUM_THREADS"] == "1"


def test_unknown_preset():
    with pytest.raises(SetupError, match="unknown"):
        kernel_spec("scalelab", "laptop")


def test_install_into_a_prefix_is_found_by_jupyter(tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager

    paths = install_kernels("local", prefix=str(tmp_path))
    assert [p.name for p in paths] == ["scalelab"]
    installed = tmp_path / "share/jupyter/kernels/scalelab"
    assert json.loads((installed / "kernel.json").read_text())["env"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert not (installed / "presets.json").exists()
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "share/jupyter/kernels")])
    assert ksm.get_kernel_spec("scalelab").display_name == "Python 3 (scalelab course)"


def test_cli_install(tmp_path, capsys):
    from scalelab.cli import main

    assert main(["kernels", "install", "--prefix", str(tmp_path), "--preset", "cluster"]) == 0
    assert "installed kernel scalelab (cluster)" in capsys.readouterr().out
