"""Plain papermill, without labkit's runner: typed parameters it can show, and the notebook's own check.

Every parameters cell is typed and commented so `papermill --help-notebook` shows types and help,
and the cell after it starts with `repro.check_parameters(globals())`, which refuses what papermill
injects unchecked (`-p bug false` is the string "false", an unknown name is only a warning). The
logic is tested in-process on the cells papermill itself injects (every refusal in BAD_VALUES); three
real papermill runs of 00_start_here prove it in a kernel: one refusal through the command line (two bad
values, both injected as parsed) and one through the Python API (each stops at the check cell, so it
costs little more than a kernel start), and a typed run that turns the bug off.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill
import pytest
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

from labkit.notebooks import workbook_notebooks
from labkit.parameters import ParameterError, check_parameters, check_values, declared_parameters
from labkit.records import METRIC_MIME, stored_records
from labkit.runner.rerun_parameters import notebook_declarations, parameters_cell, validate_parameters

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
START = NOTEBOOKS / "00_start_here.ipynb"
CHECK_CALL = "repro.check_parameters(globals())"
RUN_LIMIT_S = 300

# What plain papermill gets wrong without the check, and the one line the check answers with.
BAD_VALUES = [
    pytest.param({"bug": "false"}, r"^parameter bug expects a bool .*got the string 'false': pass -p bug False "
                 r"\(capitalised\) or -y \"bug: false\"$", id="bug-false-string"),
    pytest.param({"steps": "ten"}, r"^parameter steps expects an int \(SGD steps, from 1 to 100000; default 30\), "
                 r"got the string 'ten': pass a number, e.g. -p steps 30$", id="steps-ten"),
    pytest.param({"stepz": 10}, r"^this notebook has no parameter stepz; allowed: seed \(default 0\), .*"
                 r"bug \(default True\)(, \w+ \(default [^)]*\))*\. Did you mean steps\?$", id="unknown-stepz"),
    pytest.param({"steps": -5}, r"^parameter steps must be at least 1, got -5 \(default 30\)$", id="steps-negative"),
]


def _cell_after_parameters(nb) -> dict:
    cells = nb["cells"]
    return cells[cells.index(parameters_cell(nb)) + 1]


@pytest.mark.parametrize("notebook", workbook_notebooks(NOTEBOOKS), ids=lambda p: p.stem)
def test_every_parameter_is_typed_with_help_as_papermill_reads_it(notebook):
    shown = papermill.inspect_notebook(notebook)
    declared = notebook_declarations(notebook)
    assert list(shown) == list(declared)
    for name, parameter in declared.items():
        assert shown[name]["inferred_type_name"] == parameter.type != "any", name
        assert shown[name]["help"] == parameter.help != "", name
    assert check_values(declared, {name: p.default for name, p in declared.items()})  # the defaults fit


NUMERIC = ("int", "float", "list[int]", "list[float]")
FLOORS, CEILINGS = ("at least", "above"), ("at most", "below")


@pytest.mark.parametrize("notebook", workbook_notebooks(NOTEBOOKS), ids=lambda p: p.stem)
def test_every_numeric_parameter_declares_a_floor_and_a_ceiling_that_are_enforced(notebook):
    # PM6, PM7, PM11, PM15: a number without a ceiling of its own trained for days or asked for terabytes
    declared = notebook_declarations(notebook)
    for parameter in (p for p in declared.values() if p.type in NUMERIC):
        phrases = {phrase for phrase, _ in parameter.bounds}
        assert phrases & set(FLOORS) and phrases & set(CEILINGS), f"{notebook.name}: {parameter.name} {parameter.help!r}"
        is_list = parameter.type.startswith("list")
        assert not is_list or parameter.max_length, f"{notebook.name}: {parameter.name} needs 'at most N values'"
        for phrase, bound in parameter.bounds:
            if isinstance(bound, str):
                continue  # bounds naming other parameters: test_every_combination_bound_refuses_what_breaks_it
            step = {"at most": 1, "at least": -1}.get(phrase, 0)  # 'above N' and 'below N' refuse N itself
            past = int(bound) + step if "int" in parameter.type else bound + step
            with pytest.raises(ParameterError, match=rf"parameter {parameter.name} must (have each element|be) {phrase}"):
                parameter.check([past] if is_list else past)
        if is_list:
            with pytest.raises(ParameterError, match=rf"parameter {parameter.name} takes at most {parameter.max_length} values"):
                parameter.check(parameter.default[:1] * (parameter.max_length + 1))


def _combination_bounds():
    for notebook in workbook_notebooks(NOTEBOOKS):
        for parameter in notebook_declarations(notebook).values():
            for phrase, bound in parameter.bounds:
                if isinstance(bound, str):
                    yield pytest.param(notebook, parameter.name, phrase, bound,
                                       id=f"{notebook.stem[:2]}-{parameter.name}-{phrase}-{bound}".replace(" ", ""))


COMBINATIONS = list(_combination_bounds())


def test_the_known_inconsistent_pairs_are_declared_as_combinations():
    pairs = {(p.values[0].stem[:2], p.values[1], p.values[3]) for p in COMBINATIONS}
    assert {("02", "micro_batches", "batch"), ("15", "report_rank", "world_size"),
            ("15", "steps", "1348 / world_size / per_rank_batch")} <= pairs, pairs


@pytest.mark.parametrize("notebook, name, phrase, bound", COMBINATIONS)
def test_every_combination_bound_refuses_what_breaks_it(notebook, name, phrase, bound):
    # PM12: batch 4 with micro_batches 8 was a ZeroDivisionError; each bound naming other parameters is
    # broken here with the others at their defaults, by a value its own bounds accept
    from labkit.parameters import _evaluate  # imported here so that the other tests run on code without it

    declared = notebook_declarations(notebook)
    limit = _evaluate(bound, {n: p.default for n, p in declared.items()})
    past = math.floor(limit) + 1 if phrase == "at most" else math.ceil(limit)
    assert phrase in ("at most", "below") and declared[name].check(past) == past
    others = [term for term in re.split(r" [*/] ", bound) if term[0].isalpha()]
    message = rf"^parameters {name}(, \w+)* and \w+ do not fit together: {name} must be {phrase} {re.escape(bound)}, got "
    with pytest.raises(ParameterError, match=message) as caught:
        validate_parameters(notebook, {name: past})
    assert all(f"{other}={declared[other].default!r}" in str(caught.value) for other in others)


@pytest.mark.parametrize("notebook", workbook_notebooks(NOTEBOOKS), ids=lambda p: p.stem)
def test_the_check_opens_the_cell_right_after_the_parameters(notebook):
    nb = json.loads(notebook.read_text())
    after = _cell_after_parameters(nb)
    assert after["cell_type"] == "code" and "".join(after["source"]).splitlines()[0] == CHECK_CALL


def _kernel_after_papermill(parameters: dict) -> dict:
    """The namespace and input history a kernel holds at 00's check cell after papermill injected
    `parameters`: the cells come from the notebook and from papermill's own injection."""
    nb = parameterize_notebook(load_notebook_node(str(START)), parameters)
    cells = nb.cells
    params_at = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    run = [cell.source for cell in cells[params_at:params_at + 2]]
    assert "injected-parameters" in cells[params_at + 1].metadata["tags"]
    namespace: dict = {}
    for source in run:
        exec(source, namespace)  # literal assignments only: what the kernel runs before the check
    namespace["_ih"] = ["", *run, CHECK_CALL]
    return namespace


@pytest.mark.parametrize("parameters, message", BAD_VALUES)
def test_what_papermill_injects_unchecked_is_refused_in_one_line(parameters, message):
    with pytest.raises(ParameterError, match=message) as caught:
        check_parameters(_kernel_after_papermill(parameters))
    assert caught.value._render_traceback_() == [f"ParameterError: {caught.value}"]


def test_good_values_pass_ints_pass_for_floats_and_the_runner_agrees():
    check_parameters(_kernel_after_papermill({"bug": False, "steps": 5, "lr": 1}))
    # papermill --inject-paths adds names of its own, which are not the learner's typos
    check_parameters(_kernel_after_papermill({"PAPERMILL_INPUT_PATH": str(START), "PAPERMILL_OUTPUT_PATH": "o"}))
    assert notebook_declarations(START)["lr"].check(1) == 1.0
    for parameters, message in ((p.values[0], p.values[1]) for p in BAD_VALUES):
        with pytest.raises(ParameterError, match=message.replace("this notebook", "00_start_here.ipynb")):
            validate_parameters(START, parameters)


def test_an_edited_parameters_cell_is_checked_and_a_missing_one_is_named():
    source = "steps: int = 0  # SGD steps, at least 1\nbug: bool = True  # the bug"
    namespace = {"steps": 0, "bug": True, "_ih": ["", source, "print(steps)", CHECK_CALL]}
    with pytest.raises(ParameterError, match="parameter steps must be at least 1, got 0"):
        check_parameters(namespace)
    with pytest.raises(ParameterError, match="no typed parameters cell among the cells run so far"):
        check_parameters({"steps": 3, "_ih": ["", "steps = 3", CHECK_CALL]})


def test_without_input_history_the_cells_ipython_caches_are_read(monkeypatch):
    # nbval runs cells with store_history=False: `_ih` stays empty, but IPython still caches each cell's
    # source in linecache (without a file time) for its tracebacks
    import linecache

    source = "steps: int = 30  # SGD steps, at least 1"
    monkeypatch.setitem(linecache.cache, "/tmp/ipykernel_0/1.py", (len(source), None, [source], "/tmp/ipykernel_0/1.py"))
    check_parameters({"steps": 30, "_ih": []})
    with pytest.raises(ParameterError, match="parameter steps must be at least 1, got 0"):
        check_parameters({"steps": 0, "_ih": []})


@pytest.mark.parametrize("source, problem", [
    ("steps: int | None = 3  # steps", "use one of int, float, bool, str or list"),
    ("steps: int = 3  # steps, at least 1 (see a=b)", "single '='"),
    ("name: str = 'x'  # a name, at least 1", "bounds are for numbers"),
    ("sizes: list[int] = [1]  # sizes, at least 1", "start with 'each'"),
    ("steps: int = (\n    3)  # steps", "on one line"),
    ("print(3)", "only `name: type = literal"),
])
def test_a_declaration_papermill_would_misread_is_an_authoring_error(source, problem):
    with pytest.raises(Exception, match=problem.replace("(", r"\(")):
        declared_parameters(source)


def _papermill_cli(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "papermill", str(START), str(tmp_path / "out.ipynb"),
                           "--cwd", str(tmp_path), "-p", "device", "cpu", *arguments],
                          capture_output=True, text=True, timeout=RUN_LIMIT_S)


def _error_outputs(notebook: Path) -> list[tuple[int, dict]]:
    nb = nbformat.read(notebook, as_version=4)
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]


@pytest.mark.slow
def test_plain_papermill_stops_at_the_check_cell_with_one_line(tmp_path):
    # Two of BAD_VALUES in one run: papermill's command line injects both as parsed (the string "false", the
    # int -5), and the check refuses the first declared (steps) in one line; the string's refusal takes the
    # same path, its message tested in-process (BAD_VALUES, bug-false-string).
    message = "ParameterError: parameter steps must be at least 1, got -5"
    done = _papermill_cli(tmp_path, "-p", "bug", "false", "-p", "steps", "-5")
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    ((index, error),) = _error_outputs(tmp_path / "out.ipynb")
    nb = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert nb.cells[index].source.splitlines()[0] == CHECK_CALL
    assert error.traceback == [f"{error.ename}: {error.evalue}"] and error.traceback[0].startswith(message)
    assert not any(c.get("execution_count") for c in nb.cells[index + 1:] if c.cell_type == "code")
    [injected] = [c.source for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert 'bug = "false"' in injected.splitlines() and "steps = -5" in injected.splitlines(), injected


@pytest.mark.slow
def test_plain_papermill_refuses_an_unknown_name_and_suggests_the_closest(tmp_path):
    with pytest.raises(papermill.PapermillExecutionError) as caught:
        papermill.execute_notebook(START, tmp_path / "out.ipynb", parameters={"stepz": 10, "device": "cpu"},
                                   cwd=tmp_path, progress_bar=False, kernel_name="python3",
                                   execution_timeout=RUN_LIMIT_S)
    assert caught.value.ename == "ParameterError"
    assert caught.value.evalue.startswith("this notebook has no parameter stepz; allowed: seed (default 0)")
    assert caught.value.evalue.endswith("Did you mean steps?")


@pytest.mark.slow
def test_a_typed_plain_papermill_run_turns_the_bug_off(tmp_path):
    done = _papermill_cli(tmp_path, "-p", "bug", "False", "-p", "steps", "40", "-p", "seed", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = {m["name"]: m["value"] for m in stored_records(tmp_path / "out.ipynb", METRIC_MIME)}
    assert metrics["final_loss"] < 0.1  # with the string "false" the bug stayed on: a loss above 1


PY_TWIN_AS_A_SCRIPT = '''# %% [markdown]
# A py twin, run with plain python.

# %% tags=["parameters"]
steps: int = STEPS  # SGD steps, at least 1
bug: bool = True  # True runs the planted bug, False the fix

# %%
from labkit.parameters import check_parameters

check_parameters(globals())
print(f"checked: steps={steps}")
'''


@pytest.mark.parametrize("steps, outcome", [("30", "checked: steps=30"), ("-5", "parameter steps must be at least 1")])
def test_a_py_twin_run_as_a_plain_script_is_checked_from_its_own_cells(tmp_path, steps, outcome):
    script = tmp_path / "twin.py"
    script.write_text(PY_TWIN_AS_A_SCRIPT.replace("STEPS", steps))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert outcome in run.stdout + run.stderr
    assert (run.returncode == 0) == steps.startswith("3")


@pytest.mark.parametrize("notebook, given, message", [
    ("00_start_here", {"steps": 1_000_000_000}, r"parameter steps must be at most 100000, got 1000000000"),
    ("00_start_here", {"features": 10**6}, r"parameter features must be at most 1000, got 1000000"),
    ("00_start_here", {"samples": 10**6}, r"parameter samples must be at most 100000, got 1000000"),
    ("00_start_here", {"seed": 10**23}, r"parameter seed must be at most 2147483647, got 10{23}"),
    ("00_start_here", {"lr": 1e308}, r"parameter lr must be at most 10, got 1e\+308"),
    ("02_gradients_accumulate", {"batch": 4, "micro_batches": 8},
     r"parameters micro_batches and batch do not fit together: micro_batches must be at most batch, "
     r"got micro_batches=8 with batch=4"),
    ("02_gradients_accumulate", {"micro_batches": 64}, r"micro_batches=64 with batch=32"),
    ("09_residual_design", {"depths": []}, r"parameter depths needs at least one value, got \[\]"),
    ("09_residual_design", {"depths": [8, 10**6]}, r"parameter depths must have each element at most 1000"),
    ("09_residual_design", {"depths": list(range(1, 18))}, r"parameter depths takes at most 16 values, got 17"),
    ("15_distributed", {"report_rank": 2}, r"parameters report_rank and world_size do not fit together: report_rank "
     r"must be below world_size, got report_rank=2 with world_size=2"),
    ("15_distributed", {"steps": 100}, r"parameters steps, world_size and per_rank_batch do not fit together: steps "
     r"must be at most 1348 / world_size / per_rank_batch, got steps=100 with world_size=2, per_rank_batch=16"),
    ("01_computation_graph", {"width": 10**6}, r"parameter width must be at most 1024"),
    ("13_memory", {"resnet_batch": 10**4}, r"parameter resnet_batch must be at most 1024"),
])
def test_out_of_range_and_inconsistent_values_are_refused_naming_the_parameters(notebook, given, message):
    # PM6, PM7, PM11, PM12, PM15: each used to run (for days, or into a cell traceback) before this
    with pytest.raises(ParameterError, match=message):
        validate_parameters(NOTEBOOKS / f"{notebook}.ipynb", given)


def test_a_bound_may_name_another_parameter_and_must_name_a_number_one():
    declared = declared_parameters("batch: int = 8  # rows, at least 1\nparts: int = 2  # parts, from 1 to batch")
    assert set(declared["parts"].bounds) == {("at least", 1.0), ("at most", "batch")}
    assert check_values(declared, {"batch": 16, "parts": 16}) == {"batch": 16, "parts": 16}
    with pytest.raises(ParameterError, match="parameters parts and batch do not fit together"):
        check_values(declared, {"parts": 9})  # batch keeps its default, 8
    with pytest.raises(Exception, match="bounded by 'name', which is not an int or float parameter"):
        declared_parameters("name: str = 'x'  # a name\nparts: int = 2  # parts, at most name")


def test_a_bound_may_multiply_and_divide_parameters_and_a_list_states_its_length():
    declared = declared_parameters("ranks: int = 2  # ranks, from 1 to 8\nrows: int = 16  # rows, from 1 to 1348 / ranks / 2\n"
                                   "sizes: list[int] = [1]  # sizes, each from 1 to 64, at most 3 values")
    assert set(declared["rows"].bounds) == {("at least", 1.0), ("at most", "1348 / ranks / 2")}
    assert declared["sizes"].max_length == 3 and set(declared["sizes"].bounds) == {("at least", 1.0), ("at most", 64.0)}
    assert check_values(declared, {"ranks": 4, "rows": 168, "sizes": [1, 2, 64]})
    with pytest.raises(ParameterError, match=r"^parameters rows and ranks do not fit together: rows must be at most "
                                             r"1348 / ranks / 2, got rows=169 with ranks=4 \(defaults rows=16, ranks=2\)"):
        check_values(declared, {"ranks": 4, "rows": 169})
    with pytest.raises(ParameterError, match="parameter sizes takes at most 3 values, got 4: give at most 3"):
        check_values(declared, {"sizes": [1, 2, 3, 4]})
    with pytest.raises(Exception, match="bounded by 'sizes', which is not an int or float parameter"):
        declared_parameters("sizes: list[int] = [1]  # s, each at least 1\nrows: int = 2  # rows, at most 10 * sizes")
    with pytest.raises(Exception, match="only a list has values"):
        declared_parameters("rows: int = 2  # rows, at least 1, at most 3 values")


@pytest.fixture
def guarded_shell():
    """An in-process IPython shell (no kernel) with the guard a notebook's labkit import installs."""
    from IPython.core.interactiveshell import InteractiveShell

    from labkit.parameters import guard_injected_cells

    shell = InteractiveShell.instance()
    guard_injected_cells(shell)
    yield shell
    InteractiveShell.clear_instance()


def test_code_in_an_injected_parameter_name_is_refused_before_it_runs(guarded_shell, tmp_path):
    # PM10: papermill writes `-p NAME VALUE` as `NAME = VALUE`, so this name ran as code one cell before the check
    target = tmp_path / "INJECTED"
    name = f"x=1;open({str(target)!r},'w').write('x');y"
    injected = papermill.translators.translate_parameters("python3", "python", {name: 1})
    assert injected.startswith("# Parameters")
    outcome = guarded_shell.run_cell(injected)
    assert isinstance(outcome.error_in_exec, ParameterError)
    assert "is not NAME = VALUE" in str(outcome.error_in_exec) and "\n" not in str(outcome.error_in_exec)
    assert not target.exists()
    assert "y" not in guarded_shell.user_ns


def test_values_as_papermill_writes_them_still_run_in_a_guarded_kernel(guarded_shell):
    values = {"steps": 5, "lr": float("nan"), "floor": float("-inf"), "name": "a;b", "depths": [8, 16],
              "options": {"a": None, "b": [True, 1.5]}}
    injected = papermill.translators.translate_parameters("python3", "python", values)
    outcome = guarded_shell.run_cell(injected)
    assert outcome.success, outcome.error_in_exec
    assert {key: guarded_shell.user_ns[key] for key in ("steps", "name", "depths", "options")} == \
        {key: values[key] for key in ("steps", "name", "depths", "options")}
    assert math.isnan(guarded_shell.user_ns["lr"]) and guarded_shell.user_ns["floor"] == float("-inf")
    assert guarded_shell.run_cell("x = 1; print(x)").success  # a learner's own cell is left alone


def test_importing_labkit_in_a_kernel_guards_it():
    # every notebook imports labkit.repro (and with it labkit.parameters) before its parameters cell
    code = ("from IPython.core.interactiveshell import InteractiveShell\nshell = InteractiveShell.instance()\n"
            "import labkit.repro\nfrom labkit import parameters\n"
            "print(parameters._refuse_code_in_injected_cell in shell.input_transformers_post)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr[-2000:]
