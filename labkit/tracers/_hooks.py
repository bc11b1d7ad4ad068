"""How a `GradTracer` holds its hooks: weakly, with a registry of the parameters already traced."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from labkit._torch_compat import rearm_post_accumulate_grad_hooks
from labkit.errors import LabkitError
from labkit.tracers._options import _check_optimizer_owns_some

__all__: list[str] = []

# Parameters (by id) that a GradTracer is attached to: two tracers on one parameter would run its
# hooks twice and each would see half the truth.
_TRACED_PARAMS: set[int] = set()


class _WeakHook:
    """A hook that calls a tracer's method through a weak reference. PyTorch keeps a tensor's hooks
    where the garbage collector cannot see them, so a hook holding the tracer would keep it, and
    through it the model, alive forever when a tracer is entered and never exited; with weak hooks
    such a tracer is collected and its finalizer removes the hooks. A plain weak reference to the
    tracer and its method's function, not ``weakref.WeakMethod``: dynamo traces a call of the one,
    not of the other, and ``torch.compile(model, fullgraph=True)`` traces the model's module hooks."""

    __slots__ = ("_owner", "_function", "_bound")

    def __init__(self, method: Any, *bound: Any) -> None:
        self._owner = weakref.ref(method.__self__)
        self._function = method.__func__
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        owner = self._owner()
        return None if owner is None else self._function(owner, *self._bound, *args)


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


def _replacement_parameters(
    model: nn.Module, names: list[str], optimizer: Any, traced_ids: set[int]
) -> list[nn.Parameter]:
    """The model's parameters that replaced the traced ones (`GradTracer._reattach`), or a
    `LabkitError` when the tracer cannot follow them."""
    named = [(name, p) for name, p in model.named_parameters() if p.numel() > 0]
    what = (
        "the model's parameters were replaced while the tracer was attached "
        "(load_state_dict(..., assign=True), .to(), or a conversion that swaps tensors)"
    )
    if [name for name, _ in named] != names:
        raise LabkitError(
            f"{what} and are no longer the same set ({len(named)} now, {len(names)} "
            "traced): exit this tracer and attach a new GradTracer to the new model"
        )
    params = [p for _, p in named]
    if any(p.device.type == "meta" for p in params):
        raise LabkitError(
            f"{what}, and they are on the meta device now: meta tensors hold no values, so "
            "there is no gradient to trace; exit the tracer before moving the model to meta"
        )
    if optimizer is not None:
        _check_optimizer_owns_some(optimizer, model, params, replaced=True)
    _refuse_traced({id(p) for p in params} - traced_ids, model)
    return params


def _unhook_and_register(grad_handles: list, traced_ids: set[int], params: list[nn.Parameter]) -> None:
    """Remove the gradient hooks of the replaced parameters and register their replacements as
    traced (`GradTracer._reattach`, which hooks them next)."""
    for handle in grad_handles:
        if handle is not None:
            handle.remove()
    _TRACED_PARAMS.difference_update(traced_ids)
    traced_ids.clear()
    traced_ids.update(id(p) for p in params)
    _TRACED_PARAMS.update(traced_ids)
    for param in params:
        rearm_post_accumulate_grad_hooks(param)
