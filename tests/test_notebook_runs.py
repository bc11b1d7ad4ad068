"""The notebook tests' device logic holds on a machine with GPUs: they still run on the CPU; and a
session runs each notebook once per parameters.

`torch.cuda.is_available()` is patched to True (and two devices reported), as on a GPU runner."""

import ast
import json
from pathlib import Path

import notebook_runs
import pytest
import torch
from notebook_runs import TEST_DEVICE, cpu_parameters, run_on_cpu

from labkit import devices, runner

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_on_a_gpu_machine_auto_would_pick_the_gpu_so_the_tests_pin_the_cpu(gpu_machine):
    assert devices.resolve_device("auto").type == "cuda"
    parameters = cpu_parameters({"seed": 1, "bug": True})
    assert parameters == {"seed": 1, "bug": True, "device": TEST_DEVICE}
    assert devices.resolve_device(parameters["device"]).type == "cpu"


def test_a_notebook_test_asking_for_a_gpu_is_refused(gpu_machine):
    with pytest.raises(ValueError, match="GPU-runner test"):
        cpu_parameters({"device": "cuda"})


def _calls(tree: ast.AST) -> set[str]:
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


# A notebook test runs its notebook through run_on_cpu itself, or through run_student_edition_on_cpu (its
# fixed side on the student edition), which calls run_on_cpu; reading the committed run (stored_run) runs nothing.
CPU_RUNNERS = {"run_on_cpu", "run_student_edition_on_cpu"}


def test_the_student_edition_runner_pins_the_cpu_too():
    tree = ast.parse((TESTS / "notebook_runs.py").read_text())
    [function] = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                  and node.name == "run_student_edition_on_cpu"]
    assert "run_on_cpu" in _calls(function)


@pytest.mark.parametrize("test_file", sorted(TESTS.glob("test_nb[0-9][0-9]_*.py")), ids=lambda p: p.stem)
def test_every_notebook_test_runs_its_notebook_through_run_on_cpu(test_file):
    calls = _calls(ast.parse(test_file.read_text()))
    assert calls & CPU_RUNNERS, f"{test_file.name} runs no notebook through {sorted(CPU_RUNNERS)}"
    assert not {call for call in calls if call.endswith("run_notebook")}, "use run_on_cpu, not run_notebook"


def test_a_second_identical_run_is_a_copy_and_reuse_false_or_a_changed_notebook_goes_to_the_kernel(
        make_notebook, tmp_path, monkeypatch):
    runs_log = tmp_path / "runs.log"
    notebook = make_notebook("counts_its_runs", 'device = "cpu"\nlog = ""',
                             'from pathlib import Path\nwith Path(log).open("a") as f:\n    f.write("ran\\n")')
    parameters = {"log": str(runs_log)}
    first = run_on_cpu(notebook, tmp_path / "first", parameters)
    second = run_on_cpu(notebook, tmp_path / "second", parameters)
    assert first.status == second.status == "ok", (first.error, second.error)
    assert runs_log.read_text() == "ran\n"
    assert second.output == str((tmp_path / "second" / notebook.name).resolve())
    assert Path(second.output).read_bytes() == Path(first.output).read_bytes()
    assert json.loads((tmp_path / "second" / "counts_its_runs.result.json").read_text())["output"] == second.output

    # Whether run_on_cpu serves a copy or hands the run to the shared kernel is its whole decision, so from here
    # the kernel's runner only records what it is handed: a run would prove no more than the real run above did.
    handed = []

    def recording_runner(notebook, out_dir, parameters, timeout):
        handed.append((Path(notebook), Path(out_dir), parameters, Path(notebook).read_text()))
        return runner.RunResult(Path(notebook).stem, "failed", 0.0, "", parameters, "recorded, not run")

    monkeypatch.setattr(notebook_runs.SESSION_KERNEL, "run", recording_runner)
    fresh = run_on_cpu(notebook, tmp_path / "fresh", parameters, reuse=False)
    notebook.write_text(notebook.read_text().replace("ran", "ran again"))
    changed = run_on_cpu(notebook, tmp_path / "changed", parameters)
    assert fresh.error == changed.error == "recorded, not run", "a copy was served instead of a run"
    cpu = {**parameters, "device": TEST_DEVICE}
    assert [(path, out, given) for path, out, given, _ in handed] == [
        (notebook, tmp_path / "fresh", cpu), (notebook, tmp_path / "changed", cpu)]
    assert "ran again" not in handed[0][3] and "ran again" in handed[1][3], "the changed notebook was handed over"
    assert runs_log.read_text() == "ran\n", "only the first run executed the notebook"


def test_a_run_is_the_same_run_in_every_test(make_notebook, monkeypatch):
    # The kernel counter names the running test in the environment (tests/conftest.py); a run two tests ask
    # for must still be paid once.
    notebook = make_notebook("same", 'device = "cpu"', "print(1)")
    keys = []
    for test in ("tests/test_a.py::one", "tests/test_b.py::two"):
        monkeypatch.setenv("LABKIT_KERNEL_TEST", test)
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{test} (call)")
        keys.append(notebook_runs._run_key(notebook, {"device": "cpu"}))
    assert keys[0] == keys[1]
    monkeypatch.setenv("LABKIT_SOMETHING_ELSE", "1")  # any other variable still makes another run
    assert notebook_runs._run_key(notebook, {"device": "cpu"}) != keys[0]
