"""The student edition: no solution text survives, outputs are cleared, the parameters cell is kept.

The edition is generated from the workbook's notebooks/ (the `student_editions` session fixture,
tests/conftest.py). That every edition runs top to bottom with its checks failing gracefully is asserted
where it runs: each tests/test_nbNN_*.py runs its fixed side on the edition
(tests/notebook_runs.py, `run_student_edition_on_cpu`), so the edition costs no kernel of its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit import student
from labkit.__main__ import main as labkit_main
from labkit.errors import LabkitError

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "notebooks"]

BUG = '# planted bug for exercise 00.1\ndef f(x):\n    return x\n'
SOLUTION = (
    '# exercise 00.1\ndef f(x):\n    """Doc."""\n'
    "    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n"
)
CHECK = 'grading.check("00.1", f)'


# ---- the stub ------------------------------------------------------------------------------------


def test_stub_replaces_the_region_and_markers_keeping_indentation():
    stubbed = student.stub_solution(SOLUTION, "00.1")
    assert stubbed == (
        '# exercise 00.1\ndef f(x):\n    """Doc."""\n'
        "    # YOUR CODE HERE\n"
        '    raise NotImplementedError("Exercise 00.1: replace this line with your answer")\n'
    )


def test_stub_handles_several_regions():
    source = "### BEGIN SOLUTION\na = 1\n### END SOLUTION\nb = 2\n  ### BEGIN SOLUTION\n  c = 3\n  ### END SOLUTION"
    lines = student.stub_solution(source, "00.3").split("\n")
    assert lines == [
        "# YOUR CODE HERE",
        'raise NotImplementedError("Exercise 00.3: replace this line with your answer")',
        "b = 2",
        "  # YOUR CODE HERE",
        '  raise NotImplementedError("Exercise 00.3: replace this line with your answer")',
    ]


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "opens a region inside another"),
        ("x = 1\n### END SOLUTION", "has no '### BEGIN SOLUTION' above it"),
        ("### BEGIN SOLUTION\nx = 1", "is never closed"),
    ],
    ids=["nested", "end without begin", "unclosed"],
)
def test_unbalanced_markers_are_a_labkit_error(source, problem):
    with pytest.raises(LabkitError, match=problem):
        student.stub_solution(source, "00.1", "00_x.ipynb cell 3")


# ---- the convention ------------------------------------------------------------------------------


def exercise_cell(source: str = SOLUTION, exercise_id: str = "00.1") -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": student.nbgrader_metadata(exercise_id)})


def check_cell(source: str = CHECK, exercise_id: str = "00.1") -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": student.check_metadata(exercise_id)})


def notebook(*cells: nbformat.NotebookNode) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=list(cells))


def code(source: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source)


def test_find_exercises_returns_the_three_cells_and_the_function():
    found = student.find_exercises(notebook(code(BUG), exercise_cell(), check_cell()), "00_x.ipynb")
    assert found == {"00.1": student.ExerciseCells("00.1", BUG, SOLUTION, CHECK, "f")}


@pytest.mark.parametrize(
    ("cells", "problem"),
    [
        (
            [code(BUG), code(SOLUTION.replace("# exercise 00.1\n", "")), check_cell()],
            "does not start with '# exercise NN.K'",
        ),
        (
            [code(BUG), nbformat.v4.new_markdown_cell("### BEGIN SOLUTION\n### END SOLUTION"), check_cell()],
            "does not start with '# exercise NN.K'",
        ),
        ([code(BUG), exercise_cell("# exercise 00.1\ndef f(x):\n    return x"), check_cell()], "has no '### BEGIN"),
        ([code(BUG), code(SOLUTION), check_cell()], "needs nbgrader's cell metadata"),
        ([code(BUG), exercise_cell()], "has no check cell"),
        ([exercise_cell(), check_cell()], "has no planted bug cell"),
        ([code(BUG), check_cell(), exercise_cell()], "must come in the order"),
        ([code(BUG), exercise_cell(), exercise_cell(), check_cell()], "already has a solution cell"),
        ([code(BUG), exercise_cell(), check_cell(CHECK.replace(", f)", ", g)"))], "must both define it with 'def g\\('"),
        (
            [code(BUG.replace("00.1", "01.1")), exercise_cell(SOLUTION.replace("00.1", "01.1"), "01.1")],
            "does not belong in 00_x.ipynb",
        ),
        ([code(BUG), exercise_cell(), code(CHECK)], r"is not a locked nbgrader test cell.*labkit course mark"),
        ([code(BUG), exercise_cell(), check_cell(exercise_id="00.2")], "is not a locked nbgrader test cell"),
        ([code(BUG), exercise_cell(), check_cell(CHECK + "\n" + CHECK)], "give each grading.check its own cell"),
    ],
    ids=[
        "markers without id",
        "markers in markdown",
        "id without markers",
        "no nbgrader metadata",
        "no check",
        "no planted bug",
        "wrong order",
        "duplicate",
        "function mismatch",
        "wrong notebook",
        "unlocked check",
        "check metadata of another exercise",
        "two checks in a cell",
    ],
)
def test_convention_errors_name_the_problem(cells, problem):
    with pytest.raises(LabkitError, match=problem):
        student.find_exercises(notebook(*cells), "00_x.ipynb")


# ---- writing the edition -------------------------------------------------------------------------


def solution_source(folder: Path) -> Path:
    folder.mkdir()
    parameters = nbformat.v4.new_code_cell("seed = 0", metadata={"tags": ["parameters"]})
    ran = code("print(1)")
    ran.outputs, ran.execution_count = [nbformat.v4.new_output("stream", text="1\n")], 1
    nbformat.write(notebook(parameters, ran, code(BUG), exercise_cell(), check_cell()), folder / "00_x.ipynb")
    return folder


def test_edition_stubs_clears_and_keeps_everything_else(tmp_path):
    source = solution_source(tmp_path / "notebooks")
    (written,) = student.write_student_edition(source, tmp_path / "student")
    original, edition = nbformat.read(source / "00_x.ipynb", 4), nbformat.read(written, 4)
    assert written == tmp_path / "student" / "00_x.ipynb"
    assert [cell.source for cell in edition.cells] == [
        cell.source if index != 3 else student.stub_solution(cell.source, "00.1")
        for index, cell in enumerate(original.cells)
    ]
    # nbgrader's release locks the same cells: an answer cannot be deleted, a check neither deleted nor edited.
    locks = {3: {"deletable": False}, 4: {"deletable": False, "editable": False}}
    assert [cell.metadata for cell in edition.cells] == [
        {**cell.metadata, **locks.get(index, {})} for index, cell in enumerate(original.cells)
    ]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in edition.cells)
    assert edition.metadata["labkit"] == {"edition": "student"}


@pytest.mark.parametrize("inside", [".", "student"], ids=["same folder", "subfolder"])
def test_edition_refuses_to_write_into_the_source_folder(tmp_path, inside):
    source = solution_source(tmp_path / "notebooks")
    with pytest.raises(LabkitError, match="into the source folder"):
        student.write_student_edition(source, source / inside)


def test_edition_needs_a_source_with_notebooks(tmp_path):
    with pytest.raises(LabkitError, match="no folder"):
        student.write_student_edition(tmp_path / "missing", tmp_path / "student")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LabkitError, match="no notebooks named NN_name.ipynb"):
        student.write_student_edition(tmp_path / "empty", tmp_path / "student")


def test_a_convention_error_writes_nothing(tmp_path):
    source = solution_source(tmp_path / "notebooks")
    nbformat.write(notebook(code(BUG), exercise_cell()), source / "01_broken.ipynb")
    with pytest.raises(LabkitError, match="does not belong in 01_broken.ipynb"):
        student.write_student_edition(source, tmp_path / "student")
    assert not (tmp_path / "student").exists()


def test_rerun_overwrites_its_own_files_but_nothing_else(tmp_path):
    source, destination = solution_source(tmp_path / "notebooks"), tmp_path / "student"
    (destination).mkdir()
    (destination / "notes.txt").write_text("mine")
    student.write_student_edition(source, destination)
    student.write_student_edition(source, destination)
    assert (destination / "notes.txt").read_text() == "mine"
    nbformat.write(notebook(code("hand made")), destination / "00_x.ipynb")
    with pytest.raises(LabkitError, match="was not written by the student-edition generator"):
        student.write_student_edition(source, destination)


def test_rerun_keeps_a_learners_answers_unless_forced(tmp_path):
    source, destination = solution_source(tmp_path / "notebooks"), tmp_path / "student"
    (written,) = student.write_student_edition(source, destination)
    edition = nbformat.read(written, 4)
    edition.cells[3].source = "# exercise 00.1\ndef f(x):\n    return x + 1\n"
    nbformat.write(edition, written)
    with pytest.raises(LabkitError, match="holds answers to exercise 00.1"):
        student.write_student_edition(source, destination)
    assert "return x + 1" in nbformat.read(written, 4).cells[3].source
    student.write_student_edition(source, destination, force=True)
    assert "return x + 1" not in nbformat.read(written, 4).cells[3].source


@pytest.mark.parametrize("edit", ["tag", "attachment"])
def test_rerun_keeps_a_learners_cell_tags_and_pasted_images(tmp_path, edit):
    # ST3: only a cell's type and text were compared, so a tag or a pasted image was dropped without a word
    source, destination = solution_source(tmp_path / "notebooks"), tmp_path / "student"
    (written,) = student.write_student_edition(source, destination)
    edition = nbformat.read(written, 4)
    if edit == "tag":
        edition.cells[1].metadata["tags"] = ["mine"]
    else:
        edition.cells.append(nbformat.v4.new_markdown_cell("![x](attachment:x.png)",
                                                           attachments={"x.png": {"image/png": "iVBORw0KGgo="}}))
        edition.cells[1].attachments = {"x.png": {"image/png": "iVBORw0KGgo="}}
    nbformat.write(edition, written)
    with pytest.raises(LabkitError, match=r"cells you added or edited \(text, tags or attachments\): cell 2"):
        student.write_student_edition(source, destination)
    assert nbformat.read(written, 4) == edition


def test_a_save_landing_between_the_check_and_the_write_is_kept(tmp_path, monkeypatch):
    # ST8: every target was checked, then all were written: a learner's save in between was overwritten
    source, destination = solution_source(tmp_path / "notebooks"), tmp_path / "student"
    (written,) = student.write_student_edition(source, destination)
    answered = written.read_text().replace("Exercise 00.1: replace this line with your answer", "answered")
    writes = nbformat.writes

    def save_then_write(*args, **kwargs):  # the learner's save lands once every target has been checked
        written.write_text(answered)
        return writes(*args, **kwargs)

    monkeypatch.setattr(nbformat, "writes", save_then_write)
    with pytest.raises(LabkitError, match="changed while the student edition was written.*it was kept"):
        student.write_student_edition(source, destination)
    assert written.read_text() == answered
    assert sorted(p.name for p in destination.iterdir()) == ["00_x.ipynb"]  # no temporary file left


def test_an_unwritable_destination_is_a_clear_error(tmp_path, capsys):
    # ST4, ST7: a read-only student/ or a DEST that is a file ended in a raw OSError
    source = solution_source(tmp_path / "notebooks")
    (tmp_path / "x.txt").write_text("a file")
    assert labkit_main(["student", str(source), str(tmp_path / "x.txt")]) == 2
    assert "cannot write the student edition to" in capsys.readouterr().err  # not a traceback
    (written,) = student.write_student_edition(source, tmp_path / "student")
    read_only = OSError(30, "Read-only file system", str(written))
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patched:
        patched.setattr(student.tempfile, "NamedTemporaryFile", lambda *a, **k: (_ for _ in ()).throw(read_only))
        with pytest.raises(LabkitError, match=r"00_x.ipynb \(Read-only file system\): make .* a writable folder"):
            student.write_student_edition(source, tmp_path / "student")


def test_cli_writes_the_edition_and_reports_errors(tmp_path, capsys):
    source = solution_source(tmp_path / "notebooks")
    assert labkit_main(["student", str(source), str(tmp_path / "student")]) == 0
    assert "wrote the student edition of 1 notebook(s)" in capsys.readouterr().out
    assert labkit_main(["student", str(source), str(source)]) == 2
    assert "into the source folder" in capsys.readouterr().err


# ---- the real edition (notebooks/) ----------------------------------------------------------------


def secret_lines(original: nbformat.NotebookNode, name: str) -> set[str]:
    """Solution lines that appear nowhere else in the source notebook, so must not be in the edition.

    A line shared with the planted bug (``loss.backward()``) is no secret: the learner already sees it.
    """
    inside, outside = set(), set()
    exercise_ids = student.find_exercises(original, name)
    for cell in original.cells:
        lines = cell.source.split("\n")
        regions = student.solution_regions(cell.source, name) if student.exercise_id_of(cell) in exercise_ids else []
        hidden = {index for begin, end in regions for index in range(begin + 1, end)}
        for index, line in enumerate(lines):
            (inside if index in hidden else outside).add(line.strip())
    return {line for line in inside - outside if line}


def leaked_lines(original: nbformat.NotebookNode, edition: nbformat.NotebookNode, name: str) -> set[str]:
    edition_lines = {line.strip() for cell in edition.cells for line in cell.source.split("\n")}
    return secret_lines(original, name) & edition_lines


def source_notebooks() -> list:
    return [
        pytest.param(path, id=path.relative_to(ROOT).as_posix())
        for folder in SOURCES
        for path in sorted(folder.glob(student.NOTEBOOK_GLOB))
    ]


@pytest.fixture(scope="module")
def editions(student_editions) -> dict[Path, Path]:
    """Each source notebook mapped to its student edition: the session's (tests/conftest.py)."""
    assert set(student_editions) == {param.values[0] for param in source_notebooks()}
    return student_editions


def test_the_leak_detector_catches_an_unstubbed_notebook():
    path = SOURCES[0] / "00_start_here.ipynb"
    original = nbformat.read(path, 4)
    secrets = secret_lines(original, path.name)
    # Every line unique to a solution, such as the autograd.grad call the planted bug of 00.2 lacks.
    assert "(gradient,) = torch.autograd.grad(torch.tanh(w * x).sum(), w)" in secrets
    assert leaked_lines(original, original, path.name) == secrets


@pytest.mark.parametrize("path", source_notebooks())
def test_edition_has_no_solution_text_and_keeps_the_parameters(editions, path):
    original, edition = nbformat.read(path, 4), nbformat.read(editions[path], 4)
    # With no line unique to a solution the leak check below would pass vacuously; it also means the
    # notebook has no exercise, or shows every answer line elsewhere (in markdown, say).
    assert secret_lines(original, path.name), f"{path.name}: no solution line is unique to a solution region"
    assert leaked_lines(original, edition, path.name) == set()
    assert not any(student.BEGIN_SOLUTION in cell.source for cell in edition.cells)
    code_cells = [cell for cell in edition.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code_cells)
    assert parameters_cell(edition).source == parameters_cell(original).source


def parameters_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    (cell,) = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    return cell


def _disabled_lab_extensions(monkeypatch, config_path: str | None) -> dict:
    """What JupyterLab's page config disables, read as `jupyter lab` reads it (every config folder)."""
    from jupyterlab_server.config import get_static_page_config

    if config_path is None:
        monkeypatch.delenv("JUPYTER_CONFIG_PATH", raising=False)
    else:
        monkeypatch.setenv("JUPYTER_CONFIG_PATH", config_path)
    return get_static_page_config(level="all").get("disabledExtensions", {})


def test_make_lab_student_opens_jupyterlab_without_nbgraders_instructor_tools(monkeypatch):
    # the dev extras install nbgrader, whose menu, Validate and Create Assignment a lone learner should not meet
    pytest.importorskip("nbgrader")
    (line,) = [line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("LEARNER_LAB_CONFIG :=")]
    config = line.split(":=", 1)[1].strip().replace("$(CURDIR)", str(ROOT))
    recipe = (ROOT / "Makefile").read_text().split("\nlab-student:", 1)[1].split("\n\n", 1)[0]
    assert 'JUPYTER_CONFIG_PATH="$(LEARNER_LAB_CONFIG)' in recipe and "jupyter lab student/" in recipe
    assert not _disabled_lab_extensions(monkeypatch, None).get("@jupyter/nbgrader")  # `make lab`, the instructor's
    assert _disabled_lab_extensions(monkeypatch, config).get("@jupyter/nbgrader") is True


# ---- the labs: graded like exercises, nothing of the variant shown -----------------------------------


def test_every_lab_check_cell_is_a_locked_graded_test_in_the_edition(editions):
    from labkit.labs._isolated import checked_function
    from labkit.labs._registry import lab_ids, lab_of

    graded = {}
    for edition in editions.values():
        for cell in nbformat.read(edition, 4).cells:
            if cell.cell_type == "code" and checked_function(cell.source):
                lab_id = edition.name[:2]
                assert cell.metadata["nbgrader"] == student.lab_check_metadata(lab_id)
                assert (cell.metadata["deletable"], cell.metadata["editable"]) == (False, False)
                graded[lab_id] = edition.stem
    assert graded == {lab_id: lab_of(lab_id).notebook for lab_id in lab_ids()}


def revealed_variants(notebooks: list[nbformat.NotebookNode]) -> list[str]:
    """The variants of every lab that ``notebooks`` name (their IDs quoted, anywhere in the file), or whose
    defect code they hold: a defect function's name, or its whole definition under any name."""
    from labkit.labs._registry import lab_ids, lab_of

    text = "\n".join(nbformat.writes(nb) for nb in notebooks)
    code = "\n".join(line.strip() for nb in notebooks for cell in nb.cells for line in cell.source.splitlines())
    found = []
    for lab in map(lab_of, lab_ids()):
        for variant in lab.variants:
            named = f'\\"{variant.id}\\"' in text or f"'{variant.id}'" in text
            names = [defect.__name__ for defect in variant.defect.values() if defect.__name__ != "<lambda>"]
            if named or any(name in text for name in names) or any(
                    re.search(_definition(defect), code) for defect in variant.defect.values()):
                found.append(variant.id)
    return found


def _definition(defect) -> str:
    """A pattern for ``defect``'s whole definition under any name: its parameters and body, stripped lines."""
    import inspect

    lines = [line.strip() for line in inspect.getsource(defect).splitlines() if line.strip()]
    return r"def \w+" + re.escape("\n".join([lines[0].split(defect.__name__, 1)[1], *lines[1:]]))


def test_the_edition_holds_no_variant_and_no_defect_code(editions):
    assert revealed_variants([nbformat.read(path, 4) for path in editions.values()]) == []


def test_the_variant_detector_catches_a_defect_pasted_into_a_notebook():
    import inspect

    from labkit.labs._lab13 import LAB

    (defect,) = LAB.variant("13.c").defect.values()
    pasted = inspect.getsource(defect).replace(defect.__name__, "keep_losses")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(pasted)])
    assert revealed_variants([nb]) == ["13.c"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('variant = "13.c"')])
    assert revealed_variants([nb]) == ["13.c"]


LAB_ANSWER = "# lab 00: your answer\ndef diagnose(lab):\n    raise NotImplementedError\n"


@pytest.mark.parametrize(("name", "cells", "problem"), [
    ("01_computation_graph.ipynb", [LAB_ANSWER, "labs.check(lab, diagnose)"], "labkit.labs has no lab 00 for 01"),
    ("00_start_here.ipynb", ["labs.check(lab, diagnose)"], "no cell above it starts with '# lab 00: your answer'"),
    ("00_start_here.ipynb", [LAB_ANSWER, "labs.check(lab, my_answer)"], r"defines 'def my_answer\(lab\):'"),
])
def test_a_lab_cell_out_of_shape_is_a_clear_error(name, cells, problem):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    with pytest.raises(LabkitError, match=problem):
        student.with_lab_checks(nb, name)
