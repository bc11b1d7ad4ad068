"""The student edition: the solution notebooks with every answer replaced by a TODO stub.

`python -m labkit student [SRC] [DEST]` (what `make student` runs) reads each `SRC/NN_*.ipynb`
(default `notebooks/`) and writes `DEST/NN_*.ipynb` (default `student/`): the lines between
`### BEGIN SOLUTION` and `### END SOLUTION` become a stub, outputs and execution counts are cleared,
and everything else (planted bugs, checks, the `parameters` cell and its tags) stays as it is. The
edition is generated, never hand-edited. This module also owns the exercise-cell convention of
docs/AUTHORING.md, which tests/test_exercises.py uses to find each exercise's three cells.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from labkit.errors import LabkitError
from labkit.labs._isolated import checked_function as checked_lab_function
from labkit.labs._isolated import lab_of_answer_cell
from labkit.labs._registry import LAB_MODULES, lab_of
from labkit.messages import first_line
from labkit.notebooks import NOTEBOOK_GLOB

# Used through `python -m labkit student` (make student); nothing here is imported by name.
__all__: list[str] = []

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
EXERCISE_HEADER = re.compile(r"^# exercise (\d{2}\.\d+)\s*$")
PLANTED_BUG_HEADER = re.compile(r"^# planted bug for exercise (\d{2}\.\d+)\s*$")
CHECK_CALL = re.compile(r"""grading\.check\(\s*["'](\d{2}\.\d+)["']\s*,\s*([A-Za-z_]\w*)\s*\)""")
STUB = ('# YOUR CODE HERE', 'raise NotImplementedError("Exercise {id}: replace this line with your answer")')
# nbgrader points per exercise: every exercise weighs the same.
CHECK_POINTS = 1
# Marks a notebook as this generator's output, so a rerun overwrites only the edition's own files.
EDITION_METADATA = {"edition": "student"}


@dataclass(frozen=True)
class ExerciseCells:
    """One exercise's three cells in a solution notebook, as source text (see docs/AUTHORING.md)."""

    exercise: str
    planted_bug: str
    solution: str
    check: str
    function: str


def nbgrader_metadata(exercise_id: str) -> dict:
    """The cell metadata nbgrader needs to treat an exercise cell as an autograded answer."""
    grade_id = "exercise_" + exercise_id.replace(".", "_")
    return {"grade": False, "grade_id": grade_id, "locked": False, "schema_version": 3, "solution": True}


def check_metadata(exercise_id: str) -> dict:
    """The cell metadata that makes an exercise's check cell an nbgrader autograder test.

    Locked, so nbgrader's autograde restores the cell a learner edited (outputs and all) before it
    runs it; graded with `CHECK_POINTS`, so the check raising (under nbgrader, `grading.check`
    raises `AssertionError` on a wrong answer) scores 0 and returning scores the points.
    `python -m labkit course mark` writes it into the notebooks.
    """
    grade_id = "check_" + exercise_id.replace(".", "_")
    return {"grade": True, "grade_id": grade_id, "locked": True, "points": CHECK_POINTS, "schema_version": 3,
            "solution": False}


def lab_check_metadata(lab_id: str) -> dict:
    """The cell metadata that makes a lab's check cell (``labs.check(lab, diagnose)``) an nbgrader autograder test.

    As an exercise's (`check_metadata`): locked, `CHECK_POINTS` points; nbgrader's autograde replaces its
    outputs with the verdict of the lab's answer cell graded in isolation (labkit.course.isolated_autograde).
    """
    return {"grade": True, "grade_id": f"check_lab_{lab_id}", "locked": True, "points": CHECK_POINTS,
            "schema_version": 3, "solution": False}


def with_lab_checks(notebook: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """``notebook`` with every lab check cell made a locked nbgrader test (`lab_check_metadata`), in place.

    Derived from the cells' shape, so every lab a notebook gains is graded without a list to keep: a
    code cell that is ``labs.check(lab, FUNCTION)`` checks the notebook's lab (its number, ``NN`` of
    ``NN_name``), whose answer cell (first line ``# lab NN: your answer``) must come before it and define
    FUNCTION. The source notebooks carry no such metadata (their stored outputs stay as they are); the
    student edition and the nbgrader course source get it here.
    """
    answered: set[str] = set()
    for index, cell in enumerate(notebook.cells):
        if cell["cell_type"] != "code":
            continue
        where = f"{name} cell {index + 1}"
        lab_id = lab_of_answer_cell(cell["source"])
        if lab_id is not None:
            _lab_of_notebook(lab_id, name, where)
            answered |= {f"{lab_id}:{f}" for f in re.findall(r"^def ([A-Za-z_]\w*)\(", cell["source"], re.MULTILINE)}
        function = checked_lab_function(cell["source"])
        if function is None:
            continue
        lab_id = _lab_of_notebook(name[:2], name, where)
        if f"{lab_id}:{function}" not in answered:
            raise LabkitError(f"{where} checks lab {lab_id}'s {function}, but no cell above it starts with "
                              f"'# lab {lab_id}: your answer' and defines 'def {function}(lab):'; restore that cell")
        cell["metadata"]["nbgrader"] = lab_check_metadata(lab_id)
    return notebook


def _lab_of_notebook(lab_id: str, name: str, where: str) -> str:
    if lab_id not in LAB_MODULES or lab_of(lab_id).notebook != Path(name).stem:
        raise LabkitError(f"{where} is a lab cell, but labkit.labs has no lab {lab_id} for {Path(name).stem}; add "
                          f"labkit/labs/_lab{name[:2]}.py or remove the lab's cells")
    return lab_id


def exercise_id_of(cell: dict, header: re.Pattern = EXERCISE_HEADER) -> str | None:
    """The ``NN.K`` in a code cell's first line when it matches ``header``, else None."""
    if cell["cell_type"] != "code":
        return None
    match = header.match(cell["source"].split("\n", 1)[0])
    return match.group(1) if match else None


def solution_regions(source: str, where: str) -> list[tuple[int, int]]:
    """Line index pairs (begin marker, end marker) of each solution region; LabkitError if unbalanced."""
    regions, begin = [], None
    for index, line in enumerate(source.split("\n")):
        marker = line.strip()
        if marker == BEGIN_SOLUTION:
            if begin is not None:
                raise LabkitError(
                    f"{where}: '{BEGIN_SOLUTION}' on line {index + 1} opens a region inside another; "
                    f"close the first with '{END_SOLUTION}'"
                )
            begin = index
        elif marker == END_SOLUTION:
            if begin is None:
                raise LabkitError(f"{where}: '{END_SOLUTION}' on line {index + 1} has no '{BEGIN_SOLUTION}' above it")
            regions.append((begin, index))
            begin = None
    if begin is not None:
        raise LabkitError(
            f"{where}: '{BEGIN_SOLUTION}' on line {begin + 1} is never closed; add '{END_SOLUTION}' after the answer"
        )
    return regions


def stub_solution(source: str, exercise_id: str, where: str = "exercise cell") -> str:
    """``source`` with each solution region, markers included, replaced by the indented TODO stub."""
    lines = source.split("\n")
    for begin, end in reversed(solution_regions(source, where)):
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        lines[begin : end + 1] = [indent + line.format(id=exercise_id) for line in STUB]
    return "\n".join(lines)


def find_exercises(notebook: nbformat.NotebookNode, name: str) -> dict[str, ExerciseCells]:
    """Every exercise in a solution notebook, checked against the convention; LabkitError names the fix.

    ``name`` is the notebook's file name, used in messages and to check each ID's ``NN`` prefix.
    """
    cells = notebook.cells
    found: dict[str, dict[str, tuple[int, str]]] = {}
    for index, cell in enumerate(cells):
        where = f"{name} cell {index + 1}"
        for role, exercise_id in _cell_roles(cell, where):
            _check_prefix(exercise_id, name, where)
            roles = found.setdefault(exercise_id, {})
            if role in roles:
                raise LabkitError(
                    f"{where}: exercise {exercise_id} already has a {role} cell (cell {roles[role][0] + 1})"
                )
            roles[role] = (index, cell["source"])
    return {exercise_id: _assemble(exercise_id, roles, name) for exercise_id, roles in found.items()}


def _cell_roles(cell: dict, where: str) -> list[tuple[str, str]]:
    """What a cell is for the convention: ``[(role, exercise_id)]``, empty for an ordinary cell."""
    solution_id = exercise_id_of(cell)
    has_markers = bool(solution_regions(cell["source"], where))
    if solution_id is None:
        if has_markers:
            raise LabkitError(
                f"{where} has solution markers but does not start with '# exercise NN.K'; "
                "add that line or remove the markers"
            )
        bug_id = exercise_id_of(cell, PLANTED_BUG_HEADER)
        if bug_id is not None:
            return [("planted bug", bug_id)]
        if cell["cell_type"] != "code":
            return []
        return _check_roles(cell, where)
    if not has_markers:
        raise LabkitError(
            f"{where} is exercise {solution_id} but has no '{BEGIN_SOLUTION}' / '{END_SOLUTION}' "
            "around the answer, so the student edition would show it"
        )
    if cell.get("metadata", {}).get("nbgrader") != nbgrader_metadata(solution_id):
        header = "# %% nbgrader=" + json.dumps(nbgrader_metadata(solution_id), sort_keys=True)
        raise LabkitError(
            f"{where} (exercise {solution_id}) needs nbgrader's cell metadata; "
            f"start the cell in the .py file with: {header}"
        )
    return [("solution", solution_id)]


def _check_roles(cell: dict, where: str) -> list[tuple[str, str]]:
    checked = [match.group(1) for match in CHECK_CALL.finditer(cell["source"])]
    if len(checked) > 1:
        raise LabkitError(
            f"{where} checks exercises {', '.join(checked)} in one cell; nbgrader grades a cell as one test, "
            "so give each grading.check its own cell"
        )
    if checked and cell.get("metadata", {}).get("nbgrader") != check_metadata(checked[0]):
        header = "# %% nbgrader=" + json.dumps(check_metadata(checked[0]), sort_keys=True)
        raise LabkitError(
            f"{where} (the check of exercise {checked[0]}) is not a locked nbgrader test cell, so a learner's "
            f"edit would count; run `python -m labkit course mark` (it writes this header in the .py file: {header})"
        )
    return [("check", exercise_id) for exercise_id in checked]


def _check_prefix(exercise_id: str, name: str, where: str) -> None:
    if not name.startswith(exercise_id.split(".")[0] + "_"):
        raise LabkitError(
            f"{where}: exercise {exercise_id} does not belong in {name}; an ID starts with its notebook's number"
        )


def _assemble(exercise_id: str, roles: dict[str, tuple[int, str]], name: str) -> ExerciseCells:
    missing = [role for role in ("planted bug", "solution", "check") if role not in roles]
    if missing:
        raise LabkitError(
            f"{name}: exercise {exercise_id} has no {' or '.join(missing)} cell; "
            "see the Exercises section of docs/AUTHORING.md"
        )
    order = [roles[role][0] for role in ("planted bug", "solution", "check")]
    if order != sorted(order):
        raise LabkitError(f"{name}: exercise {exercise_id}'s cells must come in the order planted bug, exercise, check")
    planted_bug, solution, check = (roles[role][1] for role in ("planted bug", "solution", "check"))
    function = next(m.group(2) for m in CHECK_CALL.finditer(check) if m.group(1) == exercise_id)
    definition = re.compile(rf"^def {function}\(", re.MULTILINE)
    if not (definition.search(planted_bug) and definition.search(solution)):
        raise LabkitError(
            f"{name}: exercise {exercise_id} checks {function}, so its planted-bug and exercise cells "
            f"must both define it with 'def {function}('"
        )
    return ExerciseCells(exercise_id, planted_bug, solution, check, function)


def student_notebook(notebook: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """A copy of a solution notebook with answers stubbed and outputs cleared."""
    exercises = find_exercises(notebook, name)
    edition = with_lab_checks(copy.deepcopy(notebook), name)
    for index, cell in enumerate(edition.cells):
        if cell["cell_type"] != "code":
            continue
        cell["outputs"], cell["execution_count"] = [], None
        solution_id = exercise_id_of(cell)
        if solution_id in exercises:
            cell["source"] = stub_solution(cell["source"], solution_id, f"{name} cell {index + 1}")
        cell["metadata"].update(_locks(cell["metadata"].get("nbgrader", {})))
    edition.metadata["labkit"] = dict(EDITION_METADATA)
    # The jupytext pairing belongs to the source notebooks; in the edition it would write .py files next to it.
    edition.metadata.get("jupytext", {}).pop("formats", None)
    return edition


def _locks(nbgrader: dict) -> dict:
    """JupyterLab's cell locks, as nbgrader's release sets them: an answer cell cannot be deleted, a check
    cell can be neither deleted nor edited."""
    if nbgrader.get("grade"):
        return {"deletable": False, "editable": False}
    return {"deletable": False} if nbgrader.get("solution") else {}


def write_student_edition(source: Path, destination: Path, *, force: bool = False) -> list[Path]:
    """Write the student edition of every ``source/NN_*.ipynb`` into ``destination``; return the paths.

    Every notebook is transformed and every target checked before anything is written, so a
    convention error or a learner's work leaves ``destination`` untouched. Refuses to write into
    ``source``, to overwrite a file the generator did not write, and (unless ``force``) to overwrite
    a learner's answers. Each notebook is written whole (a temporary file renamed over the target)
    and only if the target is still what was checked: a learner's save that lands meanwhile is kept.
    """
    source, destination = Path(source), Path(destination)
    paths = _source_notebooks(source, destination)
    if destination.exists() and not destination.is_dir():
        raise LabkitError(f"cannot write the student edition to {destination}: it is a file, not a folder; "
                          "pass another DEST, or move the file away")
    editions = {
        destination / path.name: student_notebook(nbformat.read(path, as_version=4), path.name) for path in paths
    }
    checked = {target: _check_overwrite(target, edition, force) for target, edition in editions.items()}
    try:
        destination.mkdir(parents=True, exist_ok=True)
        for target, edition in editions.items():
            _replace_if_unchanged(target, (nbformat.writes(edition) + "\n").encode("utf-8"), checked[target])
        _copy_companions(source, destination)
    except OSError as error:
        where = error.filename or destination
        raise LabkitError(f"cannot write the student edition to {where} ({error.strerror or error}): make "
                          f"{destination} a writable folder, or pass another DEST") from error
    return list(editions)


def _replace_if_unchanged(target: Path, data: bytes, checked: bytes | None) -> None:
    """Write ``data`` to ``target`` atomically, only if ``target`` still holds ``checked`` (None: absent)."""
    handle = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False)
    temporary = Path(handle.name)
    try:
        with handle:
            handle.write(data)
        if checked is None:
            os.link(temporary, target)  # fails, rather than overwrites, when a save created the target meanwhile
        elif _contents(target) == checked:
            os.replace(temporary, target)
        else:
            raise FileExistsError(target)
    except FileExistsError:
        raise LabkitError(f"{target} changed while the student edition was written (a save from JupyterLab?); "
                          "it was kept as it is: run again to check it") from None
    finally:
        temporary.unlink(missing_ok=True)


def _contents(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


# Pages the notebooks link to with relative links, so that the links work in the edition too.
COMPANION_PAGES = ("GLOSSARY.md",)


def _copy_companions(source: Path, destination: Path) -> None:
    for name in COMPANION_PAGES:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)


def _source_notebooks(source: Path, destination: Path) -> list[Path]:
    if not source.is_dir():
        raise LabkitError(f"no folder {source}: pass the folder of solution notebooks (default: notebooks)")
    resolved_source, resolved_destination = source.resolve(), destination.resolve()
    if resolved_destination == resolved_source or resolved_source in resolved_destination.parents:
        raise LabkitError(
            f"refusing to write the student edition into the source folder {source}; pick another DEST such as student"
        )
    paths = sorted(source.glob(NOTEBOOK_GLOB))
    if not paths:
        raise LabkitError(f"no notebooks named NN_name.ipynb in {source}")
    return paths


def _check_overwrite(target: Path, edition: nbformat.NotebookNode, force: bool) -> bytes | None:
    """The bytes of ``target`` that were checked (None when it does not exist); a LabkitError when it must stay."""
    if target.is_dir():
        raise LabkitError(f"{target} is a folder; move it away, then run again")
    checked = _contents(target)
    if checked is None:
        return None
    try:
        existing = nbformat.reads(checked.decode("utf-8"), as_version=4)
    except Exception as error:  # nbformat raises JSON, validation and OS errors alike for a damaged file
        raise LabkitError(f"cannot read {target} ({type(error).__name__}); move it away, then run again") from error
    if existing.metadata.get("labkit") != EDITION_METADATA:
        raise LabkitError(f"{target} exists and was not written by the student-edition generator; move it away first")
    lost = _lost_work(existing, edition)
    if lost and not force:
        raise LabkitError(
            f"{target} holds {'; '.join(lost)}; regenerating would lose it. Move the notebook away to keep it, "
            "or pass --force to overwrite it"
        )
    return checked


def _lost_work(existing: nbformat.NotebookNode, edition: nbformat.NotebookNode) -> list[str]:
    """What overwriting an existing edition with ``edition`` would lose, as phrases for a message.

    Every cell counts, not only the exercises: a learner's notes, edits to any cell (its text, tags
    or pasted attachments) and the outputs of running the notebook (where its grades are stored for
    `progress`). A difference
    after the solution notebook itself changed is a false alarm, which --force settles.
    """
    old_cells, new_cells = existing.cells, edition.cells
    matcher = difflib.SequenceMatcher(None, [_cell_key(c) for c in old_cells], [_cell_key(c) for c in new_cells],
                                      autojunk=False)
    answered, changed = [], []
    for tag, first, last, _, _ in matcher.get_opcodes():
        if tag in ("replace", "delete"):
            for index in range(first, last):
                exercise_id = exercise_id_of(old_cells[index])
                if exercise_id is not None:
                    answered.append(exercise_id)
                else:
                    changed.append(f"cell {index + 1} ({old_cells[index]['cell_type']}: "
                                   f"{first_line(old_cells[index]['source'], 40)!r})")
    with_outputs = [str(index + 1) for index, cell in enumerate(old_cells) if cell.get("outputs")]
    lost = [f"answers to exercise {', '.join(answered)}"] if answered else []
    if changed:
        lost.append("cells you added or edited (text, tags or attachments): " + ", ".join(changed))
    if with_outputs:
        lost.append(f"the outputs of cells {', '.join(with_outputs)} (your run, with its grades)")
    return lost


def _cell_key(cell: dict) -> tuple[str, str, tuple, str]:
    tags = tuple(cell.get("metadata", {}).get("tags", ()))
    return cell["cell_type"], cell["source"], tags, json.dumps(cell.get("attachments", {}), sort_keys=True)


def main(argv: list[str]) -> int:
    """`python -m labkit student [SRC] [DEST] [--force]`: write the student edition (`make student`)."""
    parser = argparse.ArgumentParser(
        prog="python -m labkit student",
        description="Write the student edition: solutions replaced by TODO stubs, outputs cleared.",
    )
    parser.add_argument("source", nargs="?", default="notebooks", help="solution notebooks (default: notebooks)")
    parser.add_argument("destination", nargs="?", default="student", help="folder to write (default: student)")
    parser.add_argument("--force", action="store_true", help="overwrite notebooks that hold a learner's work (answers, notes, edits, outputs)")
    args = parser.parse_args(argv)
    written = write_student_edition(Path(args.source), Path(args.destination), force=args.force)
    names = ", ".join(path.name for path in written)
    print(f"wrote the student edition of {len(written)} notebook(s) to {args.destination}/: {names}")
    return 0
