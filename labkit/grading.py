"""Self-grading exercises: run a check on the learner's function, print one friendly line, keep score.

In a notebook (taught in 00_start_here)::

    grading.check("00.1", one_training_step)   # ✓ Exercise 00.1 passed: ...  or  ✗ ... not yet: ... Hint: ...
    grading.score()                            # Score for this notebook: 1/2 exercises passed

`check` never raises on a wrong answer, not even when the answer itself raises, exits or never
returns (each check has a time limit, `CHECK_TIME_LIMIT_S`): the learner reads one sentence saying
what is still wrong and a hint, never a traceback. A check leaves the notebook's global state
(random streams, default dtype, warning filters, threads, patched torch functions, ...) as it
found it. Each verdict is also displayed as `application/vnd.labkit.grade+json`, so
`python -m labkit progress [folder] --stored` can read a learner's executed notebooks and show which
exercises pass across the course. The checks themselves live in `labkit/exercises/nbNN.py`.
"""

from __future__ import annotations

import linecache
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from labkit._check_sandbox import (
    WALL_LIMIT_FACTOR,
    _AnswerRaised,
    _Attempt,
    _CheckTimedOut,
    _isolated_check,
    _plain_str,
)
from labkit._grader_process import grade_in_child
from labkit._stub_answer import is_untouched_stub
from labkit.errors import LabkitError
from labkit.exercises import Exercise, Hint, NotYet, registry
from labkit.messages import describe_error
from labkit.records import show_record

__all__ = ["EXERCISE_NAMESPACE", "check", "score"]

GRADE_MIMETYPE = "application/vnd.labkit.grade+json"

# The only names an exercise cell (planted bug or answer) may use besides what it defines itself,
# so tests/test_exercises.py can run each cell on its own, away from the rest of its notebook.
EXERCISE_NAMESPACE = MappingProxyType({"torch": torch, "nn": nn, "F": F, "np": np, "math": math})

# nbgrader sets this ("autograde" or "validate") in the kernels it grades with.
NBGRADER_EXECUTION = "NBGRADER_EXECUTION"
# Every check needs well under a second of CPU; an answer still computing after this many seconds
# of CPU time (the process's, all threads) is stopped, so a `while True:` loop cannot hang the
# learner's notebook. CPU time, because a shared or slow machine stretches wall time several
# times and a spurious stop would change stored output; a call that waits (sleep, a lock) uses no
# CPU, so a wall-clock bound of WALL_LIMIT_FACTOR (labkit._check_sandbox) times the limit stops that.
CHECK_TIME_LIMIT_S = 10.0
# Long exception messages (torch's can run to paragraphs) are cut so the verdict stays one line.
MAX_ERROR_CHARS = 160

_NOT_ATTEMPTED_MARK = "is not attempted yet"
_NOT_ATTEMPTED = "{name} " + _NOT_ATTEMPTED_MARK + " (it still raises NotImplementedError)"
_WHERE_TO_ANSWER = (
    "in the cell marked '# exercise {id}', replace the lines '# YOUR CODE HERE' and 'raise NotImplementedError(...)' "
    "with your answer, run that cell, then run this check"
)
# Said after a hint only when the next failed try's hint is a different one, so the promise is kept.
_MORE_HINTS = " If your next try fails too, its hint says more."
# The last step of a progressive hint is the recipe; it is held back until this failed try, so a
# learner tries a few times with nudges before being handed the answer.
RECIPE_TRY = 4
# How the first line of an exercise cell reads (labkit.student.EXERCISE_HEADER says the same).
_EXERCISE_HEADER = "# exercise {id}"
# The latest verdict per exercise in this kernel session; `score` reads it.
_SESSION: dict[str, Result] = {}
# How many attempts at each exercise failed in this kernel session (a stub's "not attempted" does
# not count); `check` shows the hint for the next attempt, so hints grow more explicit.
_FAILED_TRIES: dict[str, int] = {}
# The exercises whose recipe a failed try has shown in this kernel session.
_RECIPE_SHOWN: set[str] = set()


@dataclass(frozen=True)
class Result:
    """One check's verdict: the exercise, its notebook, whether it passed and the line shown."""

    exercise: str
    notebook: str
    passed: bool
    message: str
    # this failure's hint was the recipe (the last step of a progressive hint)
    recipe_shown: bool = False
    # this pass came after the recipe had been shown in the same kernel session
    after_recipe: bool = False


def known_exercises() -> list[str]:
    """The IDs of every registered exercise, in course order."""
    return list(registry())


def run_check(exercise_id: str, answer: Callable, *, time_limit_s: float | None = None, try_number: int = 1,
              follow_up: bool = True) -> Result:
    """Check ``answer`` for ``exercise_id`` and return the verdict without printing or recording it.

    Used in 00_start_here. Raises `LabkitError` only for an unknown ID; a wrong, unfinished,
    crashing, exiting (``sys.exit``) or endless answer gives a `Result` with ``passed=False`` and a
    friendly message. The check runs under a time limit (``time_limit_s``, default
    `CHECK_TIME_LIMIT_S`) and leaves the notebook's global state as it found it (see
    `_isolated_check`). Ctrl-C (the notebook's stop button) is not a verdict: it stops the check,
    says so, and propagates, so "Run all" stops as the learner asked. Hints are progressive:
    ``try_number`` (1 for a first try) picks how explicit the hint of a failure is (`hint_for`);
    ``follow_up=False`` (a re-check in a report, which has no next try) leaves out the promise that
    the next try's hint says more.
    """
    spec = _lookup(exercise_id)
    if not (isinstance(try_number, int) and not isinstance(try_number, bool) and try_number >= 1):
        raise LabkitError(f"try_number must be a whole number from 1 (a first try), got {try_number!r}")
    if not callable(answer):
        return _not_yet(
            spec,
            f"grading.check needs your function itself, but it got a {type(answer).__name__}",
            hint=f'pass the name without parentheses, as in grading.check("{spec.id}", my_function)',
        )
    limit = CHECK_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    if not (isinstance(limit, int | float) and not isinstance(limit, bool) and 0 < limit < math.inf):
        raise LabkitError(f"time_limit_s must be a positive number of seconds, got {limit!r}")
    name = _plain_str(getattr(answer, "__name__", None)) or "your function"
    attempt = _Attempt(answer)
    try:
        with _isolated_check(spec, attempt, limit):
            praise = spec.check(attempt)
    except NotYet as verdict:
        return _not_yet(spec, verdict.problem, verdict.hint, try_number, follow_up)
    except _AnswerRaised as raised:
        return _answer_raised(spec, name, raised.error, try_number, follow_up)
    except _CheckTimedOut as stopped:
        if attempt.stopped:
            return _not_yet(
                spec,
                f"your function {name} did not return within {stopped.limit} (the check stopped it)",
                hint="look for a loop that never ends or a call that waits forever; each check needs well under a second",
            )
        return _not_yet(spec, f"checking what {name} returned did not finish within {stopped.limit}")
    except KeyboardInterrupt:
        print(f"Exercise {spec.id}: check interrupted, no verdict recorded; run the check cell again.")
        raise
    except Exception as error:  # the answer returned something the check could not even inspect
        return _not_yet(spec, f"checking what {name} returned failed with {describe_error(error, MAX_ERROR_CHARS)}")
    return Result(spec.id, spec.notebook, True, f"✓ Exercise {spec.id} passed: {_sentence(praise)}")


def _answer_raised(spec: Exercise, name: str, error: BaseException, try_number: int, follow_up: bool) -> Result:
    if isinstance(error, NotImplementedError):
        # The fix is the exercise itself, so before a first attempt the hint only says where to write.
        return _not_yet(spec, _NOT_ATTEMPTED.format(name=name), _WHERE_TO_ANSWER.format(id=spec.id))
    if isinstance(error, SystemExit):
        return _not_yet(
            spec,
            f"{name} called exit() ({describe_error(error, MAX_ERROR_CHARS)}), which would end the notebook's kernel",
            hint="return the result instead of calling sys.exit() or exit()",
        )
    return _not_yet(spec, f"{name} raised {describe_error(error, MAX_ERROR_CHARS)}", None, try_number, follow_up)


def grade_cell(exercise_id: str, cell_source: str, function: str, *, where: str = "", try_number: int = 1,
               follow_up: bool = True) -> Result:
    """Run an exercise cell's source in a grading process of its own, then check the ``function`` it defines.

    The verdict that counts, for `check` in a kernel, for ``labkit progress`` and for nbgrader's
    autograde alike (`labkit._grader_process`): what the cell does (patch torch or this module, exit,
    hang, ignore the time limit) can fail only this exercise. The cell may use only what it defines
    and `EXERCISE_NAMESPACE`.
    """
    spec = _lookup(exercise_id)
    if is_untouched_stub(cell_source, function):  # its verdict cannot differ, so no process is started for it
        return _not_yet(spec, _NOT_ATTEMPTED.format(name=function), _WHERE_TO_ANSWER.format(id=spec.id))
    request = {"exercise": spec.id, "source": cell_source, "function": function,
               "where": where or f"exercise {spec.id}", "try_number": try_number, "follow_up": follow_up,
               "time_limit_s": CHECK_TIME_LIMIT_S}
    outcome = grade_in_child(request, CHECK_TIME_LIMIT_S * WALL_LIMIT_FACTOR)
    if outcome.verdict is None:
        return _not_yet(spec, f"your exercise cell could not be checked: {outcome.failure}", outcome.hint)
    return Result(spec.id, spec.notebook, bool(outcome.verdict["passed"]), str(outcome.verdict["message"]),
                  recipe_shown=bool(outcome.verdict["recipe_shown"]))


def _answer_cell(exercise_id: str, answer: Callable) -> str | None:
    """The source of the notebook cell that defined ``answer``, when that cell is exercise ``exercise_id``'s.

    IPython keeps every executed cell's source in linecache under the file name it compiled it
    with; a function defined elsewhere (a module, a test) has no such cell, and is checked here.
    """
    filename = getattr(getattr(answer, "__code__", None), "co_filename", "")
    if not isinstance(filename, str) or "ipykernel_" not in filename and not filename.startswith("<ipython-input"):
        return None
    source = "".join(linecache.getlines(filename))
    header = _EXERCISE_HEADER.format(id=exercise_id)
    return source if source.lstrip().splitlines()[:1] == [header] else None


def check(exercise_id: str, answer: Callable) -> None:
    """Check ``answer``, show the verdict and remember it for `score` (taught in 00_start_here).

    When ``answer`` was defined in the exercise's own cell, that cell's source is graded in a
    process of its own (`grade_cell`), so nothing else the notebook did can change the verdict;
    otherwise the function is checked here (`run_check`). Under nbgrader's autograde or validate (they set ``NBGRADER_EXECUTION``) a wrong answer also
    raises `AssertionError` with the verdict, since nbgrader scores a test cell by whether it
    raises; in a learner's own kernel the verdict line is all there is.
    """
    spec = _lookup(exercise_id)
    try_number = _FAILED_TRIES.get(spec.id, 0) + 1
    source = _answer_cell(spec.id, answer) if callable(answer) else None
    function = _plain_str(getattr(answer, "__name__", None))
    if source is not None and function:
        try:
            result = grade_cell(spec.id, source, function, try_number=try_number)
        except KeyboardInterrupt:  # the stop button: the grading process is already ended
            print(f"Exercise {spec.id}: check interrupted, no verdict recorded; run the check cell again.")
            raise
    else:
        result = run_check(spec.id, answer, try_number=try_number)
    result = _remember(result)
    _show(result)
    if not result.passed and os.environ.get(NBGRADER_EXECUTION):
        raise AssertionError(result.message)


def _remember(result: Result) -> Result:
    """Keep the verdict for `score`, count a failed try (not a stub) for the next hint, and mark a
    pass that came after the recipe was shown."""
    if result.recipe_shown:
        _RECIPE_SHOWN.add(result.exercise)
    if result.passed and result.exercise in _RECIPE_SHOWN:
        result = replace(result, after_recipe=True)
    _SESSION[result.exercise] = result
    if not result.passed and _NOT_ATTEMPTED_MARK not in result.message:
        _FAILED_TRIES[result.exercise] = _FAILED_TRIES.get(result.exercise, 0) + 1
    return result


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
    if not isinstance(exercise_id, str) or exercise_id not in exercises:
        raise LabkitError(
            f"no exercise {exercise_id!r}: the known exercises are {', '.join(exercises)}; "
            "copy the ID from the cell's first line ('# exercise NN.K')"
        )
    return exercises[exercise_id]


def _not_yet(spec: Exercise, problem: str, hint: Hint | None = None, try_number: int = 1,
             follow_up: bool = True) -> Result:
    steps = _steps(hint or spec.hint)
    shown, more = hint_for(steps, try_number)
    message = f"✗ Exercise {spec.id} not yet: {_clause(problem)}. Hint: {_sentence(shown)}{more if follow_up else ''}"
    recipe = len(steps) > 1 and _step_index(len(steps), try_number) == len(steps) - 1
    return Result(spec.id, spec.notebook, False, message, recipe_shown=recipe)


def hint_for(hint: Hint, try_number: int) -> tuple[str, str]:
    """The hint to show on the ``try_number``-th failed try, and the note that a more explicit one follows.

    A hint is one sentence, or a tuple of sentences from a nudge (the first try: what to look at)
    to the recipe (the last). The steps before the recipe come one per failed try, the last of
    them repeated until try `RECIPE_TRY`, which shows the recipe. The note is given only when the
    next try's hint differs, so it is never a promise the next try breaks.
    """
    steps = _steps(hint)
    index = _step_index(len(steps), try_number)
    more = _MORE_HINTS if _step_index(len(steps), try_number + 1) != index else ""
    return steps[index], more


def _steps(hint: Hint) -> tuple[str, ...]:
    return (hint,) if isinstance(hint, str) else tuple(hint)


def _step_index(count: int, try_number: int) -> int:
    if count == 1 or try_number >= RECIPE_TRY:
        return count - 1
    return min(try_number, count - 1) - 1


def _clause(text: str) -> str:
    return text.strip().rstrip(".")


def _sentence(text: str) -> str:
    clause = _clause(text)
    return clause if clause.endswith(("?", "!")) else clause + "."


def _show(result: Result) -> None:
    """Display the verdict as JSON for `progress` plus plain text; plain print outside IPython."""
    record = {key: value for key, value in asdict(result).items() if key in _RECORD_FIELDS}
    if result.after_recipe:  # only then, so the stored records of a first-try pass stay as they were
        record["after_recipe"] = True
    show_record(result.message, GRADE_MIMETYPE, record)


_RECORD_FIELDS = ("exercise", "notebook", "passed", "message")
