"""15_distributed under papermill with other parameters: per-rank BatchNorm's loss gap comes and goes
with `bug`; and O3's verdict follows what the ranks' data let it see: with `same_rows` every rank
holds the same rows, so DDP's average equals each rank's own gradient and each rank's BatchNorm
statistics equal the global batch's, and "holds" becomes "partly" (per-rank BatchNorm's gap is gone
even with the bug)."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "15_distributed.ipynb"
SMALL = {"seed": 2, "per_rank_batch": 8, "steps": 4, "hidden": 16, "timeout_s": 30.0}


@pytest.mark.parametrize(("bug", "same_rows"), [(True, False), (False, False), (True, True)])
def test_per_rank_batchnorm_moves_the_loss_only_with_the_bug(tmp_path, bug, same_rows):
    result = run_on_cpu(NOTEBOOK, tmp_path, dict(SMALL, bug=bug, same_rows=same_rows))
    assert result.status == "ok", result.error
    verdicts = {claim["id"]: claim["verdict"] for claim in result.claims}
    o3 = "partly" if same_rows else "holds"
    assert verdicts == {"O3": o3, "O1": "does-not-hold", "O2b": "does-not-hold", "O2": "needs-gpu"}
    o3_evidence = next(claim["evidence"] for claim in result.claims if claim["id"] == "O3")
    assert ("so no averaging could show" in o3_evidence) is same_rows
    if bug and not same_rows:
        assert result.metrics["loss_gap"] > 1e-3
    else:
        # BatchNorm over the global batch, or over a rank's rows that are the global batch's: the
        # ranks compute what one process computes, to rounding.
        assert result.metrics["loss_gap"] < 1e-9
