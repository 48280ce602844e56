"""The course hub: what `hub_config/jupyterhub_config.py` and `scalelab hub` are made of.

- `settings`   the course settings file: defaults + course file (YAML/TOML) + overrides, schema-checked
- `config`     settings applied to a JupyterHub config, one `update_*(c, cfg)` per concern
- `options`    course profiles and the bounds on what a student may ask for; the spawn form
- `batch`      the Slurm batch script, a pure function of the resolved request
- `course_spawner`, `local_spawner`, `slurm_spawner`   the spawners (homes, labs, Slurm lifecycle, fixes)
- `api`        the safe replacement of batchspawner's port callback; a size bound on server requests
- `posture`    who servers run as and who signs in: `run_as: auto`, unsafe combinations refused, `--check`'s table
- `authenticator`  shared-password sign-in with throttling
- `singleuser` the job-side wrapper that reports the port and starts JupyterLab
- `tensorboard_proxy`  TensorBoard in JupyterLab through jupyter-server-proxy, on a private Unix socket (no TCP port)
- `provision`  handing the labs out without overwriting a student's work
- `kernels`    the course kernel specs in kernels/
- `auth`, `culler`   passwords, the idle culler service

`scalelab hub` itself is `scalelab.cli.hub`; a real hub for tests is `scalelab.testing.hub`.

Nothing here is imported by the core library.
"""
