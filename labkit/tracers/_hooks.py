"""How a `GradTracer` holds its hooks: weakly, with a registry of the parameters already traced."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from labkit.errors import LabkitError

__all__: list[str] = []

# Parameters (by id) that a GradTracer is attached to: two tracers on one parameter would run its
# hooks twice and each would see half the truth.
_TRACED_PARAMS: set[int] = set()


class _WeakHook:
    """A hook that calls a tracer's method through a weak reference. PyTorch keeps a tensor's hooks
    where the garbage collector cannot see them, so a hook holding the tracer would keep it, and
    through it the model, alive forever when a tracer is entered and never exited; with weak hooks
    such a tracer is collected and its finalizer removes the hooks."""

    __slots__ = ("_method", "_bound")

    def __init__(self, method: Any, *bound: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        method = self._method()
        return None if method is None else method(*self._bound, *args)


def _release_hooks(grad_handles: list, other_handles: list, traced_ids: set[int]) -> None:
    """Remove a tracer's hooks and free its parameters for another tracer: on exit, or when a
    tracer that was never exited is collected (it takes the lists, never the tracer itself)."""
    for handle in [*grad_handles, *other_handles]:
        if handle is not None:
            handle.remove()
    grad_handles.clear()
    other_handles.clear()
    _TRACED_PARAMS.difference_update(traced_ids)
    traced_ids.clear()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_path, _, key = name.rpartition(".")
    return model.get_submodule(module_path), key


def _refuse_traced(ids: set[int], model: nn.Module) -> None:
    if ids & _TRACED_PARAMS:
        raise LabkitError(
            f"{type(model).__name__} already has a GradTracer attached to its parameters: "
            "exit that tracer's `with` block first (two tracers would run every hook twice)"
        )
