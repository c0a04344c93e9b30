"""Sphinx configuration: the documentation site, built from the Markdown pages of ``docs/``.

``sphinx-build -W --keep-going -b html docs OUT`` (what ``.ci/run`` runs) builds it
with every warning an error. MyST reads the Markdown; autodoc reads the public
API's docstrings from this tree (``api.md``). No intersphinx: the build reaches
no network.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This tree's package and daemon, not an installed copy.
sys.path[:0] = [str(REPO), str(REPO / "daemon")]

import shmloader  # noqa: E402

project = "shmloader"
author = "the shmloader authors"
copyright = "2026, the shmloader authors"
release = version = shmloader.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# "#checkpoints" and "#shmloader-stat" links: anchors for headings down to ###.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

try:
    import furo  # noqa: F401

    html_theme = "furo"
except ImportError:  # the theme is a docs extra; alabaster ships with Sphinx
    html_theme = "alabaster"
html_title = f"shmloader {release}"
