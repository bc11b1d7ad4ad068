"""A model's forward traced on fake tensors (shapes and dtypes, no memory), module call by call.

Private to `labkit.memory`: the analytic formulas read the trace, the step-peak estimate runs
its fake step on the same structural copy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from labkit._torch_compat import (
    FAKE_TENSOR_FAILURES,
    FakeTensorMode,
    TorchDispatchMode,
    aten_ops,
    fake_tensor_failures_unlogged,
    raw_saved_tensors,
    tree_map_only,
)
from labkit.errors import LabkitError
from labkit.memory._common import (
    _device_of,
    _forward,
    _module_names,
    _storage_key,
    _storage_nbytes,
    _tensors,
)

__all__: list[str] = []


def _fake_copy(model: nn.Module, inputs: Sequence, mode: FakeTensorMode, dtype=None, device=None):
    """A structural copy of the model whose tensors are fake: same shapes, no memory.

    ``device`` moves the fake tensors (a meta-device model traced as if on the CPU, so the
    dispatcher picks the CPU kernels); ``dtype`` casts the floating-point ones."""

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        result = mode.from_tensor(tensor.detach())
        with mode:
            if device is not None and result.device != device:
                result = torch.empty_strided(result.shape, result.stride(), dtype=result.dtype, device=device)
            if dtype is not None and tensor.is_floating_point():
                result = result.to(dtype)
        # a parameter gets requires_grad from nn.Parameter below; an input may need it too
        if tensor.requires_grad and not isinstance(tensor, nn.Parameter):
            result.requires_grad_()
        return result

    memo: dict[int, object] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(fake(parameter), requires_grad=parameter.requires_grad)
    for module in model.modules():
        for value in [*module.buffers(recurse=False), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = fake(value)
    try:
        fake_model = copy.deepcopy(model, memo)
    except Exception as error:
        raise LabkitError(
            f"could not copy {type(model).__name__}'s structure for an allocation-free run "
            f"({type(error).__name__}: {error}); measure instead with measure_step_peak"
        ) from error
    fake_inputs = tree_map_only(torch.Tensor, fake, list(inputs))
    return fake_model, fake_inputs


# Matrix products whose real kernels refuse operands of different dtypes ("mat1 and mat2 must have
# the same dtype") while their fake (meta) kernels of this torch accept them and answer with a
# shape: an int64 input to a Linear would get a full estimate for a step that cannot run.
_ONE_DTYPE_OPS = aten_ops(("mm", "addmm", "mv", "addmv", "addbmm", "bmm", "baddbmm", "dot"))


class _RealKernelDtypeChecks(TorchDispatchMode):
    """Raises, on fake tensors, the dtype error the real matrix-product kernel would raise."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ONE_DTYPE_OPS:
            dtypes = list(dict.fromkeys(t.dtype for t in _tensors((args, kwargs))))
            if len(dtypes) > 1:
                names = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise RuntimeError(f"{func.name().removeprefix('aten::')} needs all its tensors in one dtype, "
                                   f"but got {names} (the real kernel refuses this)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _fake_run(mode: FakeTensorMode) -> Iterator[None]:
    """Inside: ops run on fake tensors, with the checks the real kernels make and the fake ones
    skip, and without the tracebacks FakeTensorMode logs before it raises."""
    with fake_tensor_failures_unlogged(), mode, _RealKernelDtypeChecks():
        yield


def _fake_forward(model: nn.Module, inputs: Sequence):
    try:
        return _forward(model, inputs)
    except LabkitError as error:
        if isinstance(error.__cause__, FAKE_TENSOR_FAILURES):
            raise LabkitError(
                f"{type(model).__name__} uses an operation fake tensors cannot run "
                f"({error.__cause__}); the allocation-free path is closed for it: use "
                "saved_tensors / measure_step_peak on a real device instead"
            ) from error.__cause__
        raise


@dataclass(frozen=True)
class _OpCall:
    """One aten op the fake forward ran, with its tensors (as the op saw them, below autograd)."""

    name: str
    args: tuple
    kwargs: dict
    outputs: tuple
    grad_enabled: bool  # off inside an autograd.Function's forward or no_grad: nothing is saved


@dataclass(frozen=True)
class _Saved:
    """One storage autograd saved during the fake forward (the exact count, on fake tensors)."""

    nbytes: int
    call: _Call | None  # the innermost module call running when it was saved
    tensor: torch.Tensor


@dataclass(eq=False)
class _Call:
    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: list = field(default_factory=list)
    ops: set = field(default_factory=set)
    children: list = field(default_factory=list)
    # the ops that ran while this was the innermost module call (its own code, not its children's)
    own_ops: list = field(default_factory=list)

    @property
    def input(self) -> torch.Tensor:
        return _tensors((self.args, self.kwargs))[0]

    @property
    def needs_grad(self) -> bool:
        return any(t.requires_grad for t in self.outputs)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.outputs[0].dtype


class _CallRecorder(TorchDispatchMode):
    """Records each module call's arguments, outputs and the aten ops that ran inside it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.calls: list[_Call] = []
        self._open: list[_Call] = []
        self._model = model
        self._names = _module_names(model)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        handles = []
        for module in self._model.modules():
            handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave, with_kwargs=True))
        try:
            with self:
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, module, args, kwargs) -> None:
        call = _Call(self._names[module], module, args, dict(kwargs))
        if self._open:
            self._open[-1].children.append(call)
        self.calls.append(call)
        self._open.append(call)

    def _leave(self, module, args, kwargs, output) -> None:
        self._open.pop().outputs = _tensors(output)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1].split(".")[0]
        for call in self._open:
            call.ops.add(name)
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if self._open:
            self._open[-1].own_ops.append(_OpCall(name, args, kwargs, tuple(_tensors(output)), torch.is_grad_enabled()))
        return output

    def innermost(self) -> _Call | None:
        return self._open[-1] if self._open else None


class _SavedRecorder:
    """The exact count inside the fake forward: every storage autograd saves, with the module call
    running when it was saved; `op_names` then names the graph node (the op) that saved each."""

    def __init__(self, recorder: _CallRecorder):
        self._recorder = recorder
        self.saved: dict[int, _Saved] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self.saved:
            self.saved[key] = _Saved(_storage_nbytes(tensor), self._recorder.innermost(), tensor)
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpacked)

    def op_names(self, outputs: list[torch.Tensor]) -> dict[int, str]:
        """Storage key -> the name of the graph node that saved it (``ExpBackward0``)."""
        names: dict[int, str] = {}
        frontier, walked = [t.grad_fn for t in outputs if t.grad_fn is not None], set()
        while frontier:
            node = frontier.pop()
            if node is None or node in walked:
                continue
            walked.add(node)
            for handle in raw_saved_tensors(node):
                if isinstance(handle.data, torch.Tensor):
                    names.setdefault(_storage_key(handle.data), node.name())
            frontier.extend(next_node for next_node, _ in node.next_functions)
        return names


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class _Trace:
    calls: list[_Call]
    excluded: set[int]  # storages of parameters, buffers and inputs: never activations
    saved: dict[int, _Saved]
    op_names: dict[int, str]


def _trace(model: nn.Module, inputs: Sequence, precision: str, device) -> _Trace:
    """Run the forward on fake tensors at the given precision: the module calls, the storages that
    are model state or inputs, and what autograd saved (each storage once), by module and op."""
    mode = FakeTensorMode()
    dtype = _PURE_DTYPES.get(precision)
    fake_model, fake_inputs = _fake_copy(model, inputs, mode, dtype, device)
    state = [*fake_model.parameters(), *fake_model.buffers(), *_tensors(fake_inputs)]
    recorder = _CallRecorder(fake_model)
    saved = _SavedRecorder(recorder)
    with _fake_run(mode), _autocast_for(precision, device or _device_of(model, inputs)):
        with recorder.recording(), saved.hooks():
            output = _fake_forward(fake_model, fake_inputs)
    excluded = {_storage_key(t) for t in state}
    kept = {key: item for key, item in saved.saved.items() if key not in excluded}
    return _Trace(recorder.calls, excluded, kept, saved.op_names(_tensors(output)))


_PURE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16,
                "mixed_bf16": torch.bfloat16, "mixed_fp16": torch.float16}
_AMP_DTYPES = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}


def _autocast_for(precision: str, device: torch.device):
    if precision not in _AMP_DTYPES:
        return contextlib.nullcontext()
    if device.type not in ("cpu", "cuda"):
        raise LabkitError(f"autocast ({precision}) runs on cpu or cuda, not {device.type}: pass "
                          "device='cpu' or device='cuda' to trace the model as if it lived there")
    return torch.autocast(device_type=device.type, dtype=_AMP_DTYPES[precision])
