"""How the notebook tests run a notebook: under papermill, always on the CPU.

The papermill tests (tests/test_nbNN_*.py) assert CPU behaviour: exact verdicts such as
`needs-gpu` for a GPU-only case. Left at `device="auto"`, a notebook on a CUDA machine would pick
the GPU and those tests would fail there, so every run goes through `run_on_cpu`, which refuses a
test that asks for another device. GPU behaviour is the GPU runner's job (`make test-gpu`).

A papermill run costs a kernel start and a torch import (several seconds) before the notebook's own
work. The session's runs therefore share one kernel, reset between runs to what a fresh kernel gives a
notebook (tests/shared_kernel.py, proved by tests/test_shared_kernel.py), and one pytest session runs
each notebook once per set of parameters: a second `run_on_cpu`
with the same notebook file (same bytes), parameters and environment gets a copy of the first
successful run, its folder copied into the new `out_dir`. Several test files can therefore ask for
the same run and pay once; `reuse=False` forces a fresh run (a test about running itself).

Each tests/test_nbNN_*.py runs its fixed side (bug=False) on the notebook's student edition (the
`student_editions` session fixture) through `run_student_edition_on_cpu`, which also asserts what a
learner's first Run All must show: no error, every check "not attempted", a score of 0/N. One run
proves the edition and the fixed verdicts, where test_student used to run all 17 editions again.

Where a test's bug side differs from the notebook's defaults only in sizes and seed, it reads the
committed notebook's own run instead (`stored_run`): the claims and metrics its stored outputs hold,
made on a CPU at the defaults. nbval, in the same `make test`, re-executes every notebook at the
defaults and compares those outputs, so they are what the code computes; but only the outputs of the
cells it compares. A cell tagged `nbval-ignore-output` (a timing, a machine-dependent or GPU-only
result) or `nbval-skip` is re-executed without comparison or not at all, so a stale value there would
pass: `stored_run` leaves its claims and metrics out, and a test that needs one runs that side fresh.
A knob the bug side set away from its default stays on a papermill run (or moves to the fixed side),
never to the stored run.
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

import nbformat
from shared_kernel import SESSION_KERNEL

from labkit import _notebook_meta, runner, student
from labkit.course import exercise_progress
from labkit.parameters import declared_parameters
from labkit.records import CLAIM_MIME, METRIC_MIME, read_notebook_json, stored_records

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
    """A papermill run in the session's shared kernel (tests/shared_kernel.py) with the device pinned to
    the CPU, whatever this machine has; a case that needs a GPU must say `needs-gpu` there. With `reuse`,
    a run this session already made with the same notebook, parameters and environment is copied into
    `out_dir` instead of run again."""
    parameters = cpu_parameters(parameters)
    key = _run_key(Path(notebook), parameters)
    if reuse and key in _FINISHED and _is_new_or_empty(Path(out_dir)):
        return _copy_of(_FINISHED[key], Path(out_dir))
    result = SESSION_KERNEL.run(notebook, out_dir, parameters, timeout=timeout)
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
# Variables that change from test to test and do not reach what a notebook computes: pytest's own, and the
# kernel counter's (tests/conftest.py names each test in LABKIT_KERNEL_TEST). Left in the key, they would
# make every test's run a new one, and a run two tests ask for would be paid twice.
_PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})
_PER_TEST_PREFIX = "LABKIT_KERNEL_"


def _run_key(notebook: Path, parameters: dict) -> tuple:
    """What decides a run's outcome: the notebook's bytes, its parameters, the environment the kernel inherits."""
    environment = sorted((k, v) for k, v in os.environ.items()
                         if k not in _PER_TEST_VARIABLES and not k.startswith(_PER_TEST_PREFIX))
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


def run_student_edition_on_cpu(edition: Path, source: Path, out_dir: Path, parameters: dict, timeout: float = 300):
    """`run_on_cpu` of `edition`, the student edition of the workbook notebook `source` (a copy of it that
    a test changed counts too), asserting that it ran as a learner's untouched edition must.

    The edition stubs every solution with `raise NotImplementedError`: its run fails wherever a cell
    other than the exercise's own check calls a stubbed function, so a run that is "ok" proves that none
    does at these parameters."""
    result = run_on_cpu(edition, out_dir, parameters, timeout)
    assert result.status == "ok", result.error
    executed = nbformat.read(result.output, as_version=4)
    assert executed.metadata.get("labkit", {}).get("edition") == "student", f"{edition} is not a student edition"
    # papermill puts its cell right after the tagged parameters cell; anywhere else the defaults would win
    tagged = [index for index, cell in enumerate(executed.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{edition.name}: {len(tagged)} cells tagged parameters"
    assert "injected-parameters" in executed.cells[tagged[0] + 1].metadata.get("tags", [])
    errors = [output for cell in executed.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert errors == []
    exercise_ids = list(student.find_exercises(nbformat.read(source, as_version=4), source.name))
    assert exercise_ids, f"{source.name} has no exercise"
    checked = []
    for cell in executed.cells:
        if cell.cell_type != "code":
            continue
        for exercise_id in [match.group(1) for match in student.CHECK_CALL.finditer(cell.source)]:
            checked.append(exercise_id)
            assert f"✗ Exercise {exercise_id} not yet: " in cell_text(cell)
            assert "is not attempted yet" in cell_text(cell)
    assert sorted(checked) == sorted(exercise_ids)
    score = next(cell for cell in executed.cells if cell.source.strip() == "grading.score()")
    assert f"0/{len(exercise_ids)} exercises passed" in cell_text(score)
    rows = {row.exercise: row.status for row in exercise_progress.course_progress(Path(result.output).parent)}
    assert {eid: rows[eid] for eid in exercise_ids} == dict.fromkeys(exercise_ids, exercise_progress.NOT_YET)
    return result


def cell_text(cell: nbformat.NotebookNode) -> str:
    """What a code cell printed and displayed, as text."""
    texts = [output.get("text", "") for output in cell.outputs if output.output_type == "stream"]
    texts += [output.data.get("text/plain", "") for output in cell.outputs if "data" in output]
    return "".join(texts)


def default_parameters(notebook: Path) -> dict:
    """The defaults the notebook's tagged parameters cell declares."""
    [cell] = [cell for cell in nbformat.read(notebook, as_version=4).cells
              if "parameters" in cell.metadata.get("tags", [])]
    return {name: parameter.default for name, parameter in declared_parameters(cell.source, notebook.name).items()}


# How nbval (run by `make test` as `--nbval`, not `--nbval-lax`) marks a cell, by tag or by a `# NBVAL_...`
# comment line (a comment wins over a tag): each marker sets one option, as nbval.plugin's
# `comment_markers` and `metadata_tags` do. `check`: its outputs are compared (the default under
# --nbval); `skip`: it is not executed. `check_exception` (raises-exception) lets the cell raise and
# still compares its outputs, so it changes nothing here.
NBVAL_MARKERS: dict[str, tuple[str, bool]] = {
    "NBVAL_IGNORE_OUTPUT": ("check", False),
    "PYTEST_VALIDATE_IGNORE_OUTPUT": ("check", False),
    "NBVAL_CHECK_OUTPUT": ("check", True),
    "NBVAL_RAISES_EXCEPTION": ("check_exception", True),
    "NBVAL_SKIP": ("skip", True),
}
NBVAL_TAGS: dict[str, tuple[str, bool]] = {
    **{marker.lower().replace("_", "-"): option for marker, option in NBVAL_MARKERS.items()},
    "raises-exception": ("check_exception", True),
}
NOT_COMPARED = "recorded in a cell nbval does not compare; run it fresh"


def nbval_compares(cell: dict) -> bool:
    """Whether nbval, run as `make test` runs it, compares this cell's stored outputs with a fresh run."""
    return not why_nbval_does_not_compare(cell)


def why_nbval_does_not_compare(cell: dict) -> str:
    """Why nbval does not compare this cell's stored outputs ("" when it does): not a code cell, never run
    (nbval compares no unrun cell), skipped, or its output ignored, by tag or by comment."""
    if cell.get("cell_type") != "code":
        return "not a code cell"
    if cell.get("execution_count") is None:
        return "the cell was never run"
    tags = cell.get("metadata", {}).get("tags", [])
    found = {}  # option -> (value, the tag or comment that set it); the last one wins, a comment over a tag
    for tag in tags if isinstance(tags, list) else []:
        if tag in NBVAL_TAGS:
            found[NBVAL_TAGS[tag][0]] = (NBVAL_TAGS[tag][1], f"tagged {tag}")
    source = cell.get("source", "")
    for line in ("".join(source) if isinstance(source, list) else source).splitlines():
        comment = line.strip().lstrip("#").strip() if line.strip().startswith("#") else ""
        if comment in NBVAL_MARKERS:
            found[NBVAL_MARKERS[comment][0]] = (NBVAL_MARKERS[comment][1], f"marked # {comment}")
    for option, value in (("skip", True), ("check", False)):
        if option in found and found[option][0] is value:
            return found[option][1]
    return ""


class StoredClaims(list):
    """The claim records of the cells nbval compares; `not_compared` maps each left-out claim's ID to why."""

    def __init__(self, *records, not_compared: dict[str, str] | None = None):
        super().__init__(*records)
        self.not_compared = dict(not_compared or {})


class StoredMetrics(dict):
    """The metrics of the cells nbval compares. Reading one recorded in a cell it does not compare is a
    KeyError that says so, `get` included (its stored value is not proven fresh, so no default stands in)."""

    def __init__(self, *args, not_compared: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.not_compared = dict(not_compared or {})

    def __missing__(self, name):
        if name in self.not_compared:
            raise KeyError(f"metric {name!r}: {self.not_compared[name]}")
        raise KeyError(name)

    def get(self, name, default=None):
        if name in self.not_compared and name not in self:
            return self[name]
        return super().get(name, default)


def stored_records_nbval_compares(notebook: Path, mime: str) -> tuple[list[dict], dict[str, str]]:
    """The records of one mimetype in the cells nbval compares (as `stored_records` reads them), and, for the
    records of the cells it does not, each one's ID or name -> why it is left out."""
    everything = stored_records(notebook, mime)  # the shape checks and the `notebook` key
    reasons = [why_nbval_does_not_compare(cell) for cell in read_notebook_json(notebook)["cells"]
               for output in cell.get("outputs", [])
               if isinstance(output.get("data"), dict) and output["data"].get(mime) is not None]
    assert len(reasons) == len(everything), f"{notebook.name}: its {mime} records read two ways disagree"
    key = "id" if mime == CLAIM_MIME else "name"
    compared = [record for record, reason in zip(everything, reasons) if not reason]
    left_out = {str(record.get(key)): f"{notebook.name}: {NOT_COMPARED} ({reason})"
                for record, reason in zip(everything, reasons) if reason}
    return compared, left_out


def stored_run(notebook: Path) -> runner.RunResult:
    """The committed notebook's own run at its defaults, shaped as `run_on_cpu`'s result: the claims and
    metrics that the stored outputs of the cells nbval compares hold, and the default parameters. No
    kernel: nbval proves these outputs fresh in the same `make test`. The records of a cell it does not
    compare are left out (`StoredClaims.not_compared`, `StoredMetrics`: reading such a metric is a KeyError
    saying why); a test that needs one runs that side fresh. The GPU-only cases must say `needs-gpu` in
    every stored output, as on any CPU run."""
    every_claim = [{key: record.get(key) for key in ("id", "verdict", "evidence")}
                   for record in stored_records(notebook, CLAIM_MIME)]
    measured_anyway = {c["id"]: c["verdict"] for c in every_claim
                       if c["id"] in NEEDS_A_GPU_ON_CPU and c["verdict"] != "needs-gpu"}
    assert not measured_anyway, f"{notebook.name}'s stored outputs give GPU-only verdicts {measured_anyway}: not a CPU run"
    claim_records, claims_left_out = stored_records_nbval_compares(notebook, CLAIM_MIME)
    metric_records, metrics_left_out = stored_records_nbval_compares(notebook, METRIC_MIME)
    claims = StoredClaims(({key: record.get(key) for key in ("id", "verdict", "evidence")}
                           | {"measured": record.get("measured", {})} for record in claim_records),
                          not_compared=claims_left_out)
    metrics = StoredMetrics({record["name"]: record["value"] for record in metric_records}, not_compared=metrics_left_out)
    return runner.RunResult(notebook.stem, "ok", 0.0, str(notebook), default_parameters(notebook), "", claims, metrics)
