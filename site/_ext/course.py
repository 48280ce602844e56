"""Sphinx extension of the course site: the `{lab}` role and the local copy of MathJax.

    {lab}`02`    ->  a link "Lab 02: <title>" to that lab's page when the build published it, otherwise the plain
                     text "Lab 02 (not published yet)", so a schedule can name labs that are still being written.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ExtensionError


def lab_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """`{lab}`NN``: a reference to lab NN's page (see the module docstring)."""
    env = inliner.document.settings.env
    key = text.strip()
    info = env.config.course_labs.get(key)
    if info is None:
        return [nodes.emphasis(rawtext, f"Lab {key} (not published yet)")], []
    ref = addnodes.pending_xref(rawtext, refdomain="std", reftype="doc", reftarget="/" + info["doc"],
                                refexplicit=True, refwarn=True)
    ref += nodes.inline(rawtext, f"Lab {key}: {info['title']}")
    return [ref], []


def copy_mathjax(app, exception) -> None:
    """Put MathJax (from the jupyter-server-mathjax package) in _static/mathjax, once per output folder."""
    if exception is not None or app.builder.format != "html":
        return
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise ExtensionError("the course site serves MathJax itself and needs the jupyter-server-mathjax package: "
                             "pip install jupyter-server-mathjax (it is in scalelab's dev extra)") from None
    source = Path(jupyter_server_mathjax.__file__).parent / "static"
    target = Path(app.outdir) / "_static" / "mathjax"
    if not (target / "MathJax.js").is_file():
        # English is built into MathJax.js: the other languages (2 MB) are left out.
        shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("localization"))


def setup(app):
    """Register the role, its configuration value and the MathJax copy."""
    app.add_config_value("course_labs", {}, "env", types=frozenset({dict}))
    app.add_role("lab", lab_role)
    app.connect("build-finished", copy_mathjax)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
