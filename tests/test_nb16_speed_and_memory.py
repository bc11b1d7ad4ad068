"""16_speed_and_memory under papermill with other parameters: the verdicts that need no GPU come from
exact counts, not from the sizes. K4 stays `partly` (the article's fx pass fails, checkpointing whole
blocks keeps a fraction of the memory) for a shallower, narrower stack; K7 stays `does-not-hold`;
the GPU-only cases record `needs-gpu` on a CPU."""

from pathlib import Path

from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "16_speed_and_memory.ipynb"
SMALL = {"seed": 2, "ffn_blocks": 3, "ffn_width": 64, "attention_lengths": [64, 256]}


def test_checkpointing_and_memory_summary_verdicts_hold_at_other_sizes(tmp_path):
    result = run_on_cpu(NOTEBOOK, tmp_path, SMALL)
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts["K4"] == "partly"
    assert verdicts["K7"] == "does-not-hold"
    assert verdicts["K3"] == verdicts["K5"] == verdicts["K6"] == "needs-gpu"
    # checkpointing whole blocks keeps their inputs, not their insides: well under half the memory
    assert 0 < result.metrics["checkpointed_blocks_memory_ratio"] < 0.5
    k6_evidence = next(c["evidence"] for c in result.claims if c["id"] == "K6")
    assert "at 64" in k6_evidence and "at 256" in k6_evidence
