"""The browser tests: their marker, and where headless Chromium and Playwright come from.

`make test-browser` installs Debian's chromium when it is missing (as root); Playwright is a dev pin.
Where either cannot be had the tests skip with the reason, unless LABKIT_REQUIRE_BROWSER=1 (CI sets
it), which turns that skip into a failure so a CI run cannot go green without the browser.
"""

import importlib.util
import os
import shutil

import pytest

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives JupyterLab in headless Chromium (make test-browser)")


def chromium_path() -> str | None:
    """Debian's chromium, where it is installed."""
    return next((p for p in CHROMIUM_PATHS if os.access(p, os.X_OK)), None) or shutil.which("chromium")


@pytest.fixture(scope="session")
def chromium():
    """The Chromium executable and the Playwright module, or a skip (a failure under LABKIT_REQUIRE_BROWSER=1)."""
    problems = []
    executable = chromium_path()
    if executable is None:
        problems.append("Debian's chromium is not installed (no /usr/bin/chromium): `make test-browser` installs it "
                        "as root, or run `apt-get install chromium`")
    if importlib.util.find_spec("playwright") is None:
        problems.append("the Python package playwright is not installed: `make setup` installs the dev pins "
                        "(do not run `playwright install`; the test drives Debian's chromium)")
    if problems:
        reason = "; ".join(problems)
        if os.environ.get("LABKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"LABKIT_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    return executable
