"""08_gradient_health under papermill: an uncapped learning-rate warm-up blows up only with the bug."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "08_gradient_health.ipynb"
# A faster warm-up, so that the run goes wrong within 100 steps.
SMALL = {"seed": 1, "steps": 100, "lr": 0.05, "lr_growth": 1.06, "micro_batches": 2, "timing_seconds": 0.05}


@pytest.mark.parametrize("bug", [True, False])
def test_uncapped_warmup_explodes_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, {**SMALL, "bug": bug})
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert set(verdicts) == {"L1", "L2", "L3", "L4", "L5"}
    assert verdicts["L2"] == "holds" and verdicts["L3"] == "does-not-hold"
    assert result.metrics["diverged"] is bug
    if bug:
        assert isinstance(result.metrics["first_exploding_alert"], int)
    else:
        assert result.metrics["first_exploding_alert"] == "none"
