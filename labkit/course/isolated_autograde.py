"""nbgrader's autograde scores labkit exercises from outside the learner's kernel.

Under autograde the learner's answer cell runs in the same kernel before the locked check cell, so
it can replace `grading.check`, unset ``NBGRADER_EXECUTION`` or patch torch, and the check cell's
outcome means nothing. `RegradeInIsolation` runs in nbgrader's own process after `Execute`: for
each locked check cell it grades the notebook's exercise cell with `grading.grade_cell` (a process
of its own, as ``labkit progress`` does, so the two agree) and replaces the check cell's outputs
with that verdict: the verdict line, and an AssertionError when it is not a pass, which is how
nbgrader's `SaveAutoGrades` scores a test cell. `AUTOGRADE_PREPROCESSORS` is nbgrader's default
list with it inserted; the course's nbgrader_config.py (`labkit.course.layout`) sets it.
"""

from __future__ import annotations

import nbformat
from nbgrader.preprocessors import NbGraderPreprocessor

from labkit import grading, student
from labkit.course.marks import checked_exercise

__all__: list[str] = []

# nbgrader's Autograde.autograde_preprocessors (0.9) with the regrade right after Execute, by import
# path, as the course's nbgrader_config.py names them.
AUTOGRADE_PREPROCESSORS = [
    "nbgrader.preprocessors.Execute",
    "labkit.course.isolated_autograde.RegradeInIsolation",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]


class RegradeInIsolation(NbGraderPreprocessor):
    """Replace each labkit check cell's outputs with the verdict of its exercise graded in isolation."""

    def preprocess(self, nb, resources):
        answers = {eid: cell.source for cell in nb.cells if (eid := student.exercise_id_of(cell)) is not None}
        name = resources.get("metadata", {}).get("name", "notebook")
        for cell in nb.cells:
            graded = _graded_check(cell, name)
            if graded is None:
                continue
            exercise_id, function = graded
            result = grading.grade_cell(exercise_id, answers.get(exercise_id, ""), function,
                                        where=f"{name} exercise {exercise_id}", follow_up=False)
            self.log.info("labkit regraded exercise %s in isolation: %s", exercise_id,
                          "passed" if result.passed else "not yet")
            cell.outputs = _outputs(result)
        return nb, resources


def _graded_check(cell, name: str) -> tuple[str, str] | None:
    """(exercise, function) of a locked, graded labkit check cell; None for any other cell."""
    meta = cell.metadata.get("nbgrader", {})
    if cell.cell_type != "code" or not (meta.get("grade") and meta.get("locked")):
        return None
    exercise_id = checked_exercise(cell, f"{name} cell {meta.get('grade_id')}")
    match = student.CHECK_CALL.search(cell.source)
    return (exercise_id, match.group(2)) if exercise_id and match else None


def _outputs(result: grading.Result) -> list:
    record = {grading.GRADE_MIMETYPE: {"exercise": result.exercise, "notebook": result.notebook,
                                       "passed": result.passed, "message": result.message},
              "text/plain": result.message}
    outputs = [nbformat.v4.new_output("display_data", data=record)]
    if not result.passed:
        outputs.append(nbformat.v4.new_output("error", ename="AssertionError", evalue=result.message,
                                              traceback=[f"AssertionError: {result.message}"]))
    return outputs
