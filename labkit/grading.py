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

import builtins
import contextlib
import ctypes
import gc
import math
import os
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from labkit._torch_compat import use_deterministic_algorithms
from labkit.errors import LabkitError
from labkit.exercises import Exercise, Hint, NotYet, exercise_order, registry
from labkit.messages import describe_error
from labkit.records import show_record, stored_records

__all__ = ["EXERCISE_NAMESPACE", "check", "score"]

GRADE_MIMETYPE = "application/vnd.labkit.grade+json"
# What `progress` reads from each stored grade payload.
GRADE_FIELDS = {"exercise": str, "passed": bool, "message": str}

# The only names an exercise cell (planted bug or answer) may use besides what it defines itself,
# so tests/test_exercises.py can run each cell on its own, away from the rest of its notebook.
EXERCISE_NAMESPACE = MappingProxyType({"torch": torch, "nn": nn, "F": F, "np": np, "math": math})

PASSED, NOT_YET, NOT_RUN = "passed", "not yet", "not run"
# nbgrader sets this ("autograde" or "validate") in the kernels it grades with.
NBGRADER_EXECUTION = "NBGRADER_EXECUTION"
# Every check needs well under a second of CPU; an answer still computing after this many seconds
# of CPU time (the process's, all threads) is stopped, so a `while True:` loop cannot hang the
# learner's notebook. CPU time, because a shared or slow machine stretches wall time several
# times and a spurious stop would change stored output; a call that waits (sleep, a lock) uses no
# CPU, so a wall-clock bound of WALL_LIMIT_FACTOR times the limit stops that.
CHECK_TIME_LIMIT_S = 10.0
WALL_LIMIT_FACTOR = 6
# Long exception messages (torch's can run to paragraphs) are cut so the verdict stays one line.
MAX_ERROR_CHARS = 160

_NOT_ATTEMPTED_MARK = "is not attempted yet"
_NOT_ATTEMPTED = "{name} " + _NOT_ATTEMPTED_MARK + " (it still raises NotImplementedError)"
_WHERE_TO_ANSWER = (
    "in the cell marked '# exercise {id}', replace the lines '# YOUR CODE HERE' and 'raise NotImplementedError(...)' "
    "with your answer, run that cell, then run this check"
)
# Said after every hint but the last, so the learner knows a second failed try tells more.
_MORE_HINTS = " If your next try fails too, its hint says more."
# The latest verdict per exercise in this kernel session; `score` reads it.
_SESSION: dict[str, Result] = {}
# How many attempts at each exercise failed in this kernel session (a stub's "not attempted" does
# not count); `check` shows the hint for the next attempt, so hints grow more explicit.
_FAILED_TRIES: dict[str, int] = {}


@dataclass(frozen=True)
class Result:
    """One check's verdict: the exercise, its notebook, whether it passed and the line shown."""

    exercise: str
    notebook: str
    passed: bool
    message: str


def known_exercises() -> list[str]:
    """The IDs of every registered exercise, in course order."""
    return list(registry())


def run_check(exercise_id: str, answer: Callable, *, time_limit_s: float | None = None, try_number: int = 1) -> Result:
    """Check ``answer`` for ``exercise_id`` and return the verdict without printing or recording it.

    Taught in 00_start_here. Raises `LabkitError` only for an unknown ID; a wrong, unfinished,
    crashing, exiting (``sys.exit``) or endless answer gives a `Result` with ``passed=False`` and a
    friendly message. The check runs under a time limit (``time_limit_s``, default
    `CHECK_TIME_LIMIT_S`) and leaves the notebook's global state as it found it (see
    `_isolated_check`). Ctrl-C (the notebook's stop button) is not a verdict: it stops the check,
    says so, and propagates, so "Run all" stops as the learner asked. Hints are progressive:
    ``try_number`` (1 for a first try) picks how explicit the hint of a failure is (`hint_for`).
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
            praise = spec.check(attempt.call)
    except NotYet as verdict:
        return _not_yet(spec, verdict.problem, verdict.hint, try_number)
    except _AnswerRaised as raised:
        return _answer_raised(spec, name, raised.error)
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


def _answer_raised(spec: Exercise, name: str, error: BaseException) -> Result:
    if isinstance(error, NotImplementedError):
        # The fix is the exercise itself, so before a first attempt the hint only says where to write.
        return _not_yet(spec, _NOT_ATTEMPTED.format(name=name), _WHERE_TO_ANSWER.format(id=spec.id))
    if isinstance(error, SystemExit):
        return _not_yet(
            spec,
            f"{name} called exit() ({describe_error(error, MAX_ERROR_CHARS)}), which would end the notebook's kernel",
            hint="return the result instead of calling sys.exit() or exit()",
        )
    return _not_yet(spec, f"{name} raised {describe_error(error, MAX_ERROR_CHARS)}")


def check(exercise_id: str, answer: Callable) -> None:
    """Check ``answer``, show the verdict and remember it for `score` (taught in 00_start_here).

    Under nbgrader's autograde or validate (they set ``NBGRADER_EXECUTION``) a wrong answer also
    raises `AssertionError` with the verdict, since nbgrader scores a test cell by whether it
    raises; in a learner's own kernel the verdict line is all there is.
    """
    result = run_check(exercise_id, answer, try_number=_FAILED_TRIES.get(_lookup(exercise_id).id, 0) + 1)
    _remember(result)
    _show(result)
    if not result.passed and os.environ.get(NBGRADER_EXECUTION):
        raise AssertionError(result.message)


def _remember(result: Result) -> None:
    """Keep the verdict for `score`, and count a failed try (not a stub) for the next hint."""
    _SESSION[result.exercise] = result
    if not result.passed and _NOT_ATTEMPTED_MARK not in result.message:
        _FAILED_TRIES[result.exercise] = _FAILED_TRIES.get(result.exercise, 0) + 1


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


class _AnswerRaised(Exception):
    """Carries an exception raised inside the learner's function, to tell it apart from a bad result."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error


class _CheckTimedOut(BaseException):
    """Raised in the checking thread when the time limit passes; ``limit`` says which, in words.

    A BaseException, so an answer's own ``except Exception:`` cannot swallow it.
    """

    def __init__(self, limit: str = "its time limit") -> None:
        super().__init__(limit)
        self.limit = limit


class _Deadline:
    """A check's budget: ``cpu_s`` of the process's CPU time, and a wall-clock bound for waits."""

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s, self.wall_s = cpu_s, cpu_s * WALL_LIMIT_FACTOR
        self.cpu_start, self.wall_start = time.process_time(), time.monotonic()

    def passed(self) -> str | None:
        """The limit that ran out, in words, or None while there is time left."""
        if time.process_time() - self.cpu_start > self.cpu_s:
            return f"{self.cpu_s:g} s"
        if time.monotonic() - self.wall_start > self.wall_s:
            return f"{self.wall_s:g} s of waiting"
        return None


class _Attempt:
    """The learner's function as the check calls it: exceptions tagged, results made plain.

    After every call the namespaces a check relies on are put back (`_Namespaces`), so an answer
    that replaced ``torch.allclose`` cannot make the comparisons that follow it lie, and what it
    returned is converted to exact builtin types (`_plain`), so a float subclass with a lying
    ``__sub__`` or ``__eq__`` is compared by its value.
    """

    def __init__(self, answer: Callable) -> None:
        self.answer = answer
        self.stopped = False  # the answer itself was running when the check was stopped
        self.namespaces: _Namespaces | None = None
        self.running_in: set[int] = set()  # threads inside the answer (a check may call it from several)

    def call(self, *args, **kwargs):
        thread = threading.get_ident()
        self.running_in.add(thread)
        try:
            result = self.answer(*args, **kwargs)
        except _CheckTimedOut:
            self.stopped = True
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # SystemExit and GeneratorExit too: each becomes a "not yet" line
            raise _AnswerRaised(error) from error
        finally:
            self.running_in.discard(thread)
            if self.namespaces is not None:
                self.namespaces.restore()
        return _plain(result)

    def stop_other_threads(self) -> None:
        """Stop the answer wherever it still runs in a thread the check started and left behind."""
        for thread in self.running_in - {threading.get_ident()}:
            self.stopped = True
            _raise_in_thread(thread)


_PLAIN_BASES = (bool, int, float, complex, str, bytes)


def _plain(value: object) -> object:
    """``value`` with builtin-number and string subclasses replaced by their exact base type.

    Exact lists, tuples and dicts are rebuilt when an item changes, and kept as they are otherwise,
    so a check may still test identity; any other object is the check's to inspect. A tensor
    subclass that overrides ``__torch_function__`` could answer any comparison, so it is refused.
    """
    kind = type(value)
    if kind in _PLAIN_BASES or value is None:
        return value
    for base in _PLAIN_BASES:
        if isinstance(value, base):
            return _EXACT_CONVERT[base](value)
    if isinstance(value, _REAL_TENSOR):
        override = getattr(kind, "__torch_function__", None)
        if getattr(override, "__func__", override) not in _PLAIN_TORCH_FUNCTIONS:
            raise NotYet(
                f"the function returned a tensor subclass, {kind.__name__}, that changes how torch operations behave",
                hint="return a plain torch.Tensor",
            )
        return value
    if kind is dict:
        pairs = list(value.items())
        plain_pairs = [(_plain(key), _plain(item)) for key, item in pairs]
        same = all(a is c and b is d for (a, b), (c, d) in zip(plain_pairs, pairs))
        return value if same else dict(plain_pairs)
    if kind is list or kind is tuple:
        plain_items = [_plain(item) for item in value]
        same = all(new is old for new, old in zip(plain_items, value))
        return value if same else kind(plain_items)
    return value


# Methods of the base types themselves, taken now: a subclass's overrides never run.
_EXACT_CONVERT = {
    bool: bool, int: int.__int__, float: float.__float__, complex: lambda value: complex.__add__(value, 0j),
    str: str.__str__, bytes: lambda value: bytes.__add__(value, b""),
}
_REAL_TENSOR = torch.Tensor
_PLAIN_TORCH_FUNCTIONS = tuple(
    getattr(function, "__func__", function)
    for function in (torch.Tensor.__torch_function__, nn.Parameter.__torch_function__)
)


def _plain_str(value: object) -> str | None:
    return str.__str__(value) if isinstance(value, str) else None


class _Namespaces:
    """The attributes of the modules and classes checks use, as they were when the check began.

    `restore` puts back every attribute an answer replaced or deleted, and removes what it added
    to a class (a module may grow attributes by lazy imports, which stay).
    """

    def __init__(self, check_module: str) -> None:
        self.modules = [module for module in _guarded_modules(check_module) if module is not None]
        self.classes = [torch.Tensor, nn.Module, nn.Parameter, torch.optim.Optimizer, np.ndarray]
        self.saved = {id(space): dict(vars(space)) for space in self.modules + self.classes}

    def restore(self) -> None:
        for space in self.modules + self.classes:
            saved, now = self.saved[id(space)], vars(space)
            if len(now) == len(saved) and all(now.get(key, _MISSING) is value for key, value in saved.items()):
                continue
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    setattr(space, key, value)
            if isinstance(space, type):
                for key in [key for key in now if key not in saved]:
                    delattr(space, key)


_MISSING = object()


def _guarded_modules(check_module: str) -> list:
    return [builtins, math, random, np, torch, nn, F, torch.autograd, torch.linalg, torch.testing, torch.optim,
            sys.modules.get(check_module), sys.modules[__name__], sys.modules["labkit.exercises"]]


@contextlib.contextmanager
def _isolated_check(spec: Exercise, attempt: _Attempt, limit: float) -> Iterator[None]:
    """Run a check seeded, under a time limit, and give the notebook back its global state afterwards.

    Restored: torch's, NumPy's and Python's random state (a check that consumed the notebook's
    random numbers would change every later cell's output), grad and anomaly mode, the default
    dtype and device, deterministic mode, torch's thread count and float32 matmul precision,
    warning filters, NumPy's error handling and print options, the recursion limit, gc, the
    working directory, environment variables, sys.stdout/stderr, and the attributes of the
    modules and classes checks use (`_Namespaces`). Not restored: torch's interop thread count
    (torch refuses to change it twice) and an inference mode entered without leaving it.
    """
    saved = _GlobalState()
    attempt.namespaces = _Namespaces(spec.check.__module__)
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), torch.enable_grad():
            # the CPU generator only: fork_rng(devices=[]) restores no CUDA state
            torch.default_generator.manual_seed(0)
            np.random.seed(0)
            random.seed(0)
            with _time_limit(limit):
                yield
    finally:
        attempt.stop_other_threads()
        attempt.namespaces.restore()
        saved.restore()


class _GlobalState:
    """The process-wide settings an answer can change, read when the check starts."""

    def __init__(self) -> None:
        self.numpy_random = np.random.get_state()
        self.python_random = random.getstate()
        self.settings = {name: getter() for name, (getter, _) in _SETTINGS.items()}

    def restore(self) -> None:
        np.random.set_state(self.numpy_random)
        random.setstate(self.python_random)
        for name, (getter, setter) in _SETTINGS.items():
            if getter() != self.settings[name]:
                setter(self.settings[name])


def _set_environment(saved: dict[str, str]) -> None:
    for key in [key for key in os.environ if key not in saved]:
        del os.environ[key]
    os.environ.update(saved)


def _set_gc(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()


_SETTINGS: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (torch.get_default_device, torch.set_default_device),
    "deterministic": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: use_deterministic_algorithms(value[0], warn_only=value[1]),
    ),
    "anomaly mode": (
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda value: torch.autograd.set_detect_anomaly(value[0], check_nan=value[1]),
    ),
    "threads": (torch.get_num_threads, torch.set_num_threads),
    "matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "numpy errors": (np.geterr, lambda value: np.seterr(**value)),
    "numpy print options": (np.get_printoptions, lambda value: np.set_printoptions(**value)),
    "recursion limit": (sys.getrecursionlimit, sys.setrecursionlimit),
    "gc": (gc.isenabled, _set_gc),
    "working directory": (os.getcwd, os.chdir),
    "environment": (lambda: dict(os.environ), _set_environment),
    "stdout": (lambda: sys.stdout, lambda stream: setattr(sys, "stdout", stream)),
    "stderr": (lambda: sys.stderr, lambda stream: setattr(sys, "stderr", stream)),
}


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise `_CheckTimedOut` in this thread once the `_Deadline` for ``seconds`` has passed.

    The deadline is polled every `_POLL_S`. In the main thread (a notebook's kernel, a script,
    pytest) a SIGALRM timer does it: its handler runs between two Python bytecodes, and it also
    wakes ``time.sleep`` and other waits that retry on EINTR. Elsewhere a watchdog thread sets an
    asynchronous exception on this thread (PyThreadState_SetAsyncExc), which interrupts Python code
    but not a blocking call. Both wait for an import in progress to finish (`_importing`). Neither
    can stop a single long C call (one huge torch or NumPy operation): the check ends when it
    returns. A subprocess could kill even that, but would cost a fork of the kernel per check and
    could not take the learner's function along; checks must stay well under a second.
    """
    deadline = _Deadline(seconds)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        with _alarm(deadline):
            yield
    else:
        with _watchdog(deadline):
            yield


# How often the deadline is looked at; an import is never interrupted (a half-imported module
# would stay broken in sys.modules for the rest of the session), so a stop waits for it.
_POLL_S = 0.05


def _importing(frame) -> bool:
    """Whether ``frame`` (a thread's innermost frame) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _alarm(deadline: _Deadline) -> Iterator[None]:
    armed = [True]

    def on_alarm(signum, frame):
        limit = deadline.passed() if armed[0] else None
        if limit is not None and not _importing(frame):
            raise _CheckTimedOut(limit)

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, _POLL_S, _POLL_S)
    try:
        yield
    finally:
        try:
            # The alarm may fire in here; the inner finally still gives the previous handler back.
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous_handler)
            if previous_delay > 0:  # someone else's alarm (a test harness's) keeps its deadline
                remaining = previous_delay - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-6), previous_interval)


@contextlib.contextmanager
def _watchdog(deadline: _Deadline) -> Iterator[None]:
    target, done = threading.get_ident(), threading.Event()

    def interrupt() -> None:
        while not done.wait(_POLL_S):
            limit = deadline.passed()
            if limit is not None and not _importing(sys._current_frames().get(target)):
                _raise_in_thread(target, limit)
                return

    watchdog = threading.Thread(target=interrupt, name="labkit-check-watchdog", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


def _not_yet(spec: Exercise, problem: str, hint: Hint | None = None, try_number: int = 1) -> Result:
    shown, more = hint_for(hint or spec.hint, try_number)
    message = f"✗ Exercise {spec.id} not yet: {_clause(problem)}. Hint: {_sentence(shown)}{more}"
    return Result(spec.id, spec.notebook, False, message)


def hint_for(hint: Hint, try_number: int) -> tuple[str, str]:
    """The hint to show on the ``try_number``-th failed try, and the note that a more explicit one follows.

    A hint is one sentence, or a tuple of sentences from a nudge (the first try: what to look at)
    to the recipe (the last), so a first failure never hands over the whole answer.
    """
    steps = (hint,) if isinstance(hint, str) else tuple(hint)
    shown = steps[min(try_number, len(steps)) - 1]
    return shown, (_MORE_HINTS if try_number < len(steps) else "")


def _clause(text: str) -> str:
    return text.strip().rstrip(".")


def _sentence(text: str) -> str:
    clause = _clause(text)
    return clause if clause.endswith(("?", "!")) else clause + "."


def _show(result: Result) -> None:
    """Display the verdict as JSON for `progress` plus plain text; plain print outside IPython."""
    show_record(result.message, GRADE_MIMETYPE, asdict(result))


def _raise_in_thread(thread: int, limit: str = "its time limit") -> None:
    """Raise `_CheckTimedOut` in another thread at its next Python bytecode.

    An asynchronous exception is a class (its instance is made in the target thread), so the
    limit's wording travels as a subclass.
    """
    timed_out = type("_CheckTimedOutHere", (_CheckTimedOut,), {"__init__": lambda self: _CheckTimedOut.__init__(
        self, limit)})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(timed_out))


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
    """The grade payloads stored in one executed notebook, by exercise; a later output wins.

    A payload without its fields, or with one of the wrong type, is a LabkitError naming the file.
    """
    return {payload["exercise"]: payload for payload in stored_records(path, GRADE_MIMETYPE, GRADE_FIELDS)}


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
    # Statuses beyond these three (labkit.course.progress adds "cell missing") are counted after them.
    others = "".join(f", {count} {status}" for status, count in counts.items() if status not in (PASSED, NOT_YET, NOT_RUN))
    text.append(
        f"Total: {counts[PASSED]}/{len(rows)} exercises passed "
        f"({counts[NOT_YET]} not yet, {counts[NOT_RUN]} not run{others})"
    )
    return "\n".join(text)


def _counts(rows: list[Progress]) -> dict[str, int]:
    statuses = dict.fromkeys([PASSED, NOT_YET, NOT_RUN] + [row.status for row in rows])
    return {status: sum(row.status == status for row in rows) for status in statuses}
