"""The committed notebooks: in sync with their scripts, executed, normalised, following the skeleton,
and free of undefined names, unused imports and torch attributes this torch lacks, also in the
GPU-only cells CPU CI never runs.

nbval (run by `make test` after the unit tests) checks that each notebook's stored outputs still
match what its code prints; the tests here check everything nbval does not. That notebooks use only labkit's public API is
checked by AST in tests/test_public_api.py.
"""

import ast
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from torch_names import held_scripts, missing_torch_attributes

from labkit import claims, claims_report, notebooks, runner
from labkit._notebook_meta import install_line

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = notebooks.workbook_notebooks(ROOT / "notebooks")
SKELETON_HEADINGS = ("Summary", "Claims checked", "Exercises")
IGNORED = "nbval-ignore-output"  # the cell tag by which nbval skips comparing a cell's outputs


def ids(paths):
    return [p.stem for p in paths]


@pytest.fixture(params=NOTEBOOKS, ids=ids(NOTEBOOKS))
def notebook(request):
    return request.param


def test_notebook_and_its_script_agree(notebook):
    assert notebooks.pair_differences(notebook) == [], f"run `make notebooks NB={notebook.stem}` to sync the pair"


def test_every_code_cell_was_executed_without_errors(notebook):
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    unexecuted = [i for i, c in enumerate(code) if c.execution_count is None]
    errors = [o.get("ename") for c in code for o in c.outputs if o.output_type == "error"]
    assert not unexecuted, f"unexecuted code cells {unexecuted}: run `make notebooks NB={notebook.stem}`"
    assert not errors, f"stored error outputs: {errors}"


def test_ignored_outputs_are_marked_by_a_tag_a_learner_does_not_read_in_the_code(notebook):
    nb = nbformat.read(notebook, as_version=4)
    commented = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                 and any(line.strip().lstrip("#").strip().startswith("NBVAL_") for line in c.source.splitlines())]
    assert not commented, f"cells {commented} use an nbval comment marker: tag them {IGNORED!r} instead"
    assert any(IGNORED in c.metadata.get("tags", []) for c in nb.cells), "the fingerprint cell is tagged"


def test_stored_notebook_holds_no_volatile_metadata(notebook):
    nb = nbformat.read(notebook, as_version=4)
    normalised = copy.deepcopy(nb)
    notebooks.normalise(normalised)
    assert normalised == nb, "volatile metadata stored: run `make notebooks` to normalise"


def test_parameters_cell_has_seed_and_device(notebook):
    params = runner.notebook_parameters(notebook)
    assert isinstance(params.get("seed"), int) and params.get("device") == "auto", params


def test_notebook_follows_the_skeleton(notebook):
    nb = nbformat.read(notebook, as_version=4)
    headings = [line.lstrip("# ").strip() for c in nb.cells if c.cell_type == "markdown"
                for line in c.source.splitlines() if line.startswith("#")]
    positions = [next((i for i, h in enumerate(headings) if h.startswith(name)), None) for name in SKELETON_HEADINGS]
    assert None not in positions, f"missing skeleton headings {SKELETON_HEADINGS}: have {headings}"
    assert positions == sorted(positions), f"skeleton headings out of order: {headings}"


def test_notebook_records_verdicts_for_catalogued_cases(notebook):
    records = claims_report.collect([notebook])
    assert records, "a notebook records at least one verdict with claims.check"
    family_notebooks = {nb for fam in claims.families().values() for nb in fam["notebooks"]}
    assert notebook.stem in family_notebooks, f"{notebook.stem} is not a planned notebook in cases.json"


def test_compared_outputs_name_no_torch_version(notebook):
    # The GPU machine runs another torch release than the pin; nbval compares these outputs there too.
    version = re.escape(torch.__version__.split("+")[0])
    nb = nbformat.read(notebook, as_version=4)
    compared = [c for c in nb.cells if c.cell_type == "code" and IGNORED not in c.metadata.get("tags", [])]
    texts = [json.dumps(o.get("data", o.get("text", ""))) for c in compared for o in c.outputs]
    naming = [text[max(0, m.start() - 60):m.end() + 20] for text in texts for m in re.finditer(version, text)]
    assert not naming, f"compared outputs name torch {torch.__version__}: {naming[:3]}"


def nbval(path):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
         "--nbval-sanitize-with", str(ROOT / "notebooks" / "nbval_sanitize.cfg"), str(path)],
        capture_output=True, text=True, cwd=path.parent,
    )


def test_every_name_a_cell_uses_is_defined_and_every_import_is_used(tmp_path):
    # CPU CI never executes a notebook's GPU-only cells: a misspelt name there would first fail on a
    # GPU runner. pyflakes reads every cell, run or not, and the scripts cells hold as strings to run
    # in a fresh process: undefined names (ruff F821) and imports nothing uses (F401, dead code). The
    # rest of the linter is left off: the py twins redefine each exercise's function on purpose.
    # Each twin's first code line, the generated install line (tests/test_install.py checks it), stands here as
    # the `import sys` it gives the notebook: it names IPython's get_ipython and imports labkit.start for its effect.
    twins = sorted((ROOT / "notebooks" / "py").glob("*.py"))
    assert len(twins) == len(NOTEBOOKS)
    checked, held = [], []
    for twin in twins:
        text = twin.read_text()
        assert text.count(install_line()) == 1, twin.name
        checked.append(tmp_path / twin.name)
        checked[-1].write_text(text.replace(install_line(), "import sys  # noqa: F401"))
        for number, script in enumerate(held_scripts(ast.parse(text))):
            held.append(tmp_path / f"{twin.stem}.script{number}.py")
            held[-1].write_text(script)
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821,F401",
                            "--output-format", "concise", *map(str, checked + held)], capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_every_torch_attribute_a_cell_names_exists_in_this_torch(notebook):
    # The same blind spot as undefined names: torch.cuda.max_memory_reserved misspelt in a GPU-only cell,
    # or in a script a cell runs in a fresh process, would pass CPU CI. Lines count from the start of
    # their script.
    twin = ROOT / "notebooks" / "py" / f"{notebook.stem}.py"
    tree = ast.parse(twin.read_text())
    held = [ast.parse(script, f"{twin.name}, held script {number}") for number, script in enumerate(held_scripts(tree))]
    missing = missing_torch_attributes(twin.name, [tree, *held])
    assert missing == [], "\n".join(missing)


def test_nbval_fails_when_stored_outputs_are_stale(tmp_path):
    """nbdev's discipline: change a notebook's code without re-executing it, and the check fails. On a
    small notebook without torch, under the notebooks' own nbval settings, in one kernel: nbval compares
    each cell on its own, so the cells whose stored outputs are fresh (one of them a duration the
    sanitiser must hide) pass beside the cell whose code gained a line its stored outputs lack. That
    the real notebooks' stored outputs are fresh is nbval's stage of `make test`."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    fresh = nbformat.v4.new_code_cell("print('stored and still printed')")
    fresh.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stored and still printed\n")]
    timed = nbformat.v4.new_code_cell("import time\nstarted = time.perf_counter()\n"
                                      "print(f'took {time.perf_counter() - started + 0.5:.3f} s')")
    timed.outputs = [nbformat.v4.new_output("stream", name="stdout", text="took 0.123 s\n")]
    stale = nbformat.v4.new_code_cell("print('stored')\nprint('a line the stored outputs do not have')")
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stored\n")]
    nb.cells = [fresh, timed, stale]
    for count, cell in enumerate(nb.cells, 1):
        cell.execution_count = count
    path = tmp_path / "stale.ipynb"
    nbformat.write(nb, str(path))
    result = nbval(path)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "1 failed, 2 passed" in result.stdout, result.stdout[-2000:]
    # the failed item is the changed cell (nbval counts cells from 0), and its diff shows the new line
    assert "::Cell 2 - " in result.stdout and "a line the stored outputs do not have" in result.stdout
