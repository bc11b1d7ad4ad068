"""11_compile_drift under papermill: the article's `module._compiled = False` leaves the module in
the captured graph; `torch.compiler.disable` takes it out. The runs use backend="aot_eager", which
captures the same graphs as inductor without generating and building C++, to stay fast."""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "11_compile_drift.ipynb"
SMALL = {"seed": 1, "backend": "aot_eager", "hidden": 16, "drift_steps": 40}


@pytest.mark.parametrize("bug", [True, False])
def test_the_compiled_flag_keeps_the_head_in_the_graph_only_with_the_bug(tmp_path, bug):
    result = run_on_cpu(NOTEBOOK, tmp_path, {**SMALL, "bug": bug})
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts == {"H4": "holds", "H1": "does-not-hold", "H2": "partly", "H3": "needs-gpu"}
    assert result.metrics["head_ops_captured"] == (1 if bug else 0)
