"""13_memory under papermill with other parameters: adding validation-loss tensors into a running
total keeps one validation graph alive per step only with the bug; the memory verdicts do not depend
on the bug switch. K8's verdict follows the calculator: ResNet-50 at batch 8 is a sliver of an 80 GB
A100, at batch 640 most of one. (K3 to K7 are in 16_speed_and_memory, tests/test_nb16_speed_and_memory.py.)"""

from pathlib import Path

import pytest
from notebook_runs import run_on_cpu

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "13_memory.ipynb"
pytestmark = pytest.mark.lock_only
SMALL = {"seed": 2, "k1_batches": [1, 64], "vit_batches": [1], "validation_rows": 128, "validation_steps": 3}


@pytest.mark.parametrize(("bug", "resnet_batch", "k8"), [(True, 8, "does-not-hold"), (False, 640, "partly")])
def test_running_loss_tensor_keeps_graphs_alive_only_with_the_bug(tmp_path, bug, resnet_batch, k8):
    result = run_on_cpu(NOTEBOOK, tmp_path, {**SMALL, "bug": bug, "resnet_batch": resnet_batch})
    assert result.status == "ok", result.error
    verdicts = {c["id"]: c["verdict"] for c in result.claims}
    assert verdicts["K2"] == "does-not-hold"
    assert verdicts["K1"] == "partly"
    assert set(verdicts) == {"K1", "K2", "K8"}
    assert verdicts["K8"] == k8
    k8_evidence = next(c["evidence"] for c in result.claims if c["id"] == "K8")
    assert f"at batch {resnet_batch}," in k8_evidence
    if bug:
        assert result.metrics["held_graph_nodes"] > 3 * 10
        assert result.metrics["held_bytes_per_step"] > 128 * 256 * 4
    else:
        assert result.metrics["held_graph_nodes"] == 0
        assert result.metrics["held_bytes_per_step"] == 0
