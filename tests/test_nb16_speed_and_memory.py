"""16_speed_and_memory under papermill with other parameters: the verdicts that need no GPU come from
exact counts, not from the sizes. K4 is `partly` (checkpointing whole blocks keeps a fraction of the
memory, with the same gradients; the article's own fx pass fails) for a shallower, narrower stack, and
`does-not-hold` when a one-row input makes each block's activations smaller than the RNG state
checkpoint copies per call;
K7 stays `does-not-hold`; the GPU-only cases record `needs-gpu` on a CPU."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "16_speed_and_memory.ipynb"
pytestmark = pytest.mark.lock_only
SMALL = {"seed": 2, "ffn_blocks": 3, "ffn_width": 64, "attention_lengths": [64, 256]}
# 64 floats a row: a block keeps a few hundred bytes of activations, a checkpoint call ~5 kB of RNG state
ONE_ROW = {**SMALL, "ffn_rows": 1}


def run(tmp_path, parameters):
    """The run's result, its verdicts and its evidence, by case ID."""
    result = run_on_cpu(NOTEBOOK, tmp_path, parameters)
    assert result.status == "ok", result.error
    return (result, {c["id"]: c["verdict"] for c in result.claims},
            {c["id"]: c["evidence"] for c in result.claims})


def test_checkpointing_and_memory_summary_verdicts_hold_at_other_sizes(tmp_path):
    result, verdicts, evidence = run(tmp_path, SMALL)
    assert verdicts["K4"] == "partly"
    assert verdicts["K7"] == "does-not-hold"
    assert verdicts["K3"] == verdicts["K5"] == verdicts["K6"] == "needs-gpu"
    # checkpointing whole blocks keeps their inputs, not their insides: well under half the memory
    assert 0 < result.metrics["checkpointed_blocks_memory_ratio"] < 0.5
    assert "fail with TypeError" in evidence["K4"] and "with the same gradients" in evidence["K4"]
    assert "none about weight decay" in evidence["K7"] and "is the same" in evidence["K7"]
    assert "at 64" in evidence["K6"] and "at 256" in evidence["K6"]


def test_checkpointing_keeps_more_than_it_frees_on_a_one_row_input(tmp_path):
    result, verdicts, evidence = run(tmp_path, ONE_ROW)
    assert verdicts["K4"] == "does-not-hold"
    assert verdicts["K7"] == "does-not-hold"
    # the RNG-state copies, one per checkpointed block, outweigh the activations checkpointing frees
    assert result.metrics["checkpointed_blocks_memory_ratio"] > 1
    assert "3 RNG states" in evidence["K4"] and "with the same gradients" in evidence["K4"]
