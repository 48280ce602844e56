"""Sphinx configuration of the course website.

Built by `scalelab site build` (scalelab/site_build.py), which stages this folder together with the executed lab
pages into build/site/src and runs sphinx-build there: do not run sphinx-build on site/ itself.

Everything the pages need is served from the site itself (theme assets, MathJax from the jupyter-server-mathjax
package): the build fetches nothing and the pages load nothing from the internet.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "scalelab"
author = "the scalelab course team"
copyright = "the scalelab course team, BSD-3-Clause"
html_title = "Distributed deep learning on HPC"

extensions = ["myst_nb", "course"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_student", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

# The lab pages are executed by scalelab site build (cached per lab); Sphinx only renders them.
nb_execution_mode = "off"
nb_output_stderr = "show"
nb_merge_streams = True
nb_ipywidgets_js = {}  # widget views are reduced to their text by the build; never load widget JS from a CDN
myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath", "deflist", "attrs_inline"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # a lab may go from # to ### (title, then an exercise); that is fine here

# Labs published in this build (written by scalelab site build): what the {lab}`NN` role links to.
_labs_file = HERE / "_labs.json"
course_labs = json.loads(_labs_file.read_text()) if _labs_file.is_file() else {}

html_theme = "pydata_sphinx_theme"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = "%Y-%m-%d"
html_theme_options = {
    "navbar_align": "left",
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "show_prev_next": True,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["last-updated"],
    "icon_links": [],
}
html_sidebars = {"index": [], "schedule": [], "setup": []}
html_favicon = "_static/favicon.svg"

# Math: MathJax 2 from the jupyter-server-mathjax package, copied into _static/mathjax by the course extension. SVG
# output draws glyphs from its own font data (the package ships STIX-Web only), so no web font is ever fetched.
# MyST marks each page "tex2jax_ignore" and its math "math"/"mathjax_process"; myst-parser only updates MathJax 3/4
# configurations, so its update is switched off and tex2jax is told here.
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
myst_update_mathjax = False
mathjax2_config = {
    "tex2jax": {"processClass": "tex2jax_process|mathjax_process|math|output_area"},
    "HTML-CSS": {"availableFonts": ["STIX-Web"], "preferredFont": "STIX-Web", "webFont": "STIX-Web"},
    "showMathMenu": False,
    "messageStyle": "none",
}
