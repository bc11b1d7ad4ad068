"""nbgrader's autograde scores labkit exercises from outside the learner's kernel.

Under autograde the learner's answer cell runs in the same kernel before the locked check cell, so
it can replace `grading.check`, unset ``NBGRADER_EXECUTION`` or patch torch, and the check cell's
outcome means nothing. `RegradeInIsolation` runs in nbgrader's own process after `Execute`: for
each locked check cell it grades the notebook's exercise cell with `grading.grade_cell`, or for a lab's
check cell the lab's answer cell with `labkit.labs._isolated.grade_lab_cell` for the student nbgrader
grades (a process of its own, as ``labkit progress`` does, so the two agree) and replaces the check cell's outputs
with that verdict: the verdict line, and an AssertionError when it is not a pass, which is how
nbgrader's `SaveAutoGrades` scores a test cell. A pass whose cell uses what no lesson calls for (the call
stack, raw descriptors, private names: `labkit.course._answer_review`) gets a line saying what to read, for the
grader in formgrader, and a warning in the log; the score stands. `AUTOGRADE_PREPROCESSORS` is nbgrader's default
list with it inserted; the course's nbgrader_config.py (`labkit.course.layout`) sets it.
"""

from __future__ import annotations

import nbformat
from nbgrader.preprocessors import NbGraderPreprocessor

from labkit import grading, student
from labkit.course._answer_review import reaches
from labkit.course.marks import checked_exercise
from labkit.labs._draw import learner_key
from labkit.labs._isolated import checked_function as checked_lab_function
from labkit.labs._isolated import grade_lab_cell, lab_of_answer_cell

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
    """Replace each labkit check cell's outputs with the verdict of its exercise or lab graded in isolation."""

    def preprocess(self, nb, resources):
        answers = {eid: cell.source for cell in nb.cells if (eid := student.exercise_id_of(cell)) is not None}
        lab_answers = {lab_id: cell.source for cell in nb.cells
                       if cell.cell_type == "code" and (lab_id := lab_of_answer_cell(cell.source)) is not None}
        name = resources.get("metadata", {}).get("name", "notebook")
        for cell in nb.cells:
            lab_check = _graded_lab_check(cell, name)
            if lab_check is not None:
                result = self._regrade_lab(*lab_check, lab_answers, name, resources)
                cell.outputs = _outputs(result, self._review(result, lab_answers.get(lab_check[0], "")))
                continue
            graded = _graded_check(cell, name)
            if graded is None:
                continue
            exercise_id, function = graded
            result = grading.grade_cell(exercise_id, answers.get(exercise_id, ""), function,
                                        where=f"{name} exercise {exercise_id}", follow_up=False)
            self.log.info("labkit regraded exercise %s in isolation: %s", exercise_id,
                          "passed" if result.passed else "not yet")
            cell.outputs = _outputs(result, self._review(result, answers.get(exercise_id, "")))
        return nb, resources

    def _review(self, result: grading.Result, source: str) -> tuple[str, ...]:
        """What a passing answer cell uses that no lesson calls for, logged as a warning."""
        review = reaches(source) if result.passed else ()
        if review:
            self.log.warning("labkit: %s passed with a cell to read before you trust the pass: %s", result.exercise,
                             "; ".join(review))
        return review

    def _regrade_lab(self, lab_id: str, function: str, answers: dict, name: str, resources) -> grading.Result:
        """The lab's answer cell graded for the student nbgrader grades, whose identity draws the variant
        (not a seed or name the learner's cells chose)."""
        student_id = resources.get("nbgrader", {}).get("student")
        key = learner_key(learner=student_id) if student_id else learner_key()
        result = grade_lab_cell(lab_id, answers.get(lab_id, ""), function, key, where=f"{name} lab {lab_id}",
                                follow_up=False)
        self.log.info("labkit regraded lab %s for %s in isolation: %s", lab_id, student_id,
                      "passed" if result.passed else "not yet")
        return result


def _graded_lab_check(cell, name: str) -> tuple[str, str] | None:
    """(lab, function) of a locked, graded lab check cell (`student.with_lab_checks`); None for any other cell."""
    meta = cell.metadata.get("nbgrader", {})
    if cell.cell_type != "code" or not (meta.get("grade") and meta.get("locked")):
        return None
    function = checked_lab_function(cell.source)
    return (name[:2], function) if function else None


def _graded_check(cell, name: str) -> tuple[str, str] | None:
    """(exercise, function) of a locked, graded labkit check cell; None for any other cell."""
    meta = cell.metadata.get("nbgrader", {})
    if cell.cell_type != "code" or not (meta.get("grade") and meta.get("locked")):
        return None
    exercise_id = checked_exercise(cell, f"{name} cell {meta.get('grade_id')}")
    match = student.CHECK_CALL.search(cell.source)
    return (exercise_id, match.group(2)) if exercise_id and match else None


def _outputs(result: grading.Result, review: tuple[str, ...] = ()) -> list:
    record = {grading.GRADE_MIMETYPE: {"exercise": result.exercise, "notebook": result.notebook,
                                       "passed": result.passed, "message": result.message},
              "text/plain": result.message}
    outputs = [nbformat.v4.new_output("display_data", data=record)]
    if review:
        outputs.append(nbformat.v4.new_output("stream", name="stdout", text=review_line(review) + "\n"))
    if not result.passed:
        outputs.append(nbformat.v4.new_output("error", ename="AssertionError", evalue=result.message,
                                              traceback=[f"AssertionError: {result.message}"]))
    return outputs


def review_line(review: tuple[str, ...]) -> str:
    """The line a pass to review shows under its verdict."""
    return ("To review: the answer cell uses what no lesson calls for, so it may be written against its check, "
            f"not the lesson; read it before you trust the pass: {'; '.join(review)}")
