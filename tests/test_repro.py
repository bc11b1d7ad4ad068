"""labkit.repro (devices, seeding) and labkit.runner (parameter validation, runs that fail clearly, sweeps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labkit
from labkit import LabkitError, _version, repro, runner
from labkit.devices import resolve_device

REPO = Path(__file__).resolve().parents[1]

PARAMS = 'seed = 0\ndevice = "auto"\nsteps = 3\nlr = 0.1\nbug = False'


def test_auto_device_is_cpu_without_cuda_and_cuda_is_refused_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for CPU-only machines")
    assert resolve_device("auto").type == "cpu" and repro.setup(device="auto").type == "cpu"
    with pytest.raises(LabkitError, match="no CUDA device.*device='auto'"):
        repro.setup(device="cuda")
    with pytest.raises(LabkitError, match="no CUDA device"):
        resolve_device("cuda:1")
    with pytest.raises(LabkitError, match="unknown device 'gpu': use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"):
        resolve_device("gpu")


def test_mps_is_refused_naming_what_the_machine_has_unless_torch_reports_it():
    if torch.backends.mps.is_available():
        assert resolve_device("mps").type == "mps"
        return
    with pytest.raises(LabkitError, match="no MPS device.*this machine has cpu"):
        resolve_device("mps")


def test_auto_never_picks_mps_but_mps_asked_for_is_given(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")  # MPS has no float64, which notebooks use
    assert resolve_device("mps") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_a_caller_can_narrow_the_kinds_and_keep_a_missing_cuda_device():
    assert resolve_device("cuda:3", kinds=("cpu", "cuda"), must_exist=False) == torch.device("cuda:3")
    with pytest.raises(LabkitError, match="not supported here: use 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("mps", kinds=("cpu", "cuda"))
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_setup_makes_random_streams_repeat():
    repro.setup(seed=7, device="cpu")
    first = torch.randn(4)
    repro.setup(seed=7, device="cpu")
    assert torch.equal(first, torch.randn(4))
    with pytest.raises(LabkitError, match="non-negative int"):
        repro.setup(seed=-1)


def test_fastest_kernels_lifts_deterministic_mode_and_restores_it_even_on_error():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        repro.setup(seed=0, device="cpu")
        assert torch.are_deterministic_algorithms_enabled()
        with pytest.raises(ZeroDivisionError), repro.fastest_kernels():
            assert not torch.are_deterministic_algorithms_enabled()
            1 / 0
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_parameters_are_read_from_the_tagged_cell(make_notebook):
    nb = make_notebook("p", PARAMS, "print(steps)")
    assert runner.notebook_parameters(nb) == {"seed": 0, "device": "auto", "steps": 3, "lr": 0.1, "bug": False}


def test_unknown_parameter_lists_the_allowed_ones(make_notebook):
    nb = make_notebook("p", PARAMS, "print(steps)")
    with pytest.raises(LabkitError, match=r"no parameter stpes; allowed: seed \(default 0\), device"):
        runner.validate_parameters(nb, {"stpes": 5})


@pytest.mark.parametrize("name, value", [("steps", "five"), ("bug", 1), ("steps", 2.5), ("device", 0)])
def test_wrong_types_are_rejected(make_notebook, name, value):
    nb = make_notebook("p", PARAMS, "print(steps)")
    with pytest.raises(LabkitError, match=f"parameter {name} expects"):
        runner.validate_parameters(nb, {name: value})


def test_ints_are_accepted_for_float_parameters(make_notebook):
    nb = make_notebook("p", PARAMS, "print(steps)")
    assert runner.validate_parameters(nb, {"lr": 1}) == {"lr": 1.0}


def test_command_line_values_parse_as_literals():
    assert [runner.parse_value(v) for v in ["8", "0.5", "true", "None", "cpu"]] == [8, 0.5, True, None, "cpu"]


# The papermill child as run_notebook starts it (python -P, labkit not imported): without the IRI
# parser jsonschema would build, nbformat still validates a notebook and still refuses a broken one.
_CHILD_IMPORTS = """
import runpy, sys
child = runpy.run_path(sys.argv[1])
child["skip_unused_slow_imports"]()
import nbformat, papermill
good = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
nbformat.validate(good)
broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
broken.cells[0]["execution_count"] = "one"
try:
    nbformat.validate(broken)
except nbformat.ValidationError:
    print("broken notebook refused")
print("skipped imports loaded:", sorted(set(child["UNUSED_SLOW_IMPORTS"]) & {n for n, m in sys.modules.items() if m}))
"""


def test_the_papermill_child_skips_the_iri_parser_and_still_validates_notebooks():
    from labkit.runner import _papermill_child

    assert _papermill_child.UNUSED_SLOW_IMPORTS == ("rfc3987_syntax",)
    done = subprocess.run([sys.executable, "-P", "-c", _CHILD_IMPORTS, _papermill_child.__file__],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["broken notebook refused", "skipped imports loaded: []"]


_CLI_IMPORTS = """
import sys
from labkit.__main__ import main
status = main(["normalise", sys.argv[1]])
print(status, "rfc3987_syntax" in {n for n, m in sys.modules.items() if m}, "nbformat" in sys.modules)
"""


def test_the_command_line_skips_the_iri_parser_too(tmp_path):
    notebook = tmp_path / "00_start_here.ipynb"
    notebook.write_bytes((REPO / "notebooks" / "00_start_here.ipynb").read_bytes())
    done = subprocess.run([sys.executable, "-c", _CLI_IMPORTS, str(notebook)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False", "True"]  # normalised (unchanged), parser skipped, nbformat used


# A raising cell named in the run's error (the notebook, the cell's index and first line, the exception):
# tests/test_sweep_cluster.py's local sweep runs such a point and asserts the runner's message, at no
# kernel of its own here (test_a_local_cluster_sweep_fails_one_point_and_matches_the_local_runner).


# A hung notebook stopped at its timeout, and a kernel killed in a cell, each named with the cell they stopped
# in: tests/reliability/test_runner.py provokes both faults once, with the runner's other guarantees for them
# (test_a_hung_run_is_stopped_at_its_timeout_with_the_kernels_own_children,
# test_a_kernel_is_replaced_once_if_it_dies_before_the_first_cell_and_never_after[a-kernel-killed-in-a-cell-...]).


def test_summary_lists_runs_and_claims(tmp_path):
    runs = [runner.RunResult("00_a", "ok", 1.5, "x", claims=[{"id": "Z1", "verdict": "holds", "evidence": "0 diff"}]),
            runner.RunResult("01_b", "failed", 2.0, "y", error="cell 3 raised ValueError: bad")]
    runner.write_summary(runs, tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "1/2 ok" in md and "| Z1 | 00_a | holds | 0 diff |" in md and "cell 3 raised ValueError" in md
    assert "<td>Z1</td>" in (tmp_path / "summary.html").read_text()
    recorded = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert {(run["labkit_version"], run["git_commit"]) for run in recorded} == {(labkit.__version__,
                                                                              _version.git_commit())}


def test_sweep_arguments_parse_into_a_grid():
    grid = runner.parse_sweep(["steps=2,8", "bug=true,false"])
    assert grid == {"steps": [2, 8], "bug": [True, False]}
    assert runner.grid_points(grid) == [{"steps": 2, "bug": True}, {"steps": 2, "bug": False},
                                       {"steps": 8, "bug": True}, {"steps": 8, "bug": False}]
    with pytest.raises(LabkitError, match="NAME=V1,V2"):
        runner.parse_sweep(["steps"])


@pytest.fixture(scope="module")
def two_by_two_sweep(tmp_path_factory):
    """`runner.sweep` of a notebook at steps 1, 2 by seed 0, 5 (four runs, two at a time); each run writes
    side_effect.txt in its working folder and records a score. Returns the notebook's folder, the sweep's
    folder and the results. One sweep serves the tests of a single run's folder and of the sweep's table."""
    import nbformat

    folder = tmp_path_factory.mktemp("sweep_notebook")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    parameters = nbformat.v4.new_code_cell(PARAMS)
    parameters.metadata["tags"] = ["parameters"]
    nb.cells = [parameters, nbformat.v4.new_code_cell(
        "open('side_effect.txt', 'w').write(str(steps))\nfrom labkit import claims\nclaims.metric('score', steps * 10 + seed)")]
    nbformat.write(nb, str(folder / "p.ipynb"))
    out = folder / "sweep"
    results = runner.sweep(folder / "p.ipynb", {"steps": [1, 2], "seed": [0, 5]}, out, timeout=120, workers=2)
    return folder, out, results


def test_each_run_writes_only_under_its_folder_with_its_parameters(two_by_two_sweep):
    folder, out, results = two_by_two_sweep
    assert sorted(p.name for p in folder.iterdir()) == ["p.ipynb", "sweep"]
    for result in results:
        assert result.status == "ok", result.error
        run = Path(result.output).parent
        assert run.parent == out.resolve()
        assert (run / "side_effect.txt").read_text() == str(result.parameters["steps"])
        record = json.loads((run / "p.result.json").read_text())
        assert record["parameters"] == result.parameters
        # the code that made it: one source for both, labkit/_version.py (tests/test_version.py)
        assert (record["labkit_version"], record["git_commit"]) == (labkit.__version__, _version.git_commit())
        machine = json.loads((run / "p.fingerprint.json").read_text())
        stamped = json.loads((run / "p.ipynb").read_text())["metadata"]["labkit"]["fingerprint"]
        assert machine["torch"] == torch.__version__ and stamped["torch"] == torch.__version__
    assert [r.parameters for r in results] == [{"steps": steps, "seed": seed} for steps in (1, 2) for seed in (0, 5)]
    # nothing beside the runs' own folders in the sweep's folder (the table's files come later, in the other test)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("sweep")) == sorted(
        Path(r.output).parent.name for r in results)


def test_a_two_by_two_sweep_makes_a_four_row_table_and_a_plot(two_by_two_sweep):
    _, out, results = two_by_two_sweep
    table = runner.sweep_table(results, ["steps", "seed"])
    assert [(row["steps"], row["seed"], row["score"]) for row in table] == [(1, 0, 10), (1, 5, 15), (2, 0, 20), (2, 5, 25)]
    written = runner.write_sweep(table, out)
    assert {p.name for p in written} == {"sweep.csv", "sweep.json", "sweep_score.png"}  # no plot of the code columns
    assert len((out / "sweep.csv").read_text().splitlines()) == 5
    made_by = {(row["labkit_version"], row["git_commit"]) for row in json.loads((out / "sweep.json").read_text())}
    assert made_by == {(labkit.__version__, _version.git_commit())}


def test_a_sweep_validates_every_point_before_running(make_notebook, tmp_path):
    nb = make_notebook("p", PARAMS, "print(1)")
    with pytest.raises(LabkitError, match="no parameter batch"):
        runner.sweep(nb, {"batch": [1, 2]}, tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()


def test_repro_holds_only_the_runtime_and_imports_no_course_tooling():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(repro.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"labkit.claims", "labkit.probes", "labkit.runner", "labkit.notebooks"}, imported
    assert set(repro.__all__) == {"setup", "check_parameters", "seed_everything", "fastest_kernels"}


def test_a_sweep_over_the_point_limit_is_refused_before_any_folder(make_notebook, tmp_path):
    # DK12: a 10,000-point sweep was accepted and made 10,000 folders before its first run
    nb = make_notebook("p", PARAMS, "print(1)")
    seeds = "seed=" + ",".join(map(str, range(10_000)))
    with pytest.raises(LabkitError, match=r"this sweep has 10000 points \(10000 seed\), more than the 100 .* "
                                          r"--max-points 10000"):
        runner.repro_main([str(nb), "--sweep", seeds, "--out", str(tmp_path / "big")])
    with pytest.raises(LabkitError, match="this sweep has 4 points"):
        runner.sweep(nb, {"seed": [0, 1], "steps": [1, 2]}, tmp_path / "small", max_points=3)
    with pytest.raises(LabkitError, match="this sweep has 2 points"):
        runner.cluster_sweep(nb, {"seed": [0, 1]}, tmp_path / "cluster", max_points=1)
    assert not any(tmp_path.glob("big*")) and not (tmp_path / "small").exists() and not (tmp_path / "cluster").exists()
    assert runner.check_point_count({"seed": [0, 1], "steps": [1, 2]}, max_points=4) == 4
