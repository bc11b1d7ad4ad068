"""Shared test settings: GPU tests skip with a reason on a machine without CUDA; files with slow tests
run first."""

import pytest
import torch


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
