"""00_start_here under papermill with other parameters: the planted bug's symptom comes and goes, and
case Z1's verdict follows its measurement: clearing w.grad between the two backward passes (what
zero_grad() does) leaves only the second gradient, so the sum the claim describes is gone."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_start_here.ipynb"
pytestmark = pytest.mark.lock_only


@pytest.mark.parametrize(("bug", "clear_between", "z1"), [(True, False, "holds"), (False, True, "does-not-hold")])
def test_forgotten_zero_grad_stalls_training_only_with_the_bug(tmp_path, bug, clear_between, z1):
    result = run_on_cpu(NOTEBOOK, tmp_path, {"bug": bug, "seed": 3, "steps": 40, "clear_between": clear_between})
    assert result.status == "ok", result.error
    [record] = result.claims
    assert (record["id"], record["verdict"]) == ("Z1", z1)
    assert ("is not g1 + g2" in record["evidence"]) is clear_between
    if bug:
        assert result.metrics["final_loss"] > 1.0
    else:
        assert result.metrics["final_loss"] < 0.1
