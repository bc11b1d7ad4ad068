"""One small notebook, run once per session, for the facts only a real kernel shows.

Claims read back from stored outputs (test_claims), figures stored with their alt text (test_figures) and
an explorer's view following a moved control (test_explorers) each used to start a kernel of their own,
test_claims two for one notebook. Here they are cells of one notebook, run once by labkit's runner (the
`kernel_facts` session fixture, tests/conftest.py); each test asserts on its own cells.

The order is part of what is tested: the figure cell holds the kernel's first figure after
`repro.setup` (the inline backend loads at the first figure and clears the Figure formatters setup
installed), so no cell before it draws. test_memory's report plot is not here: it needs a kernel that
has not imported pyplot, which this one has before that plot could come first without taking the
figure cell's place.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

NAME = "01_fixture"
PARAMETERS = "seed = 0"
CLAIM = (
    "from labkit import claims\n"
    "claims.check('Z1', verdict='holds', measured={'max |diff|': 0.0, 'values compared': 8})\n"
    "claims.metric('grad_norm', 1.5)"
)
FIGURE_SETUP = "from labkit import figures, repro\nimport matplotlib.pyplot as plt\ndev = repro.setup(seed=seed)"
FIGURE = "figure, axis = plt.subplots()\naxis.plot([1, 2])\nfigures.describe(figure, 'a rising line')\nplt.show()"
EXPLORER = (
    "from labkit import explorers\n"
    "import matplotlib.pyplot as plt\n"
    "def view(width, kind):\n"
    "    figure, axis = plt.subplots()\n"
    "    axis.bar(range(width), range(width))\n"
    "    print(f'{kind} with {width} bars')\n"
    "    return figure\n"
    "explorer = explorers.Explorer(view, {'width': explorers.slider(3, 1, 8), "
    "'kind': explorers.choice('bars', ['bars', 'columns'])})\n"
    "explorer.show()"
)
EXPLORER_MOVE = "explorer.controls['width'].value = 5"
CODE = (CLAIM, FIGURE_SETUP, FIGURE, EXPLORER, EXPLORER_MOVE)


@dataclass(frozen=True)
class KernelFacts:
    notebook: Path  # the executed notebook; copy it before changing it (`copy_to`)
    result: object  # labkit.runner's RunResult

    def cell(self, source: str):
        """The executed cell whose code is `source` (one of this module's constants)."""
        import nbformat

        executed = nbformat.read(self.notebook, as_version=4)
        (cell,) = [cell for cell in executed.cells if cell.source == source]
        return cell

    def copy_to(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.notebook, folder / self.notebook.name))


def run_kernel_facts(folder: Path) -> KernelFacts:
    import nbformat

    from labkit.runner import run_notebook

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(code) for code in CODE]
    source = folder / f"{NAME}.ipynb"
    nbformat.write(nb, str(source))
    result = run_notebook(source, folder / "out", timeout=180)
    assert result.status == "ok", result.error
    return KernelFacts(folder / "out" / f"{NAME}.ipynb", result)
