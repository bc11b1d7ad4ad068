"""Sphinx configuration of the course website (`make site`; site/build.py lays out the sources it reads).

Pages come from the notebooks' stored outputs: nothing executes. Everything the pages load is served from
the site itself (the theme's assets, MathJax from sphinx-mathjax-offline), so the site works offline.
"""

project = "Gradient Lab"
author = "the Gradient Lab authors"
copyright = "2026, the Gradient Lab authors"  # noqa: A001 (Sphinx's name)

extensions = ["myst_nb", "sphinx-mathjax-offline"]  # the latter: MathJax copied into _static, no CDN
nb_execution_mode = "off"  # the stored outputs are the course's; a build never runs a notebook
myst_heading_anchors = 3  # the notebooks link GLOSSARY.md#saved-tensor-style anchors
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
# mystnb.unknown_mime_type: labkit's own MIME types (application/vnd.labkit.claim/metric/grade+json) each
# come with a text/html or text/plain twin, which the page shows; myst-nb warns of the JSON it skips.
# myst.header: the glossary puts its ### entries straight under its # title, which the notebooks' links use.
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]

html_theme = "sphinx_book_theme"
html_title = "Gradient Lab"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "home_page_in_toc": True,
}
html_copy_source = False  # the .ipynb copies would double the site's size; the repository has them
html_show_sourcelink = False
exclude_patterns = ["**/.ipynb_checkpoints"]
