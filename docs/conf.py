"""Sphinx configuration: the documentation site, built from the Markdown pages of ``docs/``.

``sphinx-build -W --keep-going -b html docs OUT`` (what ``.ci/run`` runs) builds it
with every warning an error. MyST reads the Markdown; autodoc reads the public
API's docstrings from this tree (``api.md``). No intersphinx: the build reaches
no network.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sphinx.application import Sphinx

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


# Napoleon reads an attribute docstring's first "X: Y" as
# "type X, description Y". Ours never give a type there (the annotation does), so
# "Default ring depth per group and node: ..." rendered as a type. The docstring is
# kept before napoleon runs (priority 499; napoleon's is 500) and put back after it
# (501): attributes, constants and properties read as written, everything else gets
# napoleon's Google style.
_ATTRIBUTE_KINDS = frozenset({"attribute", "data", "property"})
_as_written: dict[int, list[str]] = {}


def _keep(
    app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    if what in _ATTRIBUTE_KINDS:
        _as_written[id(lines)] = list(lines)


def _put_back(
    app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    if id(lines) in _as_written:
        lines[:] = _as_written.pop(id(lines))


def setup(app: Sphinx) -> None:
    app.connect("autodoc-process-docstring", _keep, priority=499)
    app.connect("autodoc-process-docstring", _put_back, priority=501)
