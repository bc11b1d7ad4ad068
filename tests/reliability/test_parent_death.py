"""A SIGKILL of `python -m labkit repro`, which no handler can catch, leaves no papermill or kernel behind.

On Linux the papermill child asks the kernel to signal it when its parent dies (PR_SET_PDEATHSIG);
the Jupyter kernel polls for its own parent and follows. One real run, one real SIGKILL.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 15
STARTED_WITHIN_S = 120  # a kernel start on two loaded cores


def _sleeping_notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    parameters = nbformat.v4.new_code_cell("wait_s: float = 300.0  # how long the cell sleeps, above 0")
    parameters.metadata["tags"] = ["parameters"]
    body = 'import os, time\nopen("started", "w").write(str(os.getpid()))\ntime.sleep(wait_s)'
    nb.cells = [parameters, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, str(path))
    return path


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + STARTED_WITHIN_S
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} did not appear within {STARTED_WITHIN_S} s"
        time.sleep(0.2)


@pytest.mark.trial("extra")
@pytest.mark.timeout(STARTED_WITHIN_S + 60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_repro_takes_papermill_and_its_kernel_with_it(tmp_path):
    notebook = _sleeping_notebook(tmp_path / "99_sleep.ipynb")
    out = tmp_path / "run"
    repro = subprocess.Popen([sys.executable, "-m", "labkit", "repro", str(notebook), "--out", str(out)],
                             cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[psutil.Process] = []
    try:
        _wait_for(out / "started")
        kernel = psutil.Process(int((out / "started").read_text()))
        started = [kernel, *kernel.parents()[:1]]
        assert started[1].ppid() == repro.pid, "the kernel's parent is the papermill child of repro"
        repro.send_signal(signal.SIGKILL)
        repro.wait(timeout=GONE_WITHIN_S)
        _, alive = psutil.wait_procs(started, timeout=GONE_WITHIN_S)
        assert alive == [], f"still running after repro was killed: {[p.cmdline() for p in alive]}"
    finally:
        for process in [*started, psutil.Process(repro.pid) if repro.poll() is None else None]:
            if process is not None and process.is_running():
                process.kill()
