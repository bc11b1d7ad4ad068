"""The sandbox a check runs in: a time limit, and the global state and namespaces given back after it."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import dataclasses
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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from labkit._resident import measured
from labkit._torch_compat import use_deterministic_algorithms
from labkit.exercises import Differentiated, Exercise, NotYet, watched_call

__all__: list[str] = []

# A check's wall-clock bound, as a multiple of its CPU-time limit (`labkit.grading.CHECK_TIME_LIMIT_S`
# says why both): an answer that waits (sleep, a lock) uses no CPU, and this stops it.
WALL_LIMIT_FACTOR = 6


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

    def __call__(self, *args, **kwargs):
        return _plain(self._run(self.answer, *args, **kwargs))

    def run_beside(self, driver: Callable, args: tuple, measure_memory: bool = False):
        """`labkit.exercises.run_beside` on the answer: across, where the answer runs apart; with
        ``measure_memory`` (`labkit.exercises.run_beside_measuring_memory`), also the process's peak growth."""
        across = getattr(self.answer, "run_beside", None)
        if across is not None:
            return self._run(across, driver, args, measure_memory)
        if not measure_memory:
            return self._run(driver, self, *args)
        return measured(lambda: self._run(driver, self, *args))

    @property
    def _apart(self) -> bool:
        """Whether the answer runs in a process of its own (`labkit._answer_process`)."""
        return hasattr(self.answer, "run_beside")

    def call_and_differentiate(self, args: tuple, wrt: tuple[int, ...], upstream, watch: bool) -> Differentiated:
        """`labkit.exercises.call_and_differentiate` on the answer: across, where the answer runs apart."""
        across = getattr(self.answer, "call_and_differentiate", None)
        if across is None:
            return watched_call(self, args, wrt, upstream, watch)
        done = self._run(across, args, wrt, upstream, watch)
        return dataclasses.replace(done, result=_plain(done.result))

    def _run(self, function: Callable, *args, **kwargs):
        thread = threading.get_ident()
        self.running_in.add(thread)
        try:
            result = function(*args, **kwargs)
        except _CheckTimedOut:
            self.stopped = True
            raise
        except (KeyboardInterrupt, _AnswerRaised):  # the second: raised by the answer inside a check's driver
            raise
        except NotYet as verdict:
            if self._apart or function is not self.answer:
                raise  # a verdict: the answer process's refusal of a result (`_plain`), or a check's driver
            raise _AnswerRaised(verdict) from verdict
        except BaseException as error:  # SystemExit and GeneratorExit too: each becomes a "not yet" line
            raise _AnswerRaised(error) from error
        finally:
            self.running_in.discard(thread)
            if self.namespaces is not None:
                self.namespaces.restore()
        return result

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
    to a class (a module may grow attributes by lazy imports, which stay). ``objects`` are more
    things a check judges by (a lab's definition, its variants, their dicts of stages): their
    attributes, or a dict's items, are put back too, a frozen dataclass's included.
    """

    def __init__(self, check_module: str, *more_modules: str, objects: tuple = ()) -> None:
        self.modules = [module for module in _guarded_modules(check_module, *more_modules) if module is not None]
        self.classes = [torch.Tensor, nn.Module, nn.Parameter, torch.optim.Optimizer, np.ndarray]
        self.objects = list(objects)
        self.saved = {id(space): dict(vars(space)) for space in self.modules + self.classes}
        self.saved |= {id(space): dict(space if isinstance(space, dict) else vars(space)) for space in self.objects}

    def restore(self) -> None:
        for space in self.objects:  # their own items, put back exactly (a frozen dataclass's setattr refuses)
            saved, now = self.saved[id(space)], space if isinstance(space, dict) else vars(space)
            if not _unchanged(now, saved):
                now.clear()
                now.update(saved)
        for space in self.modules + self.classes:
            saved, now = self.saved[id(space)], vars(space)
            if _unchanged(now, saved):
                continue
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    setattr(space, key, value)
            if isinstance(space, type):
                for key in [key for key in now if key not in saved]:
                    delattr(space, key)


_MISSING = object()


def _unchanged(now: dict, saved: dict) -> bool:
    return len(now) == len(saved) and all(now.get(key, _MISSING) is value for key, value in saved.items())


def _guarded_modules(check_module: str, *more_modules: str) -> list:
    # grading and this sandbox are one runtime, split in two files: an answer may patch either
    return [builtins, math, random, np, torch, nn, F, torch.autograd, torch.linalg, torch.testing, torch.optim,
            sys.modules.get(check_module), sys.modules["labkit.grading"], sys.modules[__name__],
            sys.modules["labkit.exercises"], *(sys.modules.get(name) for name in more_modules)]


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


def _raise_in_thread(thread: int, limit: str = "its time limit") -> None:
    """Raise `_CheckTimedOut` in another thread at its next Python bytecode.

    An asynchronous exception is a class (its instance is made in the target thread), so the
    limit's wording travels as a subclass.
    """
    timed_out = type("_CheckTimedOutHere", (_CheckTimedOut,), {"__init__": lambda self: _CheckTimedOut.__init__(
        self, limit)})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(timed_out))
