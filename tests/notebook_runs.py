"""How the notebook tests run a notebook: under papermill, always on the CPU.

The papermill tests (tests/test_nbNN_*.py) assert CPU behaviour: exact verdicts such as
`needs-gpu` for a GPU-only case. Left at `device="auto"`, a notebook on a CUDA machine would pick
the GPU and those tests would fail there, so every run goes through `run_on_cpu`, which refuses a
test that asks for another device. GPU behaviour is the GPU runner's job (`make test-gpu`).

A papermill run costs a kernel start and a torch import (several seconds) before the notebook's own
work, so one pytest session runs each notebook once per set of parameters: a second `run_on_cpu`
with the same notebook file (same bytes), parameters and environment gets a copy of the first
successful run, its folder copied into the new `out_dir`. Several test files can therefore ask for
the same run and pay once; `reuse=False` forces a fresh run (a test about running itself).
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from labkit import _notebook_meta, runner

TEST_DEVICE = "cpu"
# The cases a CPU run cannot measure: on the CPU their verdict is exactly `needs-gpu`, never a
# verdict computed from something else. (GPU-only catalogue cases such as J2 that a CPU does
# measure are not here.) Each notebook lists its own as `needs_gpu_on_cpu` in its metadata block,
# notebooks/meta/NN_name.toml.
NEEDS_A_GPU_ON_CPU: frozenset[str] = _notebook_meta.needs_a_gpu_on_cpu()


def cpu_parameters(parameters: dict) -> dict:
    """The parameters with `device` pinned to the CPU; a test asking for another device is a mistake."""
    asked = parameters.get("device", TEST_DEVICE)
    if asked != TEST_DEVICE:
        raise ValueError(f"notebook tests run on the CPU; device={asked!r} belongs in a GPU-runner test")
    return {**parameters, "device": TEST_DEVICE}


def run_on_cpu(notebook: Path, out_dir: Path, parameters: dict, timeout: float = 300, reuse: bool = True):
    """`runner.run_notebook` with the device pinned to the CPU, whatever this machine has; a case
    that needs a GPU must say `needs-gpu` there. With `reuse`, a run this session already made with
    the same notebook, parameters and environment is copied into `out_dir` instead of run again."""
    parameters = cpu_parameters(parameters)
    key = _run_key(Path(notebook), parameters)
    if reuse and key in _FINISHED and _is_new_or_empty(Path(out_dir)):
        return _copy_of(_FINISHED[key], Path(out_dir))
    result = runner.run_notebook(notebook, out_dir, parameters, timeout=timeout)
    if result.status == "ok":
        measured_anyway = {c["id"]: c["verdict"] for c in result.claims
                           if c["id"] in NEEDS_A_GPU_ON_CPU and c["verdict"] != "needs-gpu"}
        assert not measured_anyway, f"{Path(notebook).name} on the CPU gave GPU-only verdicts {measured_anyway}"
        _FINISHED[key] = _keep(result, Path(out_dir))
    return result


# Successful runs of this session: key -> (result, a snapshot of its folder that later tests cannot touch).
_FINISHED: dict[tuple, tuple] = {}
_SNAPSHOTS = Path(tempfile.mkdtemp(prefix="labkit-test-runs-"))
atexit.register(shutil.rmtree, _SNAPSHOTS, ignore_errors=True)
# Variables pytest changes from test to test; they do not reach what a notebook computes.
_PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


def _run_key(notebook: Path, parameters: dict) -> tuple:
    """What decides a run's outcome: the notebook's bytes, its parameters, the environment the kernel inherits."""
    environment = sorted((k, v) for k, v in os.environ.items() if k not in _PER_TEST_VARIABLES)
    return (str(notebook.resolve()), hashlib.sha256(notebook.read_bytes()).hexdigest(),
            json.dumps(parameters, sort_keys=True, default=repr), json.dumps(environment))


def _is_new_or_empty(folder: Path) -> bool:
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def _keep(result, out_dir: Path) -> tuple:
    snapshot = Path(tempfile.mkdtemp(dir=_SNAPSHOTS))
    shutil.copytree(out_dir, snapshot, symlinks=True, dirs_exist_ok=True)
    return copy.deepcopy(result), snapshot


def _copy_of(finished: tuple, out_dir: Path):
    """The kept run, as if it had run in `out_dir`: its files copied there, its paths pointing there."""
    result, snapshot = finished
    shutil.copytree(snapshot, out_dir, symlinks=True, dirs_exist_ok=True)
    result = copy.deepcopy(result)
    result.output = str(out_dir.resolve() / Path(result.output).name)
    (out_dir / f"{result.notebook}.result.json").write_text(json.dumps(asdict(result), indent=2))
    return result
