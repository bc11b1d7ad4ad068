"""The answer's own process: an exercise's check calls the learner's function across a process boundary.

The grading process (`labkit._grader_child`) is the judge: it runs the check and writes the verdict. For
an exercise registered with ``answer_apart=True`` it never runs a line of the learner's: before the check
starts it forks the *answer process*, which closes every descriptor but its end of one socket (the request
pipe that holds the parent's nonce and the result pipe included), caps its resources, installs the same
audit hook, runs the answer cell and then serves calls. Each time the check calls the learner's function,
the arguments go over the socket as a pickle (the judge trusts them: it made them), the function runs in
the answer process, and what comes back is data only: the result and the new state of every tensor,
module and optimizer among the arguments, saved with `torch.save` and read with ``weights_only=True``
(tensors, numbers, strings and containers; no class of the sender's choosing, so nothing in a reply runs
code in the judge). The judge copies that state into its own arguments and returns the result to the
check. So a cell that patches the checker, an encoder, torch or labkit, reads the nonce, or writes to any
descriptor it can find changes only its own process: the parent trusts nothing it reports, and the check takes
from it the answer's own results, and the facts a driver or the backward pass notes there, which an answer written
against them can change (it can walk up to the driver's frame). Where such a fact is about memory (13.1's graphs
kept alive, 16.1's activations), the check also reads what the kernel counted for this process from the judge's
side (`labkit.exercises.run_beside_measuring_memory`, `labkit._resident`), which no answer can lower: the
forgeries of tests/reliability/test_report_forgery.py fail on it. The facts that stay the answer's are about the
route it took to right values (autograd rather than a formula, micro-batches rather than one batch: issue #42).

A reply names an argument by its place instead of copying it, so a check that tests identity (a returned
tensor that *is* the one passed in) still can. An exception comes back as its type's name and message; an
object that is not data comes back as a stand-in of the same type name, so the diagnoses read as before.
The autograd graph of a result cannot cross either: a check that differentiates through the result asks for
the backward pass with the call (`labkit.exercises.call_and_differentiate`); it runs here, and the gradients
come back as data, or the error autograd raised as a stand-in of its type. What cannot cross: a hook the check
registered on a tensor argument (it fires in the judge only), a lambda among the arguments: a check that needs
those runs them beside the answer in a driver of its own (`labkit.exercises.run_beside`), which returns data.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import io
import os
import pickle
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.amp import GradScaler

from labkit._check_sandbox import _CheckTimedOut, _Namespaces, _plain, _time_limit
from labkit._grader_process import GARBLED_REPLY_EXIT_CODE
from labkit._resident import held_now, measured
from labkit.exercises import Differentiated, NotYet, registry, watched_call
from labkit.messages import describe_error

__all__: list[str] = []

_LENGTH = struct.Struct("!Q")
# A reply larger than this is not an answer's result: the judge stops reading and fails the answer.
MAX_REPLY_BYTES = 256 * 2**20
# How long an answer process that closed its channel may take to end.
ENDING_GRACE_S = 2.0
# Exceptions whose kind a check or the grading tells apart (autograd raises RuntimeError); any other comes
# back as a plain Exception.
_KINDS = (NotImplementedError, SystemExit, KeyboardInterrupt, RuntimeError)
_VALUES = (bool, int, float, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


class AnswerProcess:
    """The judge's end: ``cell`` says how running the cell went, ``call`` calls the function across."""

    def __init__(self, pid: int, channel: socket.socket, held_at_fork: int | None = None) -> None:
        self.pid, self.channel = pid, channel
        self.held_at_fork = held_at_fork  # its anonymous memory before any learner code ran (`labkit._resident`)
        self.turn = threading.Lock()  # a check that calls from several threads: one call at a time

    def cell(self) -> tuple[str, str]:
        """("defined", ""), ("raised", description), ("timed_out", limit) or ("undefined", "")."""
        return tuple(self._receive())

    def call(self, *args, **kwargs):
        with self.turn:
            return self._call(args, kwargs, None)

    def run_beside(self, driver: Callable, args: tuple, measure_memory: bool = False):
        """``driver(answer, *args)`` in the answer process (`labkit.exercises.run_beside`): what it returns, as data;
        with ``measure_memory``, also the bytes that process held at its peak beyond its start, counted from here
        (`labkit._resident`), where the answer cannot change the count."""
        with self.turn:
            if not measure_memory:
                return self._call(args, {}, ("beside", driver))
            return measured(lambda: self._call(args, {}, ("beside", driver)), self.pid, self.held_at_fork)

    def ask(self, question: bytes):
        """A question of a serve function of its own (a lab's, `labkit.labs._isolated.serve`): its reply, as data."""
        with self.turn:
            _send(self.channel, question)
            return self._receive()

    def call_and_differentiate(self, args: tuple, wrt: tuple[int, ...], upstream, watch: bool) -> Differentiated:
        """The call, and the backward pass from its result (`labkit.exercises.call_and_differentiate`),
        both in the answer process: the result's graph stays there, its gradients come back as data."""
        with self.turn:
            return self._call(args, {}, ("differentiate", tuple(wrt), upstream, watch))

    def _call(self, args: tuple, kwargs: dict, backward: tuple | None):
        arguments = _stateful((args, kwargs))  # pickling leaves out .grad: it goes with each tensor's state
        states = [_state(item, arguments) for item in arguments]
        _send(self.channel, pickle.dumps((args, kwargs, states, _random_streams(), torch.is_grad_enabled(), backward)))
        reply = self._receive()
        if reply[0] == "returned":
            _, result, states, streams, gradients = reply
            _set_random_streams(streams)
            _apply_states(arguments, states)
            result = _decode(result, arguments)
            if backward is None or backward[0] == "beside":
                return result
            grads, error, called, built_graph = gradients
            return Differentiated(result, None if grads is None else tuple(grads),
                                  None if error is None else _stand_in_error(*error), frozenset(called), built_graph)
        if reply[0] == "timed_out":
            raise _CheckTimedOut(reply[1])
        if reply[0] == "not_yet":
            raise NotYet(reply[1], reply[2])
        _, kind, name, message = reply
        raise _stand_in_error(kind, name, message)

    def end(self) -> None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        self.channel.close()

    def _receive(self):
        """The answer process's next reply, read as data only. Its end (an exit, a crash) ends the judge alike;
        a reply that is not data (the answer wrote into the channel) ends it with `GARBLED_REPLY_EXIT_CODE`."""
        try:
            payload = _receive(self.channel)
        except (OSError, ValueError, struct.error):
            self._end_garbled()
        if payload is None:
            self._end_as_the_answer_did()
        try:
            return torch.load(io.BytesIO(payload), weights_only=True)
        except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, ValueError, struct.error):
            self._end_garbled()

    def _end_as_the_answer_did(self) -> None:
        """The channel closed: end the judge with the answer process's exit code or signal, so the parent words
        it as before; a process that closed the channel and lives on broke the protocol (`_end_garbled`)."""
        deadline = time.monotonic() + ENDING_GRACE_S
        while (ended := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                self._end_garbled()
            time.sleep(0.01)
        code = os.waitstatus_to_exitcode(ended[1])
        if code < 0:
            if code != -signal.SIGKILL:  # SIGKILL's handler cannot be set, nor needs to be
                signal.signal(-code, signal.SIG_DFL)
            signal.raise_signal(-code)
        os._exit(code)

    def _end_garbled(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os._exit(GARBLED_REPLY_EXIT_CODE)


def start(request: dict, confine: Callable[[], None], serve: Callable | None = None) -> AnswerProcess:
    """Fork the answer process for ``request`` (source, function, where, time_limit_s); ``confine`` caps it.
    ``serve(channel, request)`` runs the cell and answers the judge there (default: an exercise's calls)."""
    judge_end, answer_end = socket.socketpair()
    held_at_fork = held_now()
    pid = os.fork()
    if pid == 0:
        try:
            judge_end.close()
            keep = answer_end.fileno()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.closerange(3, keep)  # the result pipe and the nonce's pipe (fd 0, above) among them
            os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
            confine()
            (serve or _serve)(answer_end, request)
        finally:
            os._exit(0)
    answer_end.close()
    return AnswerProcess(pid, judge_end, held_at_fork)


def run_cell(request: dict, namespace: dict) -> tuple[str, str]:
    """Run the answer cell of ``request`` in ``namespace``, its output swallowed, within its time limit:
    ("defined", ""), ("raised", description), ("timed_out", limit) or ("undefined", "") when the cell
    ran but left no callable ``request["function"]``. Used beside the check and in the answer process."""
    from labkit.grading import MAX_ERROR_CHARS

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                _time_limit(request["time_limit_s"]):
            exec(compile(request["source"], request["where"], "exec"), namespace)  # noqa: S102 (the answer cell)
    except _CheckTimedOut as stopped:
        return "timed_out", stopped.limit
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: the cell is the learner's
        return "raised", describe_error(error, MAX_ERROR_CHARS)
    return ("defined", "") if callable(namespace.get(request["function"])) else ("undefined", "")


def _serve(channel: socket.socket, request: dict) -> None:
    from labkit.grading import EXERCISE_NAMESPACE

    namespace = dict(EXERCISE_NAMESPACE)
    # As the cell found them: put back before each request is read, so the check's classes and drivers that
    # arrive by name (`labkit.exercises.run_beside`), and the torch functions they use, are the check's own
    guarded = _Namespaces(registry()[request["exercise"]].check.__module__)
    ran = run_cell(request, namespace)
    _reply(channel, ran)
    if ran[0] != "defined":
        return
    learner = namespace[request["function"]]

    def answer(*args, **kwargs):
        try:
            return learner(*args, **kwargs)
        finally:  # as after each call beside the check (`_Attempt`): a driver reads on with the check's own torch
            guarded.restore()

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                _time_limit(request["time_limit_s"]):
            while (payload := _receive(channel)) is not None:
                guarded.restore()
                _reply(channel, _answer_call(answer, pickle.loads(payload)))  # noqa: S301 (from the judge)
    except _CheckTimedOut as stopped:
        _reply(channel, ("timed_out", stopped.limit))


def _answer_call(answer: Callable, request: tuple) -> tuple:
    args, kwargs, states, streams, grad_enabled, after = request
    stateful = _stateful((args, kwargs))  # found before the call, as the judge found them: it reads the reply so
    _apply_states(stateful, states)
    _set_random_streams(streams)  # the check's seeded streams, where it left them, as in one process
    gradients = None
    with torch.set_grad_enabled(grad_enabled):  # as the check called it (autograd calls a backward without)
        try:
            if after is None:
                result = _plain(_AnswersOwn.calling(answer, *args, **kwargs))
            elif after[0] == "beside":  # the check's driver calls the answer here: what it returns is the reply
                result = after[1](functools.partial(_AnswersOwn.calling, answer), *args)
            else:  # the call and its backward pass, both here
                gradients = watched_call(functools.partial(_AnswersOwn.calling, answer), args, *after[1:])
                result = _plain(gradients.result)
        except _CheckTimedOut:
            raise
        except _AnswersOwn as raised:  # each becomes the check's "raised" line, as in one process
            return _raised(raised.error)
        except NotYet as refused:  # `_plain` refusing the result, or the check's driver (as in one process)
            return ("not_yet", refused.problem, refused.hint)
        except BaseException as error:  # the driver's own, which in one process the answer's call raises too
            return _raised(error)
    return ("returned", _encode(result, stateful), [_state(item, stateful) for item in stateful], _random_streams(),
            None if gradients is None else _backward(gradients))


class _AnswersOwn(Exception):
    """What the answer itself raised, told apart from a check driver's `NotYet` on its way out."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error

    @staticmethod
    def calling(answer: Callable, *args, **kwargs):
        try:
            result = answer(*args, **kwargs)
        except _CheckTimedOut:
            raise
        except BaseException as error:
            raise _AnswersOwn(error) from error
        return _plain(result)


def _raised(error: BaseException) -> tuple:
    return ("raised", _kind(error), type(error).__name__, str(error))


def _backward(done: Differentiated) -> tuple:
    """What `watched_call` found besides the result, as data: (gradients or None, error or None, names called,
    whether the call built an autograd graph)."""
    grads = None if done.grads is None else [None if g is None else g.detach().as_subclass(torch.Tensor)
                                             for g in done.grads]
    error = None if done.error is None else (_kind(done.error), type(done.error).__name__, str(done.error))
    return grads, error, sorted(done.called), done.built_graph


def _kind(error: BaseException) -> str:
    return next((k.__name__ for k in _KINDS if isinstance(error, k)), "Exception")


# ---- the arguments' state ---------------------------------------------------------------------------


def _stateful(value, found: list | None = None, seen: set | None = None) -> list:
    """The tensors, modules, optimizers (anything with a state_dict), lists and dicts in ``value``, each
    once, in an order both processes find alike (the answer process's copy has the same structure)."""
    found, seen = ([], set()) if found is None else (found, seen)
    if id(value) in seen or isinstance(value, _VALUES):
        return found
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, nn.Module):  # the module, then each of its tensors, so a result can name one
        found.append(value)
        for tensor in (t for m in value.modules() for t in (*m._parameters.values(), *m._buffers.values())):
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(tensor)
        for hook in (h for m in value.modules() for hooks in _hook_dicts(m) for h in hooks.values()):
            _stateful(hook, found, seen)  # a check's `labkit.exercises.Recorder` brings its notes back
    elif isinstance(value, torch.optim.Optimizer):  # its state, then the tensors it steps, with their .grad
        found.append(value)
        for tensor in (t for group in value.param_groups for t in group["params"]):
            _stateful(tensor, found, seen)
    elif isinstance(value, list | tuple | dict):
        if not isinstance(value, tuple):
            found.append(value)
        for item in (value.values() if isinstance(value, dict) else value):
            _stateful(item, found, seen)
    elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        found.append(value)
    return found


def _hook_dicts(module: nn.Module) -> tuple[dict, ...]:
    return (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)


def _tensor_state(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    grad = tensor.grad if _holds_grad(tensor) else None
    grad = grad.detach().as_subclass(torch.Tensor) if grad is not None else None
    return (tensor.detach().as_subclass(torch.Tensor), grad, tensor.requires_grad)


def _holds_grad(tensor: torch.Tensor) -> bool:
    """Whether autograd fills ``tensor.grad`` (a leaf, or a tensor that retains its gradient)."""
    return tensor.is_leaf or tensor.retains_grad


def _state(item, arguments: list):
    if isinstance(item, torch.Tensor):
        return ("tensor", _tensor_state(item))
    if isinstance(item, nn.Module):
        return ("module", [(_settings(m), [(name, _tensor_state(t)) for name, t in m._parameters.items()],
                            [(name, _tensor_state(t)) for name, t in m._buffers.items()]) for m in item.modules()])
    if isinstance(item, list | dict):
        return ("items", _encode_items(item, arguments))
    return ("state_dict", item.state_dict())


def _apply_states(items: list, states: list) -> None:
    if len(items) != len(states):
        raise RuntimeError("the answer process reported arguments unlike the ones it was given")
    for item, (kind, state) in zip(items, states):
        if kind == "tensor":
            _set_tensor(item, state)
        elif kind == "module":
            _set_module(item, state)
        elif kind == "state_dict":
            _load_state_dict(item, state)
    for item, (kind, state) in zip(items, states):  # once every tensor is as the answer left it
        if kind == "items":
            _refill(item, state, items)


def _load_state_dict(item, state) -> None:
    item.load_state_dict(state)
    if isinstance(item, GradScaler) and item.is_enabled():
        # An unpickled scaler makes its scale tensor lazily, at its first scale() call: without one, an
        # answer's scaler.step would stop at "_scale is None". The judge's scalers are on the CPU.
        item.scale(torch.ones(()))


def _set_tensor(tensor: torch.Tensor, state) -> None:
    value, grad, requires_grad = state
    with torch.no_grad():
        if tensor.shape != value.shape or tensor.dtype != value.dtype:
            tensor.data = value
        elif not torch.equal(tensor, value):  # an unchanged tensor keeps its version (saved for backward)
            tensor.copy_(value)
    if tensor.is_leaf and tensor.requires_grad != requires_grad:
        tensor.requires_grad_(requires_grad)
    if not _holds_grad(tensor):
        return
    if grad is None:
        if tensor.grad is not None:
            tensor.grad = None
    elif tensor.grad is None or tensor.grad.shape != grad.shape or tensor.grad.dtype != grad.dtype:
        tensor.grad = grad
    elif not torch.equal(tensor.grad, grad):
        tensor.grad.copy_(grad)


def _settings(module: nn.Module) -> list[tuple[str, object]]:
    """A module's plain settings: ``training`` and its public numbers, strings and flags (a BatchNorm's momentum)."""
    return [(key, value) for key, value in vars(module).items()
            if not key.startswith("_") and type(value) in (bool, int, float, str, type(None))]


def _set_module(module: nn.Module, state) -> None:
    modules = list(module.modules())
    if len(modules) != len(state):
        raise RuntimeError("the answer changed which layers the module holds; the check cannot follow that")
    for m, (settings, parameters, buffers) in zip(modules, state):
        for key, value in settings:
            setattr(m, key, value)
        for name, tensor_state in parameters:
            _set_entry(m._parameters, name, tensor_state, parameter=True)
        for name, tensor_state in buffers:
            _set_entry(m._buffers, name, tensor_state, parameter=False)


def _set_entry(store: dict, name: str, state, *, parameter: bool) -> None:
    current = store.get(name)
    if state is None or current is None:
        store[name] = None if state is None else (nn.Parameter(state[0], state[2]) if parameter else state[0])
    else:
        _set_tensor(current, state)


def _random_streams() -> tuple:
    """torch's CPU, NumPy's and Python's global random state, as data."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return (torch.get_rng_state(), (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
            random.getstate())


def _set_random_streams(streams: tuple) -> None:
    generator, (kind, keys, position, has_gauss, cached), python = streams
    torch.set_rng_state(generator)
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    random.setstate(python)


# ---- results as data --------------------------------------------------------------------------------


def _encode(value, arguments: list):
    place = next((index for index, item in enumerate(arguments) if item is value), None)
    if place is not None:
        return ("argument", place, _encode_items(value, arguments) if isinstance(value, list | dict) else None)
    if isinstance(value, _VALUES):
        return ("value", value)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().as_subclass(torch.Tensor), value.requires_grad)
    if isinstance(value, range):
        return ("range", value.start, value.stop, value.step)
    if isinstance(value, np.generic | np.ndarray) and value.dtype.kind in "biuf":
        return ("numpy", value.dtype.str, torch.from_numpy(np.array(value)), isinstance(value, np.ndarray))
    if type(value) in (list, tuple, dict):
        return (type(value).__name__, _encode_items(value, arguments))
    return ("other", type(value).__name__)


def _encode_items(value, arguments: list):
    if isinstance(value, dict):
        return [(_encode(key, arguments), _encode(item, arguments)) for key, item in value.items()]
    return [_encode(item, arguments) for item in value]


def _decode(encoded, arguments: list):
    kind = encoded[0]
    if kind == "argument":
        item = arguments[encoded[1]]
        if encoded[2] is not None:  # a list or dict argument: its items as the answer left them
            _refill(item, encoded[2], arguments)
        return item
    if kind == "value":
        return encoded[1]
    if kind == "tensor":
        return encoded[1].requires_grad_() if encoded[2] else encoded[1]
    if kind == "range":
        return range(*encoded[1:])
    if kind == "numpy":
        array = encoded[2].numpy().astype(np.dtype(encoded[1]))
        return array if encoded[3] else array[()]
    if kind in ("list", "tuple"):
        items = [_decode(item, arguments) for item in encoded[1]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {_decode(key, arguments): _decode(item, arguments) for key, item in encoded[1]}
    return type(str(encoded[1]), (), {})()  # a stand-in: the check words its type as it would the real one


def _refill(container, items, arguments: list) -> None:
    if isinstance(container, dict):
        decoded = {_decode(key, arguments): _decode(item, arguments) for key, item in items}
        container.clear()
        container.update(decoded)
    else:
        container[:] = [_decode(item, arguments) for item in items]


def _stand_in_error(kind: str, name: str, message: str) -> BaseException:
    base = getattr(builtins, kind) if kind in {k.__name__ for k in _KINDS} else Exception
    return type(str(name), (base,), {"__str__": lambda self: str(message)})()


# ---- framing ----------------------------------------------------------------------------------------


def _reply(channel: socket.socket, reply: tuple) -> None:
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    _send(channel, buffer.getvalue())


def _send(channel: socket.socket, payload: bytes) -> None:
    channel.sendall(_LENGTH.pack(len(payload)) + payload)


def _receive(channel: socket.socket) -> bytes | None:
    """One framed message, or None once the other end closed."""
    header = _read_exactly(channel, _LENGTH.size)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_REPLY_BYTES:
        raise ValueError(f"a message of {length} bytes")
    return _read_exactly(channel, length)


def _read_exactly(channel: socket.socket, count: int) -> bytes | None:
    data = bytearray()
    while len(data) < count:
        chunk = channel.recv(min(count - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)
