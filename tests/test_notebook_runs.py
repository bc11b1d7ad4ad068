"""The notebook tests' device logic holds on a machine with GPUs: they still run on the CPU.

`torch.cuda.is_available()` is patched to True (and two devices reported), as on a GPU runner."""

import ast
from pathlib import Path

import pytest
import torch
from notebook_runs import TEST_DEVICE, cpu_parameters

from labkit import repro

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_on_a_gpu_machine_auto_would_pick_the_gpu_so_the_tests_pin_the_cpu(gpu_machine):
    assert repro.pick_device("auto").type == "cuda"
    parameters = cpu_parameters({"seed": 1, "bug": True})
    assert parameters == {"seed": 1, "bug": True, "device": TEST_DEVICE}
    assert repro.pick_device(parameters["device"]).type == "cpu"


def test_a_notebook_test_asking_for_a_gpu_is_refused(gpu_machine):
    with pytest.raises(ValueError, match="GPU-runner test"):
        cpu_parameters({"device": "cuda"})


def _calls(tree: ast.AST) -> set[str]:
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("test_file", sorted(TESTS.glob("test_nb[0-9][0-9]_*.py")), ids=lambda p: p.stem)
def test_every_notebook_test_runs_its_notebook_through_run_on_cpu(test_file):
    calls = _calls(ast.parse(test_file.read_text()))
    assert "run_on_cpu" in calls
    assert not {call for call in calls if call.endswith("run_notebook")}, "use run_on_cpu, not run_notebook"
