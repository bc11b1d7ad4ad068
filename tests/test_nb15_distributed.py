"""15_distributed under papermill with other parameters: per-rank BatchNorm's loss gap comes and goes with `bug`."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "15_distributed.ipynb"
SMALL = {"seed": 2, "per_rank_batch": 8, "steps": 4, "hidden": 16, "timeout_s": 30.0}


@pytest.mark.parametrize("bug", [True, False])
def test_per_rank_batchnorm_moves_the_loss_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, dict(SMALL, bug=bug))
    assert result.status == "ok", result.error
    verdicts = {claim["id"]: claim["verdict"] for claim in result.claims}
    assert verdicts == {"O3": "holds", "O1": "does-not-hold", "O2b": "does-not-hold", "O2": "needs-gpu"}
    if bug:
        assert result.metrics["loss_gap"] > 1e-3
    else:
        # BatchNorm over the global batch: the ranks compute what one process computes, to rounding.
        assert result.metrics["loss_gap"] < 1e-9
