"""05_batchnorm_finetuning under papermill with other parameters: the planted bug's symptom comes and goes.

The planted bug leaves the frozen backbone in train mode while the head trains: its BatchNorm running
means drift towards the fine-tuning batches, and at batch size 2 the head's test accuracy drops.
"""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu, run_student_edition_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_batchnorm_finetuning.ipynb"
pytestmark = pytest.mark.lock_only
# Small, non-default settings: one seed, batch size 2 (where train mode hurts most), shorter runs.
PARAMETERS = {"seed": 1, "seeds": 1, "batch_size": 2, "pretrain_steps": 200, "finetune_steps": 150}


@pytest.mark.parametrize("bug", [True, False])
def test_train_mode_backbone_drifts_and_loses_accuracy_only_with_the_bug(tmp_path, student_editions, bug):
    if bug:
        result = run_on_cpu(NOTEBOOK, tmp_path, dict(PARAMETERS, bug=bug))
    else:  # the fix, on the student edition: it also runs as a learner's untouched edition must
        result = run_student_edition_on_cpu(student_editions[NOTEBOOK], NOTEBOOK, tmp_path, dict(PARAMETERS, bug=bug))
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts == {"D1": "does-not-hold", "D2": "does-not-hold", "D3": "does-not-hold", "D4": "holds"}
    metrics = result.metrics
    # train_mode_cost is measured both ways in every run: eval-mode accuracy minus train-mode accuracy.
    assert metrics["train_mode_cost"] > 0.05
    if bug:
        assert metrics["running_mean_drift"] > 0.1
        assert metrics["eval_acc"] < metrics["eval_acc_recalibrated"] - 0.05
    else:
        assert metrics["running_mean_drift"] == 0
        assert metrics["eval_acc"] > metrics["eval_acc_recalibrated"] - 0.05


def test_headline_remedy_verdict_follows_the_paired_accuracy(tmp_path):
    """D2 both ways: at batch 2 (above) the headline remedy, BatchNorm left in train mode with frozen
    weights, is worse than all-eval and D2 does not hold; at batch 64 on seed 0 it is not worse, so
    the remedy only equals eval mode (the precise variant, bit for bit) and D2 is partly."""
    result = run_on_cpu(NOTEBOOK, tmp_path, {"seed": 0, "seeds": 1, "batch_size": 64, "bug": False})
    assert result.status == "ok", result.error
    d2 = next(c for c in result.claims if c["id"] == "D2")
    assert d2["verdict"] == "partly", d2["evidence"]
    assert "not worse on every seed" in d2["evidence"] and "compare_grads exact: True" in d2["evidence"]
