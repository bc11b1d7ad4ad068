"""Debugging labs: a training run with a defect you have not seen; find the cause, repair it, prove it.

Each notebook's lab trains a small model on data the notebook has not shown, with one defect drawn
for you from the notebook's family. In a notebook::

    lab = labs.start("02")            # runs the training and prints what you would see
    lab.model, lab.losses, ...        # the run's objects, for your own measurements
    lab.rerun(begin_step=my_version)  # the same run with a stage of yours, to try an idea

    def diagnose(lab):                # your answer: a cause from lab.causes and the stage you rewrote
        return "a cause from lab.causes", my_version

    labs.check(lab, diagnose)

Your variant is drawn from who you are (`labkit.labs._draw` says how), so the autograder reruns the
run you saw. The check reruns the training with your repaired stage and compares it with the same
training without the defect.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from labkit.errors import LabkitError
from labkit.grading import EXERCISE_NAMESPACE, GRADE_MIMETYPE, NBGRADER_EXECUTION, Result
from labkit.labs._check import MAX_ERROR_CHARS, check_lab, grade_id
from labkit.labs._draw import draw, learner_key
from labkit.labs._isolated import answer_cell, grade_lab_cell, not_attempted
from labkit.labs._lab import Run
from labkit.labs._registry import lab_ids, lab_of
from labkit.messages import describe_error
from labkit.records import show_record

__all__ = ["LabSession", "check", "start"]

# Failed checks per lab in this kernel session: each one makes the next hint more explicit.
_FAILED_TRIES: dict[str, int] = {}


class LabSession:
    """Your run of one lab: its causes, its stages' contracts, the run's objects, and `rerun`."""

    def __init__(self, lab_id: str, key: str) -> None:
        self._lab = lab_of(lab_id)
        self._key = key
        index, self.seed = draw(lab_id, key, len(self._lab.variants))
        self._variant = self._lab.variants[index].id
        self.causes = tuple(cause.name for cause in self._lab.causes)
        self.stages = dict(self._lab.stages)
        self.run = self._lab.run(self._lab.stages_of(self._lab.variant(self._variant)), self.seed)
        for name, value in self.run.objects.items():
            setattr(self, name, value)

    def rerun(self, **stages: Callable) -> Run:
        """Your run again with some stages replaced by yours (by stage name); prints what it shows."""
        unknown = sorted(set(stages) - set(self.stages))
        if unknown:
            raise LabkitError(f"{', '.join(unknown)} is not a stage of lab {self._lab.id}: its stages are "
                              f"{', '.join(self.stages)}")
        run = self._lab.run({**self._lab.stages_of(self._lab.variant(self._variant)), **stages}, self.seed)
        self._lab.show(run)
        return run

    def describe(self) -> None:
        """Print the causes you may diagnose and the stages you may repair."""
        print(f"Lab {self._lab.id}: {self._lab.title}")
        print("Causes you may diagnose:\n" + "\n".join(f"  - {name}" for name in self.causes))
        print("Stages of the training you may repair (write a function with the stage's name):")
        print("\n".join(f"  - {name}: {contract}" for name, contract in self.stages.items()))
        print("Write diagnose(lab) and your stage function in the lab's answer cell, with every helper they use:"
              f" the check runs that cell on its own, where only {', '.join(EXERCISE_NAMESPACE)} are defined.")


def start(lab_id: str, *, seed: int | None = None, learner: str | None = None) -> LabSession:
    """Run your variant of lab ``lab_id`` and print what it shows; returns the session to investigate.

    The variant is drawn from ``seed`` or ``learner`` when given, else from your nbgrader student ID
    or login (the same for you every time).
    """
    session = LabSession(lab_id, learner_key(seed, learner))
    session._lab.show(session.run)
    session.describe()
    return session


def check(session: LabSession, answer: Callable | str,
          repair: Callable | Mapping[str, Callable] | str | None = None) -> None:
    """Check your diagnosis and repair of your run, print the verdict and record it like an exercise's.

    ``answer`` is your function ``diagnose(lab)`` returning (diagnosis, repair), or the diagnosis itself
    with ``repair`` after it. When ``diagnose`` was defined in the lab's answer cell (``# lab NN: your
    answer``), that cell's source is graded in a process of its own (`labkit.labs._isolated`), as
    nbgrader's autograde and ``labkit progress`` grade it; otherwise the check runs here. Under nbgrader's
    autograde a failed check raises `AssertionError`, as a failed exercise does.
    """
    if not isinstance(session, LabSession):
        raise LabkitError(f"labs.check needs the session labs.start returned, got a {type(session).__name__}: "
                          'run lab = labs.start("NN") first and pass lab')
    lab_id = session._lab.id
    try_number = _FAILED_TRIES.get(lab_id, 0) + 1
    cell = answer_cell(lab_id, answer) if repair is None and callable(answer) else None
    if cell is not None:
        result = grade_lab_cell(lab_id, cell, answer.__name__, session._key, try_number=try_number)
        if not result.passed and not result.message.endswith(not_attempted(answer.__name__) + "."):
            _FAILED_TRIES[lab_id] = try_number
        _show(result)
        return
    diagnosis, repair, problem = _submission(session, answer, repair)
    if problem is not None:
        result = Result(grade_id(lab_id), session._lab.notebook, False, f"✗ Lab {lab_id} not yet: {problem}.")
    else:
        result = check_lab(lab_id, session._variant, diagnosis, repair, seed=session.seed, try_number=try_number)
        if not result.passed:
            _FAILED_TRIES[lab_id] = try_number
    _show(result)


def _show(result: Result) -> None:
    show_record(result.message, GRADE_MIMETYPE, {"exercise": result.exercise, "notebook": result.notebook,
                                                 "passed": result.passed, "message": result.message})
    if not result.passed and os.environ.get(NBGRADER_EXECUTION):
        raise AssertionError(result.message)


def _submission(session: LabSession, answer, repair) -> tuple[str, object, str | None]:
    """(diagnosis, repair, None), or a sentence saying why the answer gives none (an unfinished one included)."""
    if repair is not None or not callable(answer):
        return answer, repair, None
    try:
        given = answer(session)
    except NotImplementedError:
        return "", None, not_attempted(getattr(answer, "__name__", "your function"))
    except KeyboardInterrupt:
        raise
    except Exception as error:
        return "", None, f"your function raised {describe_error(error, MAX_ERROR_CHARS)}"
    if not (isinstance(given, tuple) and len(given) == 2):
        return "", None, ("your function must return two things, your diagnosis and your repair, as in "
                          "return \"a cause from lab.causes\", my_stage_function")
    return given[0], given[1], None


def catalogue() -> list[dict]:
    """Every lab as plain data for instructors and tests: ID, notebook, causes and variants, no code."""
    return [{"id": lab.id, "notebook": lab.notebook, "title": lab.title,
             "causes": [cause.name for cause in lab.causes],
             "variants": [{"id": v.id, "cause": v.cause, "symptom": v.symptom} for v in lab.variants]}
            for lab in map(lab_of, lab_ids())]
