"""Self-grading exercises: run a check on the learner's function, print one friendly line, keep score.

In a notebook (taught in 00_start_here)::

    grading.check("00.1", one_training_step)   # ✓ Exercise 00.1 passed: ...  or  ✗ ... not yet: ... Hint: ...
    grading.score()                            # Score for this notebook: 1/2 exercises passed

`check` never raises on a wrong answer, not even when the answer itself raises: the learner reads
one sentence saying what is still wrong and a hint, never a traceback. Each verdict is also
displayed as `application/vnd.labkit.grade+json`, so `python -m labkit progress [folder]` can read
a learner's executed notebooks and show which exercises pass across the course. The checks
themselves live in `labkit/exercises/nbNN.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import LabkitError
from labkit.exercises import Exercise, NotYet, exercise_order, registry
from labkit.messages import describe_error
from labkit.notebooks import show_record, stored_records

__all__ = ["EXERCISE_NAMESPACE", "check", "score"]

GRADE_MIMETYPE = "application/vnd.labkit.grade+json"

# The only names an exercise cell (planted bug or answer) may use besides what it defines itself,
# so tests/test_exercises.py can run each cell on its own, away from the rest of its notebook.
EXERCISE_NAMESPACE = MappingProxyType({"torch": torch, "nn": nn, "F": F, "np": np, "math": math})

PASSED, NOT_YET, NOT_RUN = "passed", "not yet", "not run"
# Long exception messages (torch's can run to paragraphs) are cut so the verdict stays one line.
MAX_ERROR_CHARS = 160

_NOT_ATTEMPTED = "{name} is not attempted yet (it still raises NotImplementedError)"
_WHERE_TO_ANSWER = (
    "replace the TODO lines in the cell marked '# exercise {id}' with your answer, run it, then run this check"
)
# The latest verdict per exercise in this kernel session; `score` reads it.
_SESSION: dict[str, Result] = {}


@dataclass(frozen=True)
class Result:
    """One check's verdict: the exercise, its notebook, whether it passed and the line shown."""

    exercise: str
    notebook: str
    passed: bool
    message: str


class _AnswerRaised(Exception):
    """Carries an exception raised inside the learner's function, to tell it apart from a bad result."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def known_exercises() -> list[str]:
    """The IDs of every registered exercise, in course order."""
    return list(registry())


def run_check(exercise_id: str, answer: Callable) -> Result:
    """Check ``answer`` for ``exercise_id`` and return the verdict without printing or recording it.

    Taught in 00_start_here. Raises `LabkitError` only for an unknown ID; a wrong, unfinished or
    crashing answer gives a `Result` with ``passed=False`` and a friendly message.
    """
    spec = _lookup(exercise_id)
    if not callable(answer):
        return _not_yet(
            spec,
            f"grading.check needs your function itself, but it got a {type(answer).__name__}",
            hint=f'pass the name without parentheses, as in grading.check("{spec.id}", my_function)',
        )
    name = getattr(answer, "__name__", "your function")
    try:
        with _check_environment():
            praise = spec.check(_guarded(answer))
    except NotYet as verdict:
        return _not_yet(spec, verdict.problem, verdict.hint)
    except _AnswerRaised as raised:
        if isinstance(raised.error, NotImplementedError):
            # The fix is the exercise itself, so before a first attempt the hint only says where to write.
            return _not_yet(spec, _NOT_ATTEMPTED.format(name=name), _WHERE_TO_ANSWER.format(id=spec.id))
        return _not_yet(spec, f"{name} raised {describe_error(raised.error, MAX_ERROR_CHARS)}")
    except Exception as error:  # the answer returned something the check could not even inspect
        return _not_yet(spec, f"checking what {name} returned failed with {describe_error(error, MAX_ERROR_CHARS)}")
    return Result(spec.id, spec.notebook, True, f"✓ Exercise {spec.id} passed: {_sentence(praise)}")


def check(exercise_id: str, answer: Callable) -> None:
    """Check ``answer``, show the verdict and remember it for `score` (taught in 00_start_here)."""
    result = run_check(exercise_id, answer)
    _SESSION[result.exercise] = result
    _show(result)


def score() -> None:
    """Print how many of this notebook's exercises passed, by each one's latest check (00_start_here)."""
    checked_notebooks = sorted({result.notebook for result in _SESSION.values()})
    if not checked_notebooks:
        print("Score for this notebook: no exercise checked yet; run the grading.check cells above first.")
        return
    for notebook in checked_notebooks:
        label = "this notebook" if len(checked_notebooks) == 1 else notebook
        print(f"Score for {label}: {_score_line(notebook)}")


def _score_line(notebook: str) -> str:
    exercise_ids = [spec.id for spec in registry().values() if spec.notebook == notebook]
    waiting = [eid for eid in exercise_ids if not (eid in _SESSION and _SESSION[eid].passed)]
    line = f"{len(exercise_ids) - len(waiting)}/{len(exercise_ids)} exercises passed"
    return line + (f" (not yet: {', '.join(waiting)})" if waiting else "")


def _lookup(exercise_id: str) -> Exercise:
    exercises = registry()
    if exercise_id not in exercises:
        raise LabkitError(
            f"no exercise {exercise_id!r}: the known exercises are {', '.join(exercises)}; "
            "copy the ID from the cell's first line ('# exercise NN.K')"
        )
    return exercises[exercise_id]


def _guarded(answer: Callable) -> Callable:
    @functools.wraps(answer)
    def guarded(*args, **kwargs):
        try:
            return answer(*args, **kwargs)
        except Exception as error:
            raise _AnswerRaised(error) from error

    return guarded


@contextlib.contextmanager
def _check_environment() -> Iterator[None]:
    """Seed the check, and give the notebook back its random state afterwards.

    A check that consumed the notebook's random numbers would change every later cell's output,
    and differently in the solution and student editions.
    """
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        # the CPU generator only: fork_rng(devices=[]) restores no CUDA state
        torch.default_generator.manual_seed(0)
        np.random.seed(0)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)


def _not_yet(spec: Exercise, problem: str, hint: str | None = None) -> Result:
    message = f"✗ Exercise {spec.id} not yet: {_clause(problem)}. Hint: {_sentence(hint or spec.hint)}"
    return Result(spec.id, spec.notebook, False, message)


def _clause(text: str) -> str:
    return text.strip().rstrip(".")


def _sentence(text: str) -> str:
    return _clause(text) + "."


def _show(result: Result) -> None:
    """Display the verdict as JSON for `progress` plus plain text; plain print outside IPython."""
    show_record(result.message, GRADE_MIMETYPE, asdict(result))


# ---- progress across a folder of executed notebooks --------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One exercise's standing in a learner's folder: ``passed``, ``not yet`` or ``not run``."""

    notebook: str
    exercise: str
    title: str
    status: str
    message: str


def read_grades(path: Path) -> dict[str, dict]:
    """The grade payloads stored in one executed notebook, by exercise; a later output wins."""
    return {payload["exercise"]: payload for payload in stored_records(path, GRADE_MIMETYPE)}


def course_progress(folder: Path) -> list[Progress]:
    """Every exercise of the course with its standing in ``folder``'s executed notebooks."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LabkitError(f"no folder {folder}: write the student edition with `make student`, then run its notebooks")
    paths = sorted(folder.glob("*.ipynb"))
    if not paths:
        raise LabkitError(f"no notebooks in {folder}: pass the folder that holds your executed student notebooks")
    known = registry()
    grades = _merge_grades(paths)
    rows = [_progress_row(spec.notebook, spec.id, spec.title, grades.get(spec.id)) for spec in known.values()]
    # A notebook from an older or newer course edition may grade an exercise this labkit does not know.
    rows += [
        _progress_row(payload["notebook"], eid, "(not in this labkit)", payload)
        for eid, payload in grades.items()
        if eid not in known
    ]
    return sorted(rows, key=lambda row: exercise_order(row.exercise))


def _merge_grades(paths: list[Path]) -> dict[str, dict]:
    """Each exercise's verdict across notebooks; a pass anywhere counts, so a saved copy cannot hide it."""
    grades: dict[str, dict] = {}
    for path in paths:
        for exercise_id, payload in read_grades(path).items():
            if exercise_id not in grades or payload["passed"]:
                grades[exercise_id] = payload
    return grades


def _progress_row(notebook: str, exercise_id: str, title: str, payload: dict | None) -> Progress:
    if payload is None:
        return Progress(notebook, exercise_id, title, NOT_RUN, "")
    return Progress(notebook, exercise_id, title, PASSED if payload["passed"] else NOT_YET, payload["message"])


def progress_table(rows: list[Progress]) -> str:
    """The rows as an aligned text table with a total line."""
    header = ("notebook", "exercise", "status", "title")
    lines = [header] + [(row.notebook, row.exercise, row.status, row.title) for row in rows]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    text = ["  ".join(value.ljust(width) for value, width in zip(line, widths)).rstrip() for line in lines]
    counts = _counts(rows)
    text.append(
        f"Total: {counts[PASSED]}/{len(rows)} exercises passed "
        f"({counts[NOT_YET]} not yet, {counts[NOT_RUN]} not run)"
    )
    return "\n".join(text)


def _counts(rows: list[Progress]) -> dict[str, int]:
    return {status: sum(row.status == status for row in rows) for status in (PASSED, NOT_YET, NOT_RUN)}


def progress_main(argv: list[str]) -> int:
    """`python -m labkit progress [folder] [--json]`: which exercises pass across the course."""
    parser = argparse.ArgumentParser(
        prog="python -m labkit progress",
        description="Show which exercises pass in a folder of executed student notebooks.",
    )
    parser.add_argument("folder", nargs="?", default="student", help="folder of executed notebooks (default: student)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = course_progress(Path(args.folder))
    if args.json:
        counts = _counts(rows)
        total = {"exercises": len(rows), "passed": counts[PASSED], "not_yet": counts[NOT_YET]}
        total["not_run"] = counts[NOT_RUN]
        report = {"folder": args.folder, "exercises": [asdict(row) for row in rows], "total": total}
        print(json.dumps(report, indent=2))
    else:
        print(progress_table(rows))
    return 0
