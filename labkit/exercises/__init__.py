"""The exercise registry: every graded exercise's check, by ID.

Each notebook's checks live in one module, `labkit/exercises/nbNN.py`, and register themselves with
the `@exercise` decorator. A check receives the learner's function, tests its *behaviour* on
fixtures it builds itself, and either returns one sentence saying what passed or raises `NotYet`
saying what is still wrong. Running a check safely (under a time limit, with the notebook's global
state restored and the answer's results converted to plain builtin types), printing the verdict and
keeping the score is `labkit.grading`'s job. docs/AUTHORING.md ("Exercises") says how to write one.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from labkit.errors import LabkitError

__all__ = ["Differentiated", "NotYet", "call_and_differentiate", "exercise", "run_beside", "run_beside_measuring_memory"]

# A hint: one sentence, or a tuple of sentences shown one per failed try, from a nudge that names
# what to look at to the explicit recipe (labkit.grading.hint_for picks one).
Hint = str | tuple[str, ...]

EXERCISE_ID = re.compile(r"^(\d{2})\.(\d+)$")
NOTEBOOK_NAME = re.compile(r"^(\d{2})_\w+$")
# Only modules named like the notebooks they grade are loaded, so a helper module cannot register by accident.
CHECK_MODULE = re.compile(r"^nb\d{2}$")


class NotYet(Exception):
    """Raised by a check when the learner's answer is still wrong.

    ``problem`` says what is wrong, in the learner's terms; ``hint`` replaces the exercise's default
    hint when this failure needs a more specific one (a tuple: progressive, see `Hint`).
    """

    def __init__(self, problem: str, hint: Hint | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


@dataclass(frozen=True)
class Exercise:
    """One registered exercise: its ID (``NN.K``), notebook, short title, default hint, planted-bug
    diagnosis and check."""

    id: str
    notebook: str
    title: str
    hint: Hint
    planted: str
    check: Callable[[Callable], str]
    # the check calls the answer in a process of its own, with arguments and results passed as data
    answer_apart: bool = False


_REGISTRY: dict[str, Exercise] = {}


def exercise(exercise_id: str, *, notebook: str, title: str, hint: Hint, planted: str,
             answer_apart: bool = False) -> Callable:
    """Register the decorated function as the check for ``exercise_id``.

    The ID is ``NN.K`` where ``NN`` is the notebook's number: ``00.1`` is the first exercise of notebook 00.
    ``planted`` is a phrase the check's diagnosis of the notebook's planted bug must contain:
    tests/test_exercises.py runs the planted-bug cell and fails unless the check rejects it for
    that reason, not because something crashed. ``hint`` is one sentence or, better, a tuple of
    them from a nudge to the recipe: the n-th failed try in a session shows the n-th (see `Hint`).
    ``answer_apart=True`` says the check needs of the answer only what crosses a process boundary as
    data (arguments and results that are tensors, numbers, containers, modules and optimizers changed in
    place; no hook of the check's firing inside the answer, no autograd graph of a result): the grading
    process then runs the answer in a process of its own (`labkit._answer_process`), out of the check's reach.
    """

    _validate_id(exercise_id, notebook)
    _validate_hint(exercise_id, hint)
    if not planted.strip():
        raise LabkitError(
            f"exercise {exercise_id} needs planted=: a phrase from its check's diagnosis of the planted bug"
        )

    def register(check: Callable[[Callable], str]) -> Callable[[Callable], str]:
        existing = _REGISTRY.get(exercise_id)
        # Re-importing the same module (importlib.reload in a notebook) re-registers; another module may not.
        if existing is not None and existing.check.__module__ != check.__module__:
            raise LabkitError(
                f"exercise {exercise_id} is registered twice ({existing.check.__module__} and "
                f"{check.__module__}): give the new one the next free number"
            )
        _REGISTRY[exercise_id] = Exercise(exercise_id, notebook, title, hint, planted, check, answer_apart)
        return check

    return register


def _validate_hint(exercise_id: str, hint: Hint) -> None:
    steps = (hint,) if isinstance(hint, str) else hint
    if not (isinstance(steps, tuple) and steps and all(isinstance(step, str) and step.strip() for step in steps)):
        raise LabkitError(
            f"exercise {exercise_id} needs hint= as a sentence or a non-empty tuple of sentences, got {hint!r}"
        )


def _validate_id(exercise_id: str, notebook: str) -> None:
    id_match = EXERCISE_ID.match(exercise_id)
    notebook_match = NOTEBOOK_NAME.match(notebook)
    if id_match is None:
        raise LabkitError(f"exercise ID {exercise_id!r} is not of the form NN.K (for example '00.1')")
    if notebook_match is None:
        raise LabkitError(f"notebook {notebook!r} is not a notebook name of the form NN_name (no .ipynb)")
    if id_match.group(1) != notebook_match.group(1):
        raise LabkitError(
            f"exercise {exercise_id} cannot belong to {notebook}: an exercise ID starts with its notebook's number"
        )


def registry() -> dict[str, Exercise]:
    """Every registered exercise by ID, in course order, after loading all `nbNN` check modules."""
    for module in pkgutil.iter_modules(__path__):
        if CHECK_MODULE.match(module.name):
            importlib.import_module(f"{__name__}.{module.name}")
    return dict(sorted(_REGISTRY.items(), key=lambda item: exercise_order(item[0])))


def exercise_order(exercise_id: str) -> tuple[float, ...]:
    """Sort key putting ``00.2`` before ``00.10``, and a notebook's lab (``00.lab``) after its exercises."""
    numbers = tuple(int(number) for number in re.findall(r"\d+", exercise_id))
    return numbers + (math.inf,) if exercise_id.endswith(".lab") else numbers


def torch_error_clause(error: RuntimeError) -> str:
    """The first clause of a torch error's message, to quote in a diagnosis.

    Autograd reports every failure (a tensor modified in place, a freed graph, a non-differentiable
    op) as a plain RuntimeError, with no subclass or error code to test, so the message is all a
    check can show the learner. Its first clause (before the first colon, after which torch lists
    tensor types and versions) names the failure; checks quote it and never branch on it.
    """
    return str(error).split(":")[0].strip()


@dataclass(frozen=True)
class Differentiated:
    """What the learner's function returned, and the gradients of that result with respect to some of its
    arguments (`call_and_differentiate`): ``grads`` is None when the result is no tensor that requires
    grad; ``error`` is what backward raised, which `gradients` raises where the check needs them;
    ``called`` the names of the torch functions the call ran, and ``built_graph`` whether any of them built
    an autograd graph, when it was watched (`TorchCalls`)."""

    result: object
    grads: tuple | None
    error: BaseException | None = None
    called: frozenset[str] = frozenset()
    built_graph: bool = False

    def gradients(self) -> tuple | None:
        if self.error is not None:
            raise self.error
        return self.grads


def call_and_differentiate(function: Callable, args: tuple, wrt: tuple[int, ...],
                           upstream: torch.Tensor | None = None, watch: bool = False) -> Differentiated:
    """Call ``function(*args)`` and backpropagate ``upstream`` (ones when None) from its result to
    ``args[i]`` for each ``i`` in ``wrt``, in the process the answer runs in; with ``watch``, also name
    the torch functions the call ran (`TorchCalls`).

    A check that differentiates through an answer's result uses this instead of calling
    ``torch.autograd.grad`` itself: when the answer runs in a process of its own (``answer_apart``) its
    autograd graph cannot cross, so the backward pass runs there and the gradients come back as data."""
    across = getattr(function, "call_and_differentiate", None)
    if across is not None:
        return across(args, wrt, upstream, watch)
    return watched_call(function, args, wrt, upstream, watch)


def run_beside(function: Callable, driver: Callable, *args):
    """``driver(function, *args)`` in the process the answer runs in, and what ``driver`` returns.

    For a check that must call the answer inside an instrument (hooks around its forward, saved-tensor
    hooks) or drive what the answer set up (hooks it registered, handles it returned): ``driver`` is a
    module-level function of the check module (it crosses by name), returns data (numbers, tensors,
    lists, dicts) and may raise `NotYet`; what the answer raises is the answer's, as with a plain call.
    Where the answer runs apart, what ``driver`` reads there could be forged by the answer (it can reach the
    driver's frame): the check compares what comes back with what it computed itself wherever it can, and a
    fact about memory is backed by `run_beside_measuring_memory`."""
    across = getattr(function, "run_beside", None)
    if across is not None:
        return across(driver, args)
    return driver(function, *args)


def run_beside_measuring_memory(function: Callable, driver: Callable, *args) -> tuple[object, int | None]:
    """`run_beside`, and how many bytes the process the answer ran in held at its peak during the call beyond
    what it held at its start, as the kernel counted them (None where it does not: no /proc, as on macOS).

    Where the answer runs apart, the count is read from the grading process, out of the answer's reach: a check
    whose lesson is memory (graphs kept alive, activations not freed) requires it as well as its driver's facts,
    so an answer that empties what its driver noted still fails on the memory it really held."""
    from labkit._resident import measured

    across = getattr(function, "run_beside", None)
    if across is not None:
        return across(driver, args, measure_memory=True)
    return measured(lambda: driver(function, *args))


def watched_call(function: Callable, args: tuple, wrt: tuple[int, ...], upstream: torch.Tensor | None,
                 watch: bool) -> Differentiated:
    """`call_and_differentiate` where the answer runs: the call (watched or not), then `differentiate`."""
    if not watch:
        return differentiate(function(*args), [args[i] for i in wrt], upstream)
    with TorchCalls() as calls:
        result = function(*args)
    done = differentiate(result, [args[i] for i in wrt], upstream)
    return dataclasses.replace(done, called=frozenset(f.__name__ for f in calls.functions),
                               built_graph=calls.built_graph)


def differentiate(result, inputs: list, upstream: torch.Tensor | None) -> Differentiated:
    """`Differentiated` for a result already computed: the backward pass of `call_and_differentiate`."""
    if not (isinstance(result, torch.Tensor) and result.requires_grad):
        return Differentiated(result, None)
    try:
        grads = torch.autograd.grad(result, inputs, torch.ones_like(result) if upstream is None else upstream,
                                    allow_unused=True)
    except Exception as error:  # the check words it where it needs the gradients (`Differentiated.gradients`)
        return Differentiated(result, None, error)
    return Differentiated(result, tuple(grads))


class Recorder:
    """A hook a check registers on a module it passes to the answer: each call notes ``note(*hook_args)``.

    Unlike a closure it is picklable (``note`` must be a module-level function) and carries its notes in a
    state_dict, so when the answer runs in a process of its own (``answer_apart``) the hook fires there
    and its notes come back into this recorder's ``notes``, the same list object.
    """

    def __init__(self, note: Callable) -> None:
        self.note = note
        self.notes: list = []

    def __call__(self, *hook_args) -> None:
        self.notes.append(self.note(*hook_args))

    def state_dict(self) -> dict:
        return {"notes": list(self.notes)}

    def load_state_dict(self, state: dict) -> None:
        self.notes[:] = state["notes"]


def by_how_much(difference: float) -> str:
    """``"by 0.022"``, or, when the difference is NaN or infinite, that the learner's values became so.

    "differs by nan" tells a learner nothing; a NaN difference means their own result holds NaN
    (or inf) where the reference is finite, usually from a 0/0, a log(0) or an overflow.
    """
    if math.isfinite(difference):
        return f"by {difference:.2g}"
    return "by NaN or inf (your values became NaN or infinite where the reference is finite: look for a 0 / 0)"


class TorchCalls(TorchFunctionMode):
    """Watches the torch functions an answer calls: which ones, and whether any built an autograd graph.

    A check uses it to catch an answer that dodges the lesson while getting the numbers right
    (03.1: calling F.layer_norm instead of writing the normalisation; 03.2: differentiating with
    autograd inside a custom backward instead of deriving it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.functions: set = set()
        self.built_graph = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.functions.add(func)
        if isinstance(result, torch.Tensor) and result.requires_grad:
            self.built_graph = True
        return result
