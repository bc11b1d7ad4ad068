"""`make site`: the course website builds from the stored outputs with warnings as errors, every internal link
resolves, no page loads anything from another host, and its generated pages hold what they promise."""

import importlib.util
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from labkit.claims_report import collect

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("myst_nb") is None,
                                reason="the docs extra is not installed: make setup (or pip install -e '.[docs]')")


def site_builder():
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["site_build"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    assert site_builder().build(out, warnings_as_errors=True) == 0, "the build has warnings or errors (see above)"
    return out / "html"


class Page(HTMLParser):
    """The ids a page defines and the addresses it links to or loads."""

    def __init__(self):
        super().__init__()
        self.ids, self.links, self.loads = set(), [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        for name in ("src",) + (("href",) if tag == "link" else ()):
            if attrs.get(name):
                self.loads.append(attrs[name])


def parse(path):
    page = Page()
    page.feed(path.read_text())
    return page


def test_every_notebook_is_a_page_in_course_order_with_the_glossary_and_the_generated_pages(site):
    landing = (site / "index.html").read_text()
    for page in ["notebooks/GLOSSARY.html", "troubleshooting.html", "cases.html", "search.html"]:
        assert (site / page).exists(), page
    positions = [landing.find(f'href="notebooks/{path.stem}.html"') for path in NOTEBOOKS]
    assert -1 not in positions and positions == sorted(positions), "the sidebar lists every notebook, in order"
    assert "The learner" in landing and "Who it is for" in landing


def test_every_internal_link_resolves_to_a_page_and_an_anchor(site):
    # the theme's template snippets under _static are not pages
    pages = {path: parse(path) for path in site.rglob("*.html") if "_static" not in path.relative_to(site).parts}
    broken, checked = [], 0
    for path, page in pages.items():
        for link in page.links + page.loads:
            parts = urlsplit(link)
            if parts.scheme or link.startswith(("mailto:", "//", "javascript:")):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            checked += 1
            if not target.exists():
                broken.append(f"{path.relative_to(site)} -> {link}")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{path.relative_to(site)} -> {link} (no such anchor)")
    assert checked > 500, "the walk found too few links to mean anything"
    assert broken == []


def test_no_page_loads_anything_from_another_host(site):
    # offline and self-hosted: scripts, styles, images and fonts come from the site (links to elsewhere are fine)
    remote = {f"{path.relative_to(site)}: {load}" for path in site.rglob("*.html") for load in parse(path).loads
              if urlsplit(load).scheme in ("http", "https") or load.startswith("//")}
    assert remote == set()
    assert (site / "_static" / "mathjax" / "tex-chtml.js").exists(), "MathJax is served from the site, not a CDN"


def test_each_notebook_page_says_how_to_run_it_and_shows_its_figures(site):
    for path in NOTEBOOKS:
        page = (site / "notebooks" / f"{path.stem}.html").read_text()
        assert "Run this notebook" in page and "lab-student" in page, path.stem
        assert "mybinder.org/v2/gh/" in page and "colab.research.google.com/github/" in page, path.stem
    assert (site / "notebooks" / "08_gradient_health.html").read_text().count("<img") >= 2


def test_an_explorer_is_a_sentence_and_its_figure_never_an_empty_box(site):
    for stem in ["00_start_here", "04_autograd_modes", "12_batch_size"]:
        page = (site / "notebooks" / f"{stem}.html").read_text()
        assert "widget-view" not in page, f"{stem}: an empty widget area"
        sentence = page.find('class="explorer-static"')
        assert sentence != -1, f"{stem}: no sentence where the explorer was"
        assert "run the notebook" in page[sentence:sentence + 600]
        assert "<img" in page[sentence:sentence + 200_000], f"{stem}: no figure after the explorer's sentence"


def test_the_case_catalogue_gives_every_stored_verdict(site):
    page = (site / "cases.html").read_text()
    records = collect([ROOT / "notebooks"])
    assert len(records) > 50
    for record in records:
        heading = re.search(rf'<h3>{re.escape(record["id"])}: {re.escape(record["verdict"])}<a', page)
        assert heading, f"{record['id']} ({record['verdict']}) is missing from cases.html"


def test_the_build_writes_only_where_it_is_told(tmp_path):
    builder = site_builder()
    with pytest.raises(SystemExit, match="writes only under site/_build"):
        builder.build(ROOT / "notebooks")
