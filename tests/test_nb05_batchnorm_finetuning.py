"""05_batchnorm_finetuning under papermill with other parameters: the planted bug's symptom comes and goes.

The planted bug leaves the frozen backbone in train mode while the head trains: its BatchNorm running
means drift towards the fine-tuning batches, and at batch size 2 the head's test accuracy drops.

`bug` only picks which of two fine-tunings the reproduction reports (`eval_acc`, `running_mean_drift`):
the backbone in train mode (`all_train`) or in eval mode (`all_eval`). Case D2's grid runs both at the
notebook's batch size and seeds whatever `bug` says, and `train_mode_cost` is their difference on the
first seed. So the fixed run (the student edition, at batch 2 on seed 1) also holds what the bug side
computed at the same settings: train mode's accuracy (`eval_acc - train_mode_cost`) and its running-mean
drift (D2's measured values; with one seed it is that seed's run). That the switch picks train mode is read
from the committed notebook's stored run at its defaults (bug=True; tests/notebook_runs.py,
`stored_run`; nbval proves it fresh in the same `make test`): its reproduction's running means moved,
which only train mode does. Its batch 4 is not where train mode's cost shows on seed 0 (0.45 points, the
notebook's own prose says to read the seeds' mean), so there the cost is read as the notebook reports
it, over its seeds.
"""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu, run_student_edition_on_cpu, stored_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_batchnorm_finetuning.ipynb"
pytestmark = pytest.mark.lock_only
# Small, non-default settings: one seed, batch size 2 (where train mode hurts most), shorter runs.
PARAMETERS = {"seed": 1, "seeds": 1, "batch_size": 2, "pretrain_steps": 200, "finetune_steps": 150}
# D2: the largest running-mean drift of the train-mode fine-tunings at the notebook's batch size.
TRAIN_MODE_DRIFT = "headline form's running-mean drift (std)"
# D4: eval-mode accuracy minus train-mode accuracy, keyed by batch and by how many seeds it is the mean of.
TRAIN_MODE_COST = "accuracy lost in train mode"


def measured(result, claim_id: str) -> dict:
    return next(claim["measured"] for claim in result.claims if claim["id"] == claim_id)


@pytest.mark.parametrize("bug", [True, False])
def test_train_mode_backbone_drifts_and_loses_accuracy_only_with_the_bug(tmp_path, student_editions, bug):
    if bug:  # the notebook's default: its stored run
        result = stored_run(NOTEBOOK)
        assert result.parameters["bug"] is True
    else:  # the fix, on the student edition: it also runs as a learner's untouched edition must
        result = run_student_edition_on_cpu(student_editions[NOTEBOOK], NOTEBOOK, tmp_path, dict(PARAMETERS, bug=bug))
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts == {"D1": "does-not-hold", "D2": "does-not-hold", "D3": "does-not-hold", "D4": "holds"}
    metrics = result.metrics
    if bug:
        # The reproduction's running means moved: the switch fine-tuned with the backbone in train mode.
        assert metrics["running_mean_drift"] > 0.1
        # Train mode costs accuracy over the seeds at batch 2 (D4), and on this seed at the defaults' batch.
        seeds = result.parameters["seeds"]
        assert seeds > 1
        cost_percent = measured(result, "D4")[TRAIN_MODE_COST][f"batch 2, mean of {seeds} seeds"]
        assert float(cost_percent.rstrip("%")) > 5
        assert metrics["train_mode_cost"] > 0
    else:
        assert metrics["running_mean_drift"] == 0
        assert metrics["eval_acc"] > metrics["eval_acc_recalibrated"] - 0.05
        # What bug=True reports at these settings, measured beside the fix: train mode at batch 2 on this
        # seed drifts and loses accuracy (train_mode_cost: eval-mode minus train-mode accuracy, this seed).
        assert metrics["train_mode_cost"] > 0.05
        train_mode_acc = metrics["eval_acc"] - metrics["train_mode_cost"]
        assert train_mode_acc < metrics["eval_acc_recalibrated"] - 0.05
        assert measured(result, "D2")[TRAIN_MODE_DRIFT] > 0.1


def test_headline_remedy_verdict_follows_the_paired_accuracy(tmp_path):
    """D2 both ways: at batch 2 (above) the headline remedy, BatchNorm left in train mode with frozen
    weights, is worse than all-eval and D2 does not hold; at batch 64 on seed 0 it is not worse, so
    the remedy only equals eval mode (the precise variant, bit for bit) and D2 is partly."""
    result = run_on_cpu(NOTEBOOK, tmp_path, {"seed": 0, "seeds": 1, "batch_size": 64, "bug": False})
    assert result.status == "ok", result.error
    d2 = next(c for c in result.claims if c["id"] == "D2")
    assert d2["verdict"] == "partly", d2["evidence"]
    headline_minus_eval = d2["measured"]["headline form minus all-eval, per seed"]
    assert not all(gain.startswith("-") for gain in headline_minus_eval), "not worse on every seed"
    assert d2["measured"]["precise form is all-eval bit for bit"] is True
