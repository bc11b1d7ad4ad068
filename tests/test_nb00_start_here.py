"""00_start_here under papermill with other parameters: the planted bug's symptom comes and goes."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_start_here.ipynb"


@pytest.mark.parametrize("bug", [True, False])
def test_forgotten_zero_grad_stalls_training_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, {"bug": bug, "seed": 3, "steps": 40})
    assert result.status == "ok", result.error
    assert [c["verdict"] for c in result.claims] == ["holds"]
    if bug:
        assert result.metrics["final_loss"] > 1.0
    else:
        assert result.metrics["final_loss"] < 0.1
