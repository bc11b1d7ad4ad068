"""Refresh a committed notebook's stored outputs: sync it with its script, execute it, normalise, save both."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from labkit.notebooks import KERNELSPEC, normalise, paired_script, read_paired, write_script

__all__ = ["execute_in_place"]


def execute_in_place(notebook: Path, prefer: str | None = None, cell_timeout: int = 600) -> float:
    """Sync a notebook with its script, execute it with default parameters, normalise, save both.

    When the two disagree, `prefer` ("py" or "ipynb") says which holds the edits; without it this
    refuses rather than overwrite someone's work. Returns the seconds the execution took.
    """
    import nbformat
    from nbclient import NotebookClient

    notebook = Path(notebook)
    nb = read_paired(notebook, prefer)
    normalise(nb)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="labkit-exec-") as scratch:
        client = NotebookClient(nb, timeout=cell_timeout, kernel_name=KERNELSPEC["name"],
                                record_timing=False, resources={"metadata": {"path": scratch}})
        client.execute()
    seconds = time.perf_counter() - started
    normalise(nb)
    nbformat.write(nb, notebook)
    write_script(nb, paired_script(notebook))
    return seconds
