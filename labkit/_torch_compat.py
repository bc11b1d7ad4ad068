"""The one door to torch's private APIs.

labkit's instruments lean on a few private torch names (fake tensors, dispatch modes, saved-tensor
handles, profiler internals, foreach kernels). Every one of them is reached through this module and
nowhere else, so a torch upgrade that moves or changes one breaks here, with a `TorchCompatError`
naming the entry and the installed torch version, instead of somewhere deep inside an instrument.
`tests/test_torch_compat.py` exercises every entry.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from labkit.errors import LabkitError

__all__ = [
    "DYNAMO_RECOMPILE_LOGGER",
    "FAKE_TENSOR_FAILURES",
    "FakeTensorMode",
    "LOG_RECOMPILES_CALL",
    "SavedTensor",
    "TorchCompatError",
    "TorchDispatchMode",
    "aten_arguments",
    "aten_ops",
    "compiled_original",
    "cpu_allocation",
    "fake_tensor_failures_unlogged",
    "foreach_copy_",
    "foreach_norm",
    "foreach_sub",
    "foreach_sub_",
    "graph_task_id",
    "import_dynamo_before_forking",
    "mem_tracker_class",
    "present",
    "profiler_enabled",
    "profiler_event_tree",
    "queue_backward_callback",
    "raw_saved_tensors",
    "rearm_post_accumulate_grad_hooks",
    "tensor_identity",
    "tree_flatten",
    "tree_map_only",
    "tree_unflatten",
    "use_deterministic_algorithms",
]


class TorchCompatError(LabkitError):
    """A private torch API that labkit relies on is missing or changed in the installed torch."""


def private(module: str, name: str) -> Any:
    """``module.name`` from torch, or a `TorchCompatError` naming it and the installed torch."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise TorchCompatError(
            f"torch {torch.__version__} has no {module}.{name}, a private API labkit relies on "
            f"({error}): install a torch in the range pyproject.toml declares, or report it"
        ) from error


foreach_copy_ = private("torch", "_foreach_copy_")
foreach_sub = private("torch", "_foreach_sub")
foreach_norm = private("torch", "_foreach_norm")
foreach_sub_ = private("torch", "_foreach_sub_")

# The autograd engine's backward pass (GradTracer tells a backward that finished from one that raised):
# the id of the backward running on this thread (-1 outside one), and a callback run once that
# backward has finished without error.
graph_task_id = private("torch._C", "_current_graph_task_id")
queue_backward_callback = private("torch.autograd.variable", "Variable")._execution_engine.queue_callback


def import_dynamo_before_forking() -> None:
    """Import torch._dynamo now (about 800 modules), as the first call of an optimizer's method (torch wraps
    them in torch._disable_dynamo) or DDP's constructor otherwise does, so that processes forked from this
    one do not each import it again."""
    importlib.import_module("torch._dynamo")


# dynamo's logger of recompilations (its "hit config.recompile_limit" warning names the failing guard), and
# the call that makes dynamo log each recompilation with its reason (torch's logging switch, private)
DYNAMO_RECOMPILE_LOGGER = "torch._dynamo.convert_frame"
LOG_RECOMPILES_CALL = "torch._logging.set_logs(recompiles=True)"


def tensor_identity(tensor: torch.Tensor) -> int:
    """The C++ tensor behind a Python tensor: it changes when ``torch.utils.swap_tensors`` (or a
    module conversion under ``torch.__future__.set_swap_module_params_on_conversion(True)``) swaps
    it, although the Python object stays the same."""
    return tensor._cdata


def rearm_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Re-install a tensor's post-accumulate-grad hooks on the C++ tensor behind it: after a swap the
    Python dict of hooks is still there, but the new C++ tensor never calls it."""
    hooks = param._post_accumulate_grad_hooks
    if hooks is not None:
        param._post_accumulate_grad_hooks = hooks


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """The eager module a ``torch.compile(module)`` wrapper (dynamo's OptimizedModule) runs, else None.

    An instrument that hooks modules runs this one instead: dynamo traced under global module hooks
    fails inside its own tracker on the first call."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # a compiled module exists only once it is imported
    if eval_frame is None or not isinstance(model, private("torch._dynamo.eval_frame", "OptimizedModule")):
        return None
    return model._orig_mod


def present(module: str, names) -> tuple:
    """``module.name`` for each of ``names`` this torch has, in order (a version probe, for private
    APIs whose set differs between releases); a `TorchCompatError` if the module itself is gone."""
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        raise TorchCompatError(
            f"torch {torch.__version__} has no module {module}, a private API labkit relies on "
            f"({error}): install a torch in the range pyproject.toml declares, or report it"
        ) from error
    return tuple(getattr(found, name) for name in names if hasattr(found, name))


def _changed(entry: str, error: Exception) -> TorchCompatError:
    """The error for a private API that exists but no longer looks the way labkit reads it."""
    return TorchCompatError(
        f"torch {torch.__version__} changed {entry}, a private API labkit relies on "
        f"({type(error).__name__}: {error}): install a torch in the range pyproject.toml declares, or report it"
    )


# -- deterministic mode without importing inductor (labkit.repro.setup, labkit.grading) -------------

_set_deterministic_algorithms = private("torch._C", "_set_deterministic_algorithms")
_INDUCTOR_CONFIG = "torch._inductor.config"
# What torch._inductor.config reads at import for its `deterministic` flag ("1" is on).
INDUCTOR_DETERMINISTIC_VARIABLE = "TORCHINDUCTOR_DETERMINISTIC"


def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
    """`torch.use_deterministic_algorithms`, without importing torch's compiler to set one flag.

    torch's own function imports ``torch._inductor.config`` (which imports dynamo and sympy: about
    2.5 s of CPU in every kernel that calls `labkit.repro.setup`) only to set its ``deterministic``
    flag. Here the flag is set directly where inductor is already imported; otherwise it is left
    for inductor to read at its import from ``TORCHINDUCTOR_DETERMINISTIC``, which this sets, so a
    later ``torch.compile`` sees the same mode either way. The eager mode is set as torch sets it."""
    inductor_config = sys.modules.get(_INDUCTOR_CONFIG)
    if inductor_config is not None and hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = mode
    else:
        os.environ[INDUCTOR_DETERMINISTIC_VARIABLE] = "1" if mode else "0"
    _set_deterministic_algorithms(mode, warn_only=warn_only)


# -- fake tensors and dispatch modes (labkit.memory's allocation-free runs) -------------------------

FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode")
# The exceptions a fake-tensor run raises for an operation it cannot run; the set differs between
# releases, so each is taken only where this torch has it.
FAKE_TENSOR_FAILURES: tuple[type[Exception], ...] = present(
    "torch._subclasses.fake_tensor",
    ("UnsupportedFakeTensorException", "DynamicOutputShapeException", "DataDependentOutputException",
     "UnsupportedOperatorException"),
)
_fake_tensor_log: logging.Logger = private("torch._subclasses.fake_tensor", "log")


class _DropRaisedErrorRecords(logging.Filter):
    """FakeTensorMode logs an error with its traceback (``log.exception``) and then raises it
    (a meta kernel that fails, a TypeError in dispatch): the raise is enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None


@contextlib.contextmanager
def fake_tensor_failures_unlogged() -> Iterator[None]:
    """Inside: a meta kernel that raises (bad shapes, say) raises only, without FakeTensorMode
    first logging the error's whole traceback at ERROR level (a red 19-line block in a notebook).
    The error itself still propagates; labkit turns it into a clear LabkitError."""
    record_filter = _DropRaisedErrorRecords()
    _fake_tensor_log.addFilter(record_filter)
    try:
        yield
    finally:
        _fake_tensor_log.removeFilter(record_filter)


TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode")
tree_flatten = private("torch.utils._pytree", "tree_flatten")
tree_unflatten = private("torch.utils._pytree", "tree_unflatten")
tree_map_only = private("torch.utils._pytree", "tree_map_only")


def aten_ops(names) -> frozenset:
    """The ``.default`` overload of each named aten op this torch build has (a version probe:
    cuDNN's ops, for one, are absent from some builds)."""
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


def aten_arguments(func, args: tuple, kwargs: dict | None, *names: str) -> tuple:
    """The values of the named arguments of an aten call, bound by the op's schema, not by position.

    ``func`` is an ``OpOverload`` (as a dispatch mode receives it); positional and keyword
    arguments are both bound, and an argument left out takes its schema default."""
    try:
        schema = func._schema.arguments
        bound = {argument.name: argument.default_value for argument in schema if argument.has_default_value()}
        bound.update(zip((argument.name for argument in schema), args))
    except AttributeError as error:
        raise _changed("OpOverload._schema.arguments", error) from error
    bound.update(kwargs or {})
    missing = [name for name in names if name not in bound]
    if missing:
        raise TorchCompatError(
            f"torch {torch.__version__}: {func} has no argument {', '.join(missing)} in its schema "
            f"({', '.join(argument.name for argument in schema)}); labkit reads it by that name: "
            "install a torch in the range pyproject.toml declares, or report it"
        )
    return tuple(bound[name] for name in names)


# -- autograd's saved-tensor handles (labkit.memory's exact count) --------------------------------

SavedTensor = private("torch._C._autograd", "SavedTensor")


def raw_saved_tensors(node) -> list:
    """The `SavedTensor` handles a graph node keeps (its ``_raw_saved_*`` attributes), none unpacked.

    Reading ``node._saved_x`` instead would run a hooked tensor's unpack hook, which for
    ``torch.utils.checkpoint`` recomputes the forward. A handle has ``.data`` (the tensor, or
    None for an undefined one) and ``.unpack_hook`` (None when no saved_tensors_hooks packed it)."""
    values = [getattr(node, name) for name in dir(node) if name.startswith("_raw_saved_")]
    return [handle for value in values for handle in (value if isinstance(value, (tuple, list)) else (value,))
            if isinstance(handle, SavedTensor)]


# -- torch.distributed's MemTracker (labkit.memory's step-peak estimate) --------------------------


def mem_tracker_class():
    """PyTorch's MemTracker where this build has it (torch.distributed._tools, 2.5+), else None.

    Imported on first call, which keeps it out of ``import labkit``; a build without
    torch.distributed, or an older torch, has none, and labkit then uses its own storage timeline."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:
        return None
    return MemTracker


# -- the profiler's event tree (labkit.memory's CPU allocator measurements) -----------------------

profiler_enabled = private("torch.autograd", "_profiler_enabled")
_EventType = private("torch._C._profiler", "_EventType")


def profiler_event_tree(prof) -> list:
    """The roots of a finished ``torch.profiler.profile``'s event tree (kineto's results).

    Each node has ``name``, ``children`` and ``tag``; read allocations with `cpu_allocation`."""
    try:
        return list(prof.profiler.kineto_results.experimental_event_tree())
    except AttributeError as error:
        raise _changed("profile.profiler.kineto_results.experimental_event_tree()", error) from error


def cpu_allocation(node) -> tuple[int, int, int] | None:
    """``(start_time_ns, address, +bytes or -bytes)`` if an event-tree node is a CPU allocator
    event (``profile_memory=True``), else None."""
    try:
        if node.tag != _EventType.Allocation or node.extra_fields.device.type != "cpu":
            return None
        return node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size
    except AttributeError as error:
        raise _changed("the profiler event tree's allocation events", error) from error
