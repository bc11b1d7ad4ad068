"""09_residual_design under papermill: a ReLU left after the addition breaks the identity path only
with the bug; and M1's verdict follows the identity measurement: a copy of the notebook whose
pre-activation block keeps that ReLU by default (so that neither design has an exact identity
path) turns M1's "partly" into "does-not-hold".

The bug side is the committed notebook's stored run at its defaults (SMALL differs from them only in seed
and sizes; tests/notebook_runs.py, `stored_run`); the fix runs at SMALL on a changed copy of the student
edition."""

from pathlib import Path

import nbformat
import pytest
from notebook_runs import run_student_edition_on_cpu, stored_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_residual_design.ipynb"
pytestmark = pytest.mark.lock_only
SMALL = {"seed": 1, "depths": [4, 8], "seeds": 1, "train_depths": [4], "train_steps": 10, "train_seeds": 1}
PRE_ACTIVATION_DEFAULT = "def __init__(self, block_width, relu_after_add=False):"
IDENTITY_DEFAULT = "def identity_only(design, depth, relu_after_add=False):"


def notebook_whose_pre_activation_block_keeps_the_relu(notebook: Path, folder: Path) -> Path:
    """A copy of `notebook` (the workbook's or its student edition) with both defaults changed."""
    nb = nbformat.read(notebook, as_version=4)
    for default in (PRE_ACTIVATION_DEFAULT, IDENTITY_DEFAULT):  # the designs measured, and M1's identity test
        cells = [cell for cell in nb.cells if default in cell.source]
        assert len(cells) == 1, f"the cell holding {default!r} is gone from {NOTEBOOK.name}"
        cells[0].source = cells[0].source.replace(default, default.replace("False", "True"))
    folder.mkdir()
    nbformat.write(nb, folder / NOTEBOOK.name)
    return folder / NOTEBOOK.name


# Two runs drive two things, each compared with the other run: the bug switch (the converted
# block's identity) and M1 (whether the pre-activation design the notebook measures has one).
@pytest.mark.parametrize(("bug", "pre_activation_exact"), [(True, True), (False, False)])
def test_relu_after_addition_gates_the_skip_only_with_the_bug(tmp_path, student_editions, bug, pre_activation_exact):
    if bug:
        assert pre_activation_exact, "the stored run is of the unchanged notebook"
        result = stored_run(NOTEBOOK)
        assert result.parameters["bug"] is True
    else:  # on the student edition, which also runs as a learner's untouched edition must
        edition = student_editions[NOTEBOOK]
        notebook = (edition if pre_activation_exact
                    else notebook_whose_pre_activation_block_keeps_the_relu(edition, tmp_path / "changed"))
        result = run_student_edition_on_cpu(notebook, NOTEBOOK, tmp_path / "run", {**SMALL, "bug": bug})
    assert result.status == "ok", result.error
    assert [c["id"] for c in result.claims] == ["M1"]
    m1 = result.claims[0]
    exact = m1["measured"]["exact gradient through the skip"]
    assert m1["verdict"] == ("partly" if pre_activation_exact else "does-not-hold")
    assert exact == {"pre": pre_activation_exact, "post": False}
    zeroed = float(m1["measured"]["share the post-activation ReLU zeroed"].rstrip("%"))
    assert not 40 <= zeroed <= 60, "the ReLU after the addition does not cut the article's half"
    if bug:
        assert result.metrics["identity_exact"] is False
        assert result.metrics["identity_nonzero_share"] < 0.8
    else:
        assert result.metrics["identity_exact"] is True
        assert result.metrics["identity_nonzero_share"] == 1.0
