"""The headless Chromium both browser tests drive: one set of flags, one fresh profile each."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# No sandbox (CI runs as root), no GPU, no traffic of Chromium's own (updates, sync, QUIC probes), and
# /tmp instead of a small /dev/shm.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@contextmanager
def chromium_context(executable: str, profile: Path) -> Iterator:
    """A Playwright browser context on headless Chromium with a fresh profile folder, closed at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # A persistent context on a fresh folder is how Playwright takes --user-data-dir.
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000})
        try:
            yield context
        finally:
            context.close()
