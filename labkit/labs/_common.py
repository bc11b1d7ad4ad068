"""Pieces every lab's training loop shares: a seeded model build, the audited optimizer, the printed curve."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import types
from collections.abc import Callable, Iterator

import torch

from labkit.labs._audit import StepAudit

__all__: list[str] = []


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C while the body runs takes effect as it ends, not inside it.

    For the calls that talk to DataLoader workers: a KeyboardInterrupt raised inside a multiprocessing.Queue's
    put, after its lock was taken, leaves the lock held, and when the garbage collector later reaches that queue
    its finalizer waits for the lock for ever (a test run hung so). The body's own waits are bounded (DataLoader's
    timeout), so the interrupt is late by at most that; if the body raises meanwhile, its error is what
    propagates. Outside the main thread, where no handler can be set, the body runs as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # None: a handler set outside Python, which could not be put back
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


def reference_copy(stage: Callable) -> Callable:
    """A second function object with ``stage``'s code, for a lab's own measurements (a reference gradient, the
    run's final error): the grading process withholds the stage object itself from a learner's repair
    (`labkit.labs._isolated`), and a measurement must not go with it."""
    return types.FunctionType(stage.__code__, stage.__globals__, stage.__name__, stage.__defaults__, stage.__closure__)


def seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    """``build()`` with torch's global stream at ``seed``, leaving the caller's stream as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def audited_sgd(params: list[torch.Tensor], lr: float,
                watched: list[torch.Tensor] | None = None) -> tuple[torch.optim.SGD, StepAudit]:
    """Plain SGD over ``params``, audited over ``watched`` (default ``params``): frozen tensors may not move either."""
    optimizer = torch.optim.SGD(params, lr=lr)
    return optimizer, StepAudit(optimizer, params if watched is None else watched, lr)


def curve_text(values: list[float], points: int = 8) -> str:
    """``points`` values spread over a curve (first and last included), as a practitioner's log shows them."""
    if not values:
        return "(no steps)"
    picks = sorted({round(i * (len(values) - 1) / (points - 1)) for i in range(points)})
    return "  ".join(f"{i + 1}:{number(values[i])}" for i in picks)


def number(value: float) -> str:
    """A loss or norm as a short, deterministic string ("nan" and "inf" spelled out)."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.3g}"


def relative_gap(value: float, reference: float) -> float:
    """How far ``value`` is from ``reference``, relative to it (inf when ``value`` is not finite)."""
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-12)


def grad_norm(params) -> float:
    """The total L2 norm of the gradients the parameters hold (0 when none holds one)."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0


def one_step_effect(probe: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor],
                    lr: float) -> tuple[float, float]:
    """``loss_of(probe)`` before and after one plain SGD step at ``lr`` on that loss: what a decoy "the
    learning rate is too low" is answered with (one step that lowers the loss says the rate moves it)."""
    loss = loss_of(probe)
    grads = torch.autograd.grad(loss, list(probe.parameters()))
    with torch.no_grad():
        for parameter, grad in zip(probe.parameters(), grads):
            parameter -= lr * grad
        return loss.item(), loss_of(probe).item()
