"""How the notebook tests run a notebook: under papermill, always on the CPU.

The papermill tests (tests/test_nbNN_*.py) assert CPU behaviour: exact verdicts such as
`needs-gpu` for a GPU-only case. Left at `device="auto"`, a notebook on a CUDA machine would pick
the GPU and those tests would fail there, so every run goes through `run_on_cpu`, which refuses a
test that asks for another device. GPU behaviour is the GPU runner's job (`make test-gpu`).
"""

from __future__ import annotations

from pathlib import Path

from labkit import runner

TEST_DEVICE = "cpu"
# The cases a CPU run cannot measure: on the CPU their verdict is exactly `needs-gpu`, never a
# verdict computed from something else. (GPU-only catalogue cases such as J2 that a CPU does
# measure are not here.)
NEEDS_A_GPU_ON_CPU = frozenset({"A2", "B5", "H3", "J1", "J4", "K3", "K5", "K6", "N5", "O2"})


def cpu_parameters(parameters: dict) -> dict:
    """The parameters with `device` pinned to the CPU; a test asking for another device is a mistake."""
    asked = parameters.get("device", TEST_DEVICE)
    if asked != TEST_DEVICE:
        raise ValueError(f"notebook tests run on the CPU; device={asked!r} belongs in a GPU-runner test")
    return {**parameters, "device": TEST_DEVICE}


def run_on_cpu(notebook: Path, out_dir: Path, parameters: dict, timeout: float = 300):
    """`runner.run_notebook` with the device pinned to the CPU, whatever this machine has; a case
    that needs a GPU must say `needs-gpu` there."""
    result = runner.run_notebook(notebook, out_dir, cpu_parameters(parameters), timeout=timeout)
    if result.status == "ok":
        measured_anyway = {c["id"]: c["verdict"] for c in result.claims
                           if c["id"] in NEEDS_A_GPU_ON_CPU and c["verdict"] != "needs-gpu"}
        assert not measured_anyway, f"{notebook.name} on the CPU gave GPU-only verdicts {measured_anyway}"
    return result
