"""Sphinx configuration for the trio_encode documentation site (``nox -s docs``).

The build is offline: no intersphinx inventories, no remote assets, diagrams are SVG files in
``docs/img``. The Markdown pages of ``docs/`` are pages of the site as they are (myst-parser);
the API, settings and CLI references are generated from the package itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))

from trio_encode import __version__  # noqa: E402

project = "trio_encode"
author = "trio_encode developers"
copyright = "trio_encode developers"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx_click",
    "settings_catalog",
    "python_refs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Headings get anchors so the pages' own "#section" links resolve.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The Mooncake wheel needs libibverbs and a CUDA-less build; the docs need neither.
autodoc_mock_imports = ["mooncake", "transformers"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# A size setting shows as its alias, not as the validators and serializer it carries.
autodoc_type_aliases = {"ByteSize": "trio_encode.sizes.ByteSize"}
autodoc_default_options = {"members": True, "show-inheritance": True}

html_theme = "furo"
html_title = f"trio_encode {__version__}"
html_static_path: list[str] = []
# Text as written: "--flag" stays two hyphens, quotes stay as the help texts have them.
smartquotes = False
