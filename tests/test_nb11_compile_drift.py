"""11_compile_drift under papermill: the article's `module._compiled = False` leaves the module in
the captured graph; `torch.compiler.disable` takes it out; and H4's verdict follows the slopes the
run measures. The papermill run uses backend="aot_eager", which captures the same graphs as inductor
without generating and building C++, to stay fast.

The bug side is the committed notebook's stored run at its defaults (tests/notebook_runs.py, `stored_run`;
nbval proves it fresh in the same `make test`). It differs from SMALL in seed and sizes, and in `backend`
(inductor, the notebook's default): the head's captured ops are counted by `captured_ops`, which compiles
with a recording backend of its own whatever `backend` says, so the bug switch's outcome does not depend
on it, and H4 at the default backend is the comparison a learner's run makes. The fixed side runs at
SMALL on the student edition; it also measures the article's flag (case H2 excludes the head both ways
in every run), so the flag's captured head op is asserted at aot_eager too. H3 (GPU-only) is recorded in a cell nbval does
not compare (tagged nbval-ignore-output), so the stored run leaves it out: only the fresh run shows it."""

from pathlib import Path

import nbformat
import pytest
from notebook_runs import run_student_edition_on_cpu, stored_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "11_compile_drift.ipynb"
pytestmark = pytest.mark.lock_only
SMALL = {"seed": 1, "backend": "aot_eager", "hidden": 16, "drift_steps": 40}
BUILTIN_RELU = '"torch.relu": torch.relu,'
# A relu with slope 0.5 at 0 in place of torch.relu: no torch has one, so the notebook is changed.
HALF_SLOPE_RELU = '"torch.relu": lambda x: (x + x.abs()) / 2,'


def notebook_whose_torch_relu_has_slope_half(notebook: Path, folder: Path) -> Path:
    """A copy of `notebook` (the workbook's or its student edition) with the changed relu."""
    nb = nbformat.read(notebook, as_version=4)
    forms = [cell for cell in nb.cells if BUILTIN_RELU in cell.source]
    assert len(forms) == 1, f"the RELU_FORMS cell holding {BUILTIN_RELU!r} is gone from {NOTEBOOK.name}"
    forms[0].source = forms[0].source.replace(BUILTIN_RELU, HALF_SLOPE_RELU)
    folder.mkdir()
    nbformat.write(nb, folder / NOTEBOOK.name)
    return folder / NOTEBOOK.name


# The stored run and one papermill run drive two things at once: the bug switch (the head's captured
# ops) and H4's verdict (a relu with slope 0 at 0 holds, one with slope 0.5 does not), each compared
# with the other run.
@pytest.mark.parametrize(("bug", "torch_relu_slope"), [(True, 0.0), (False, 0.5)])
def test_head_ops_follow_the_bug_and_h4_follows_the_measured_slope(tmp_path, student_editions, bug, torch_relu_slope):
    if bug:  # the notebook's default, with the installed torch.relu: its stored run
        result = stored_run(NOTEBOOK)
        assert result.parameters["bug"] is True
    else:  # the fix, on a changed copy of the student edition: it also runs as a learner's untouched edition must
        notebook = notebook_whose_torch_relu_has_slope_half(student_editions[NOTEBOOK], tmp_path / "changed")
        result = run_student_edition_on_cpu(notebook, NOTEBOOK, tmp_path / "run", {**SMALL, "bug": bug})
        # The slope's cell is not compared by nbval (torch releases changed it), so only a fresh run asserts it.
        assert result.metrics["clamp_slope_at_zero"] in (0.0, 1.0)  # the two slopes torch releases have given
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    measured = {c["id"]: c["measured"] for c in result.claims}
    h4_verdict = "holds" if torch_relu_slope == 0.0 else "does-not-hold"
    expected = {"H4": h4_verdict, "H1": "does-not-hold", "H2": "partly"}
    # H3's cell is not compared by nbval, so the stored run leaves it out
    assert verdicts == (expected if bug else {**expected, "H3": "needs-gpu"})
    assert result.metrics["head_ops_captured"] == (1 if bug else 0)
    # H2 measures both exclusions in every run: the article's flag leaves the head op in the graph.
    assert measured["H2"]["head ops traced"] == {"head._compiled = False": 1, "torch.compiler.disable": 0}
    if torch_relu_slope == 0.0:
        assert measured["H4"]["built-in relus' slopes at 0"] == [0.0]
    else:
        assert measured["H4"]["built-in relus' slopes at 0"] == [0.0, 0.5]
        assert measured["H4"]["torch.relu's, eager and compiled"] == [0.5, 0.5]
