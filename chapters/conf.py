"""Sphinx configuration: the chapters as a website (a book), built offline from the
package index's tools alone (Sphinx, myst-parser, sphinx-book-theme: the `docs` extra).

    pip install ".[docs]"
    sphinx-build -W -b html chapters chapters/_build/html    # then open chapters/_build/html/index.html

The chapters stay plain MyST Markdown that also reads on GitHub; this file only says how to
render them. Quoted code (literalinclude) is read from csrc/ and kvlab/ at build time, and
the figures from chapters/figures/, so the site always shows the code as it is."""
project = "Making inference cheap: KV cache, batching and quantization"
author = "the kvlab team"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Only the chapters are pages: not the figure scripts' folder, not the build itself.
exclude_patterns = ["_build", "figures/__pycache__", "README.md"]

# No MyST extensions: the chapters use only what GitHub's Markdown view also shows (no $math$,
# which would load MathJax from the internet).
myst_enable_extensions = []
# "[section](05_batching.md#53-what-batching-buys)" links resolve to headings' anchors
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "Making inference cheap"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
# No fonts, scripts or pages from the internet: the book builds and reads offline.
html_static_path = []
html_last_updated_fmt = None
