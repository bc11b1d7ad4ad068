"""The nbgrader test metadata of every exercise's check cell, written into the solution notebooks.

`python -m labkit course mark [NAMES]` finds each `grading.check("NN.K", function)` cell, checks that
``NN.K`` is an exercise the registry (`labkit.exercises`) gives to that notebook, and sets the cell's
nbgrader metadata to `labkit.student.check_metadata` in the .ipynb (outputs kept) and in its py twin.
It executes nothing and is idempotent, so it can be rerun after any merge that added or rewrote an
exercise; `make student` and `make course` refuse a check cell without it.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from labkit import student
from labkit.errors import LabkitError
from labkit.exercises import registry
from labkit.notebooks import pair_differences, paired_script, write_script

__all__: list[str] = []


def checked_exercise(cell: dict, where: str) -> str | None:
    """The exercise a code cell checks, or None; LabkitError for a cell that checks several."""
    if cell["cell_type"] != "code":
        return None
    checked = [match.group(1) for match in student.CHECK_CALL.finditer(cell["source"])]
    if len(checked) > 1:
        raise LabkitError(f"{where} checks {', '.join(checked)} in one cell; give each grading.check its own cell")
    return checked[0] if checked else None


def registered_in(exercise_id: str, notebook: str, where: str) -> None:
    """LabkitError unless ``exercise_id`` is registered for ``notebook`` (a stem such as 00_start_here)."""
    spec = registry().get(exercise_id)
    if spec is None or spec.notebook != notebook:
        known = [eid for eid, other in registry().items() if other.notebook == notebook]
        raise LabkitError(
            f"{where} checks exercise {exercise_id}, which labkit.exercises does not register for {notebook} "
            f"(it registers {', '.join(known) or 'none'}); fix the ID or add the check to labkit/exercises/"
        )


def marked(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """Set the test metadata on ``nb``'s check cells in place; return the exercises whose cell changed.

    A cell that carries grade metadata but no longer calls `grading.check` loses it, so a check that
    moved leaves no stale test behind.
    """
    changed = []
    for index, cell in enumerate(nb.cells):
        where = f"{name} cell {index + 1}"
        exercise_id = checked_exercise(cell, where)
        current = cell.get("metadata", {}).get("nbgrader")
        if exercise_id is None:
            if current is not None and current.get("grade") and not current.get("solution"):
                del cell.metadata["nbgrader"]
                changed.append(f"cell {index + 1} (no check any more)")
            continue
        registered_in(exercise_id, Path(name).stem, where)
        if current != student.check_metadata(exercise_id):
            cell.metadata["nbgrader"] = student.check_metadata(exercise_id)
            changed.append(exercise_id)
    return changed


def mark_notebooks(paths: list[Path]) -> dict[Path, list[str]]:
    """Mark every notebook in ``paths`` and its py twin; return what changed, by notebook.

    Every notebook is read and checked before any is written, so an unknown exercise ID or a pair
    out of sync leaves all files as they were.
    """
    updates = {}
    for path in paths:
        script = paired_script(path)
        if script.exists() and pair_differences(path):
            raise LabkitError(f"{path.name} and {script} disagree; sync them first (make notebooks NB={path.stem})")
        nb = nbformat.read(path, as_version=4)
        changes = marked(nb, path.name)
        if changes:
            updates[path] = (nb, changes)
    for path, (nb, _) in updates.items():
        text = nbformat.writes(nb)
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        if paired_script(path).exists():
            write_script(nb, paired_script(path))
    return {path: changes for path, (_, changes) in updates.items()}
