"""Shared test settings: GPU tests skip with a reason on a machine without CUDA; files with slow tests
run first; the session counts the Jupyter kernels its tests start; the student edition is written once
per session."""

import atexit
import collections
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

WORKBOOK = Path(__file__).resolve().parents[1] / "notebooks"

# Every IPython kernel a test starts (papermill, nbclient, nbgrader; in this process or a child) runs the
# startup files of IPYTHONDIR, and children inherit the variable: one file there appends the test that
# started it (LABKIT_KERNEL_TEST, else PYTEST_CURRENT_TEST; inherited too) to a log, read back in the terminal
# summary. The hub's single-user servers filter their environment, so their kernels are not counted.
KERNEL_COUNTER = """\
def _labkit_count_kernel():
    import os
    with open(os.environ["LABKIT_KERNEL_LOG"], "a") as log:
        test = os.environ.get("LABKIT_KERNEL_TEST") or os.environ.get("PYTEST_CURRENT_TEST", "outside a test")
        log.write(test.split(" (")[0] + "\\n")
_labkit_count_kernel()
del _labkit_count_kernel
"""


def pytest_configure(config):
    if hasattr(config, "workerinput") or "LABKIT_KERNEL_LOG" in os.environ:
        return  # an xdist worker, or a nested pytest: the session that set the counter counts
    ipython_dir = Path(tempfile.mkdtemp(prefix="labkit-test-ipython-"))
    # Removed at exit, not in pytest_unconfigure: an IPython shell made in this process (nbval, a test)
    # writes its history there from its own atexit hook, which runs before this earlier-registered one.
    atexit.register(shutil.rmtree, ipython_dir, ignore_errors=True)
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-count-kernel.py").write_text(KERNEL_COUNTER)
    os.environ["IPYTHONDIR"] = str(ipython_dir)
    os.environ["LABKIT_KERNEL_LOG"] = str(ipython_dir / "kernels.log")
    config.stash[KERNEL_LOG] = ipython_dir / "kernels.log"


KERNEL_LOG = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A nested pytest (test_notebooks' nbval meta-test, the GPU runner's dry run) sets PYTEST_CURRENT_TEST to
    # its own items for the kernels it starts; the counting session's test, kept here, names them instead.
    if item.config.stash.get(KERNEL_LOG, None) is not None:
        os.environ["LABKIT_KERNEL_TEST"] = item.nodeid


def pytest_terminal_summary(terminalreporter, config):
    log = config.stash.get(KERNEL_LOG, None)
    if log is None:
        return
    starts = log.read_text().splitlines() if log.exists() else []
    by_file = collections.Counter(line.split("::")[0] for line in starts)
    terminalreporter.write_sep("-", f"kernel starts: {len(starts)}")
    for name, count in by_file.most_common():
        terminalreporter.write_line(f"{count:4d}  {name}")


def pytest_collection_modifyitems(config, items):
    slow_files_first(items)
    if torch.cuda.is_available():
        return
    reason = "needs a CUDA device: this machine has none (torch.cuda.is_available() is False); run `make test-gpu` on a GPU runner"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def slow_files_first(items):
    """Files holding a `slow` test first, each file's tests kept together and in order. `make test`
    hands whole files to two workers (pytest-xdist, --dist loadfile) in this order: a long file
    started last would keep one worker busy while the other idles."""
    files = list(dict.fromkeys(item.path for item in items))
    slow = {item.path for item in items if "slow" in item.keywords}
    rank = {path: (path not in slow, index) for index, path in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])


def write_notebook(path, parameters: str, *cells: str):
    """A small executable notebook: a tagged parameters cell, then code cells."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def make_notebook(tmp_path):
    """Factory: make_notebook("name", "seed = 0", "print(seed)") -> path of a notebook in tmp_path."""
    def factory(name, parameters, *cells):
        return write_notebook(tmp_path / f"{name}.ipynb", parameters, *cells)
    return factory


@pytest.fixture(scope="session")
def student_editions(tmp_path_factory) -> dict[Path, Path]:
    """Each workbook notebook (notebooks/NN_name.ipynb) mapped to its student edition, written once per
    session: test_student checks its text, and each tests/test_nbNN_*.py runs its fixed side on it, so one
    papermill run proves both that the edition runs with its checks failing gracefully and that the verdict
    flips (tests/notebook_runs.py, `run_student_edition_on_cpu`)."""
    from labkit import student

    destination = tmp_path_factory.mktemp("student")
    return {WORKBOOK / path.name: path for path in student.write_student_edition(WORKBOOK, destination)}


@pytest.fixture(scope="session")
def kernel_facts(tmp_path_factory):
    """One small notebook run once per session whose cells hold the facts test_claims, test_figures and
    test_explorers need a real kernel for (tests/kernel_facts.py)."""
    from kernel_facts import run_kernel_facts

    return run_kernel_facts(tmp_path_factory.mktemp("kernel_facts"))
