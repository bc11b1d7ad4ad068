"""The workbook as a learner has it: JupyterLab in headless Chromium, Run All, then a slider moved.

One JupyterLab server (loopback, a random token, its own settings, config and runtime folders) serves
a temporary folder holding a copy of 00_start_here and a notebook whose explorer breaks on purpose.
The server is shut down in the fixture's teardown, whatever the tests did. The screenshot of the
moved explorer is saved in the test's tmp folder and copied to runs/browser/.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from headless_chromium import chromium_context

from labkit.explorers import ERROR_METADATA_KEY

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "00_start_here.ipynb"
BROKEN_NOTEBOOK = "broken_explorer.ipynb"
SCREENSHOT_COPY = ROOT / "runs" / "browser" / "00_start_here_explorer.png"
SERVER_START_S = 120
KERNEL_START_S = 120
RUN_ALL_S = 240
REDRAW_S = 60

# JupyterLab's user settings for the test: no news or update pop-up over the notebook, and every cell
# kept in the page (windowing would drop cells scrolled out of view from the DOM).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}
# Nothing reaches outside the machine: no announcements feed, no update check, no extension index.
LAB_CONFIG = {"LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.handlers.announcements.NeverCheckForUpdate",
                         "extension_manager": "readonly", "expose_app_in_browser": True}}
# The language servers and terminals are not part of the workbook and slow the start.
SERVER_CONFIG = {"ServerApp": {"jpserver_extensions": {"jupyter_lsp": False, "jupyter_server_terminals": False}}}

BROKEN_EXPLORER = """\
from labkit import explorers

def view(n):
    if n != 2:
        raise ValueError(f"broken on purpose for n={n}")
    print(f"n={n} works")

explorers.explore(view, n=explorers.slider(2, 1, 5))
"""

NOTEBOOK_STATE_JS = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.context || !panel.context.isReady || !panel.sessionContext) { return null; }
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    const cells = panel.content.widgets.filter(cell => cell.model.type === 'code');
    return {
        kernel: kernel ? kernel.status : 'none',
        running: cells.filter(cell => cell.model.executionState === 'running').length,
        counts: cells.map(cell => cell.model.executionCount),
    };
}"""
# The stored notebook brings execution counts with it, so "Run All has started" is watched for, not inferred.
WATCH_RUN_START_JS = """() => {
    window.labkitRunStarted = false;
    for (const cell of window.jupyterapp.shell.currentWidget.content.widgets) {
        cell.model.stateChanged.connect((model, change) => {
            if (change.name === 'executionState' && change.newValue === 'running') { window.labkitRunStarted = true; }
        });
    }
}"""
NOTEBOOK_JSON_JS = "() => window.jupyterapp.shell.currentWidget.content.model.toJSON()"
WIDGET_ERRORS_JS = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
    .map(node => node.innerText).filter(text => text.startsWith('Error displaying widget'))"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def broken_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(BROKEN_EXPLORER)]
    nbformat.write(nb, path)


class Lab:
    """A JupyterLab server started for the tests, and how to reach it."""

    def __init__(self, base: Path):
        self.base, self.port, self.token = base, free_port(), secrets.token_hex(24)
        self.root, self.log = base / "root", base / "jupyterlab.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> None:
        self.root.mkdir(parents=True)
        shutil.copy(ROOT / "notebooks" / NOTEBOOK, self.root / NOTEBOOK)
        broken_notebook(self.root / BROKEN_NOTEBOOK)
        for name, content in LAB_SETTINGS.items():
            write_json(self.base / "settings" / name, content)
        write_json(self.base / "config" / "jupyter_lab_config.json", LAB_CONFIG)
        write_json(self.base / "config" / "jupyter_server_config.json", SERVER_CONFIG)
        # Own settings, config, runtime and data folders: the learner's ~/.jupyter cannot change the run,
        # and the run leaves nothing behind in it; the python3 kernel is this interpreter's.
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(self.base / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.base / "workspaces"), JUPYTER_CONFIG_DIR=str(self.base / "config"),
                   JUPYTER_RUNTIME_DIR=str(self.base / "runtime"), JUPYTER_DATA_DIR=str(self.base / "data"))
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={self.root}", "--allow-root"]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                            start_new_session=True)
        deadline = time.monotonic() + SERVER_START_S
        while not self.answers():
            if self.process.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"JupyterLab did not answer within {SERVER_START_S} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def request(self, method: str, path: str, timeout: float = 5):
        request = urllib.request.Request(self.url + path, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        return urllib.request.urlopen(request, timeout=timeout)

    def answers(self) -> bool:
        try:
            with self.request("GET", "/api/status"):
                return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        """Ask the server to shut down (it stops its kernels), then end its process group if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.request("POST", "/api/shutdown").close()
            self.process.wait(timeout=15)
        except (urllib.error.URLError, ConnectionError, TimeoutError, subprocess.TimeoutExpired):
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def notebook_url(self, name: str) -> str:
        # `reset`: a fresh workspace, so the notebooks opened by earlier tests are not restored beside it.
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium):
    server = Lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
    assert server.process is None or server.process.poll() is not None, "the JupyterLab server outlived the tests"


@pytest.fixture(scope="module")
def browser(lab, chromium, tmp_path_factory):
    with chromium_context(chromium, tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


def open_and_run_all(context, lab: Lab, name: str):
    """Open a notebook, wait for its kernel, run every cell from the Run menu, wait until all have run."""
    page = context.new_page()
    page.goto(lab.notebook_url(name))
    page.wait_for_function(f"() => {{ const s = ({NOTEBOOK_STATE_JS})(); return s !== null && s.kernel === 'idle'; }}",
                           timeout=KERNEL_START_S * 1000)
    page.evaluate(WATCH_RUN_START_JS)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    # Queued cells count as running, so once Run All has started, "none running and the kernel idle"
    # means it is over (a cell that raises cancels the cells queued after it).
    page.wait_for_function(f"""() => {{ const s = ({NOTEBOOK_STATE_JS})();
        return window.labkitRunStarted && s !== null && s.kernel === 'idle' && s.running === 0; }}""",
                           timeout=RUN_ALL_S * 1000)
    return page


def error_outputs(notebook: dict, widget_errors: list[str]) -> list[str]:
    """Every error a learner would see: error outputs, explorer views that raised, widgets that failed to show.

    Text on stderr alone (a warning) is not an error.
    """
    found = [f"{text} (a widget)" for text in widget_errors]
    for index, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                found.append(f"cell {index}: {output['ename']}: {output['evalue']}")
            elif ERROR_METADATA_KEY in output.get("metadata", {}):
                found.append(f"cell {index}: explorer view raised {output['metadata'][ERROR_METADATA_KEY]}")
    return found


def errors_on(page) -> list[str]:
    return error_outputs(page.evaluate(NOTEBOOK_JSON_JS), page.evaluate(WIDGET_ERRORS_JS))


def explorer_cell(page):
    """The code cell holding the notebook's first explorer, and its view's text output (the one after the controls)."""
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    cell = panel.locator(".jp-CodeCell").filter(has=page.locator(".widget-slider")).first
    return cell, cell.locator(".jp-OutputArea-output").nth(1)


def move_first_slider(page, cell) -> None:
    """What a learner does with the keyboard: focus the slider's handle and press the right arrow."""
    handle = cell.locator(".widget-slider .noUi-handle").first
    handle.focus()
    page.keyboard.press("ArrowRight")


def wait_for_new_text(locator, before: str) -> str:
    deadline = time.monotonic() + REDRAW_S
    while time.monotonic() < deadline:
        now = locator.inner_text()
        if now != before:
            return now
        time.sleep(0.25)
    raise AssertionError(f"the view did not change within {REDRAW_S} s after the slider moved; it still reads:\n{before}")


def test_run_all_then_a_moved_slider_redraws_the_explorer(lab, browser, tmp_path):
    page = open_and_run_all(browser, lab, NOTEBOOK)
    screenshot = tmp_path / "00_start_here_explorer.png"
    try:
        state = page.evaluate(NOTEBOOK_STATE_JS)
        assert errors_on(page) == []
        assert sorted(state["counts"]) == list(range(1, len(state["counts"]) + 1)), f"not every cell ran: {state}"

        cell, view = explorer_cell(page)
        before = view.inner_text()
        figure_before = cell.locator("img").first.get_attribute("src")
        assert before.startswith("lr=0.05 · steps=30 (the defaults")
        # The controls at the top of the window, so the screenshot shows them with the redrawn view.
        cell.locator(".jp-OutputArea").evaluate("node => node.scrollIntoView({block: 'start'})")
        move_first_slider(page, cell)
        after = wait_for_new_text(view, before)
        assert after.startswith("lr=0.055 · steps=30\nwith zero_grad"), after
        assert view.get_attribute("data-mime-type") == "text/plain"
        assert cell.locator("img").first.get_attribute("src") != figure_before, "the figure was not redrawn"
        assert errors_on(page) == []
    finally:
        # Saved on failure too: the picture is the quickest way to see what went wrong.
        page.screenshot(path=str(screenshot))
        SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, SCREENSHOT_COPY)
        page.close()


def test_a_broken_explorer_callback_is_caught_by_the_error_check(lab, browser, tmp_path):
    """The check above must fail on a callback that raises: here it reports the broken explorer's error."""
    page = open_and_run_all(browser, lab, BROKEN_NOTEBOOK)
    try:
        assert errors_on(page) == [], "the default view works; only a moved control breaks it"
        cell, view = explorer_cell(page)
        before = view.inner_text()
        move_first_slider(page, cell)
        after = wait_for_new_text(view, before)
        assert after.startswith("n=3: the view raised ValueError: broken on purpose for n=3\nTraceback")
        assert errors_on(page) == ["cell 0: explorer view raised ValueError: broken on purpose for n=3"]
    finally:
        page.screenshot(path=str(tmp_path / "broken_explorer.png"))
        page.close()


def test_the_error_check_ignores_warnings_and_finds_error_outputs():
    """Runs without a browser: the same check on a notebook's JSON, as the page's model gives it."""
    warning = nbformat.v4.new_output("stream", name="stderr", text="UserWarning: only a warning\n")
    error = nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("w", outputs=[warning]),
                                         nbformat.v4.new_code_cell("1/0", outputs=[error])])
    assert error_outputs(nb, []) == ["cell 1: ZeroDivisionError: division by zero"]
    assert error_outputs(nbformat.v4.new_notebook(cells=nb.cells[:1]), ["Error displaying widget: model not found"]) == [
        "Error displaying widget: model not found (a widget)"]
