"""09_residual_design under papermill: a ReLU left after the addition breaks the identity path only with the bug."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_residual_design.ipynb"
SMALL = {"seed": 1, "depths": [4, 8], "seeds": 1, "train_depths": [4], "train_steps": 10, "train_seeds": 1}


@pytest.mark.parametrize("bug", [True, False])
def test_relu_after_addition_gates_the_skip_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, {**SMALL, "bug": bug})
    assert result.status == "ok", result.error
    assert [c["id"] for c in result.claims] == ["M1"]
    if bug:
        assert result.metrics["identity_exact"] is False
        assert result.metrics["identity_nonzero_share"] < 0.8
    else:
        assert result.metrics["identity_exact"] is True
        assert result.metrics["identity_nonzero_share"] == 1.0
