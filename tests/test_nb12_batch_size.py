"""12_batch_size under papermill with other parameters: a summed loss makes each doubling of the
batch double the step (J4), and the mean loss keeps the step steady; the noise and global-batch
verdicts do not depend on the bug switch."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "12_batch_size.ipynb"
SMALL = {"seed": 1, "noise_batches": [8, 16, 32, 64], "noise_draws": 60, "scheduler_batches": [16, 64, 256],
         "steps_per_batch": 6, "devices": 2, "accumulation_steps": 4}


@pytest.mark.parametrize("bug", [True, False])
def test_summed_loss_scales_the_step_with_the_batch_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, {**SMALL, "bug": bug})
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts["J2"] == "does-not-hold" and verdicts["J3"] == "holds"
    growth, final_loss = result.metrics["update_ratio_growth"], result.metrics["final_loss"]
    if bug:
        assert growth > 3
        assert final_loss == "non-finite" or final_loss > 2.0
    else:
        assert growth < 1.5
        assert final_loss < 1.5
