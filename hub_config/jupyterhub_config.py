"""JupyterHub configuration of the scalelab course hub: everything comes from one course settings file.

Start it with `scalelab hub [--config FILE] [--mode local|slurm]` (what `make hub` runs): that checks the
settings, starts the local Slurm when asked, prints the login password, and runs JupyterHub with this file.
Started by hand (`jupyterhub -f hub_config/jupyterhub_config.py`), it reads $SCALELAB_HUB_SETTINGS, else
hub_config/course.yaml. What each setting does: hub_config/course_defaults.yaml; how it is applied:
scalelab/hub/config.py (one small update_* function per concern); site extras: jupyterhub_config.d/*.py.
"""
from scalelab.hub.config import apply_settings, load_config_d
from scalelab.hub.settings import load_settings_from_env

c = get_config()  # noqa: F821  (provided by JupyterHub when it loads this file)
cfg = load_settings_from_env()
apply_settings(c, cfg)
load_config_d(c, cfg)
