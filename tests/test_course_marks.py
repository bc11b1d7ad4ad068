"""Every exercise's check cell is a locked nbgrader test, written by `python -m labkit course mark`, and under
nbgrader's execution a wrong answer makes `grading.check` raise while a learner's kernel only prints the verdict."""

from __future__ import annotations

import shutil
from pathlib import Path

import jupytext
import nbformat
import pytest

from labkit import grading, student
from labkit.__main__ import main as labkit_main
from labkit.course import marks
from labkit.errors import LabkitError
from labkit.exercises import registry
from labkit.notebooks import paired_script, workbook_notebooks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = workbook_notebooks(ROOT / "notebooks")


def check_cells(nb) -> dict[str, dict]:
    """The nbgrader metadata of each check cell, by the exercise it checks."""
    found = {}
    for index, cell in enumerate(nb.cells):
        exercise_id = marks.checked_exercise(cell, f"cell {index + 1}")
        if exercise_id is not None:
            found[exercise_id] = cell.metadata.get("nbgrader")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_every_check_cell_is_a_locked_nbgrader_test_in_the_notebook_and_its_twin(path):
    expected = {eid: student.check_metadata(eid) for eid, spec in registry().items() if spec.notebook == path.stem}
    assert expected, f"{path.stem} registers no exercise"
    assert check_cells(nbformat.read(path, 4)) == expected
    assert check_cells(jupytext.read(paired_script(path))) == expected


def test_check_metadata_is_a_graded_locked_cell_with_a_stable_id():
    assert student.check_metadata("07.2") == {
        "grade": True, "grade_id": "check_07_2", "locked": True, "points": 1, "schema_version": 3, "solution": False,
    }


def copy_pair(tmp_path: Path, name: str = "00_start_here") -> Path:
    (tmp_path / "py").mkdir()
    shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", tmp_path)
    shutil.copy(ROOT / "notebooks" / "py" / f"{name}.py", tmp_path / "py")
    return tmp_path / f"{name}.ipynb"


def test_mark_restores_removed_metadata_in_both_files_and_is_idempotent(tmp_path):
    path = copy_pair(tmp_path)
    before_ipynb, before_py = path.read_text(), paired_script(path).read_text()
    nb = nbformat.read(path, 4)
    for cell in nb.cells:
        if marks.checked_exercise(cell, "cell") is not None:
            del cell.metadata["nbgrader"]
    nbformat.write(nb, path)
    assert marks.mark_notebooks([path]) == {path: ["00.1", "00.2"]}
    assert (path.read_text(), paired_script(path).read_text()) == (before_ipynb, before_py)
    assert marks.mark_notebooks([path]) == {}


def test_mark_refuses_an_exercise_the_registry_does_not_give_the_notebook_and_writes_nothing(tmp_path):
    path = copy_pair(tmp_path)
    nb = nbformat.read(path, 4)
    cell = next(cell for cell in nb.cells if marks.checked_exercise(cell, "cell") == "00.2")
    cell.source = cell.source.replace('"00.2"', '"00.9"')
    nbformat.write(nb, path)
    paired_script(path).write_text(jupytext.writes(nb, fmt="py:percent"))
    before = path.read_text()
    with pytest.raises(LabkitError, match=r"checks exercise 00\.9, which labkit.exercises does not register for "
                                          r"00_start_here \(it registers 00\.1, 00\.2\)"):
        marks.mark_notebooks([path])
    assert path.read_text() == before


def test_every_committed_notebook_is_marked():
    for path in workbook_notebooks():
        assert marks.marked(nbformat.read(path, 4), path.name) == [], f"run python -m labkit course mark {path.stem[:2]}"


def test_a_lab_check_cell_gets_its_grade_metadata_from_the_generator_not_the_notebook():
    # student.with_lab_checks adds it to the student edition and the course source, from the cell's shape
    # (tests/test_student.py), so the notebooks' stored outputs and a new lab's cells need no marking.
    for path in workbook_notebooks():
        for cell in nbformat.read(path, 4).cells:
            if cell.cell_type == "code" and cell.source.startswith("labs.check("):
                assert "nbgrader" not in cell.metadata, path.name


def test_mark_cli_reports_what_it_did(tmp_path, monkeypatch, capsys):
    path = copy_pair(tmp_path)  # a copy: the command writes where a mark is missing, never into the checkout
    monkeypatch.setattr("labkit.course.cli.select_notebooks", lambda names: [path])
    assert labkit_main(["course", "mark", "00"]) == 0
    assert "every check cell already carries its nbgrader test metadata" in capsys.readouterr().out
    nb = nbformat.read(path, 4)
    del next(cell for cell in nb.cells if marks.checked_exercise(cell, "cell") == "00.2").metadata["nbgrader"]
    nbformat.write(nb, path)
    assert labkit_main(["course", "mark", "00"]) == 0
    assert f"{path.name}: check cells of 00.2 marked as nbgrader tests (and its py twin)" in capsys.readouterr().out


def wrong_step(model, optimizer, x, y):
    return 0.0


def correct_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


@pytest.fixture
def fresh_session(monkeypatch):
    monkeypatch.setattr(grading, "_SESSION", {})


def test_a_wrong_answer_raises_the_verdict_under_nbgrader(fresh_session, monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(AssertionError, match=r"^✗ Exercise 00\.1 not yet: .* Hint: "):
        grading.check("00.1", wrong_step)
    assert "✗ Exercise 00.1 not yet" in capsys.readouterr().out
    grading.check("00.1", correct_step)  # a right answer passes the test: no exception
    assert "✓ Exercise 00.1 passed" in capsys.readouterr().out


def test_without_nbgrader_a_wrong_answer_prints_one_line_and_raises_nothing(fresh_session, monkeypatch, capsys):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    grading.check("00.1", wrong_step)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("✗ Exercise 00.1 not yet: ")
