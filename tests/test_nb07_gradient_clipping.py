"""07_gradient_clipping under papermill: clipping before GradScaler.unscale_ freezes training only with the bug."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_gradient_clipping.ipynb"
SMALL = {"seed": 1, "steps": 60, "cnn_steps": 20, "seeds": 1}


@pytest.mark.parametrize("bug", [True, False])
def test_clipping_before_unscale_stalls_training_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, {**SMALL, "bug": bug})
    assert result.status == "ok", result.error
    assert {c["id"] for c in result.claims} == {"F1", "F2", "F3", "F4"}
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts["F1"] == "does-not-hold" and verdicts["F4"] == "partly"
    if bug:
        assert result.metrics["scaler_update_ratio"] < 1e-5
        assert result.metrics["scaler_test_accuracy"] < 0.3
    else:
        assert result.metrics["scaler_update_ratio"] > 1e-3
        assert result.metrics["scaler_test_accuracy"] > 0.8
