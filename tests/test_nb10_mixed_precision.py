"""10_mixed_precision under papermill: without a loss scaler, fp16 autocast loses weight-gradient
entries to underflow; with one, almost none. A NaN burst long enough to take the scale to 0 turns
the parameters NaN (G6 holds); a short one does not (G6 does not hold), from the same code.

Both sides run at SMALL: the bug side is a papermill run of the notebook, the fix runs on the student
edition. The stored run at the defaults cannot stand in for the bug side: the lost shares of
weight-gradient entries are recorded in a cell tagged nbval-ignore-output, which nbval does not compare
(tests/notebook_runs.py, `stored_run`)."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu, run_student_edition_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "10_mixed_precision.ipynb"
pytestmark = pytest.mark.lock_only
SMALL = {"seed": 1, "pretrain_steps": 80, "amp_steps": 3, "scaler_steps": 500}
FIXED = {"G1": "does-not-hold", "G5": "holds", "G2": "partly", "G3": "partly", "G4": "does-not-hold"}


@pytest.mark.parametrize(("bug", "nan_burst_steps", "g6"), [(True, 200, "holds"), (False, 50, "does-not-hold")])
def test_fp16_without_a_scaler_loses_gradients_only_with_the_bug(tmp_path, student_editions, bug, nan_burst_steps, g6):
    parameters = {**SMALL, "bug": bug, "nan_burst_steps": nan_burst_steps}
    if bug:
        result = run_on_cpu(NOTEBOOK, tmp_path, parameters)
    else:  # the fix, on the student edition: it also runs as a learner's untouched edition must
        result = run_student_edition_on_cpu(student_editions[NOTEBOOK], NOTEBOOK, tmp_path, parameters)
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts == {**FIXED, "G6": g6}
    assert result.metrics["g6_scale_reached_zero"] is (g6 == "holds")
    lost, with_scaler = result.metrics["fp16_lost_weight_grad_pct"], result.metrics["scaled_lost_weight_grad_pct"]
    if bug:
        assert lost > 1.0 and lost > 3 * with_scaler
    else:
        assert lost == with_scaler
