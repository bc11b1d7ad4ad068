"""The course website in headless Chromium (make test-browser): the landing page and two notebook pages load
with every figure, nothing is fetched from another host, and the search finds a case by its ID."""

import functools
import importlib.util
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from headless_chromium import chromium_context

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(importlib.util.find_spec("myst_nb") is None,
                                 reason="the docs extra is not installed: make setup (or pip install -e '.[docs]')")]
SEARCH_S = 30


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url(tmp_path_factory):
    """The site built into a temporary folder and served on a free local port."""
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "site" / "build.py")
    builder = importlib.util.module_from_spec(spec)
    sys.modules["site_build"] = builder
    spec.loader.exec_module(builder)
    out = tmp_path_factory.mktemp("site")
    assert builder.build(out) == 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(out / "html")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    with chromium_context(chromium, tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def open_page(browser, url):
    """The page loaded, and every host it requested."""
    page = browser.new_page()
    hosts = []
    page.on("request", lambda request: hosts.append(urlsplit(request.url).hostname))
    response = page.goto(url, wait_until="load")
    assert response is not None and response.ok, url
    return page, hosts


@pytest.mark.parametrize("path", ["index.html", "notebooks/00_start_here.html", "notebooks/08_gradient_health.html"])
def test_a_page_loads_its_figures_from_the_site_alone(browser, site_url, path):
    page, hosts = open_page(browser, f"{site_url}/{path}")
    try:
        assert set(hosts) <= {"127.0.0.1"}, f"{path} fetched from {set(hosts) - {'127.0.0.1'}}"
        images = page.evaluate("() => [...document.images].map(i => [i.complete && i.naturalWidth > 0, i.alt])")
        if path != "index.html":
            assert len(images) >= 2, f"{path}: the stored figures are missing"
            assert all(alt for _, alt in images), f"{path}: a figure without alt text"
        assert all(loaded for loaded, _ in images), f"{path}: a figure did not load"
        assert "Gradient Lab" in page.title()
    finally:
        page.close()


def test_the_search_finds_a_case_by_its_id(browser, site_url):
    page, _ = open_page(browser, f"{site_url}/search.html?q=B7")
    try:
        found = page.locator("#search-results a[href*='cases.html']")
        found.first.wait_for(timeout=SEARCH_S * 1000)
        assert found.count() >= 1
    finally:
        page.close()
