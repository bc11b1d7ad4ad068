"""Kernel workspace: the private memory convolution and recurrent kernels hold while they run.

It goes through the allocator but never becomes a tensor, so no fake-tensor tracker sees it.
`labkit.memory.estimate` records each distinct such call on fake tensors; this module runs each
one once, alone, on zero-filled tensors, and measures the bytes it held beyond its outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
from torch import nn

from labkit._torch_compat import TorchDispatchMode, aten_ops, tree_flatten, tree_unflatten
from labkit.errors import LabkitError
from labkit.memory._common import _storage_key, _tensors, _unique_bytes
from labkit.memory.measure import _allocations_under, _no_allocator, _profiled_events, peak_bytes_during
from labkit.readings import format_bytes

__all__ = ["KERNEL_WORKSPACE"]


# Kernels that take private memory while they run (oneDNN's layout reorders and scratchpads, the
# native convolution's im2col buffers, cuDNN workspaces) and free it before returning: it goes
# through the allocator but never becomes a tensor, so no fake-tensor tracker can see it.
_WORKSPACE_OPS = aten_ops(("convolution", "convolution_backward", "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward",
                          "_cudnn_rnn", "_cudnn_rnn_backward"))
# the choices of estimate_step_peak(kernel_workspace=...)
KERNEL_WORKSPACE = ("auto", "measure", "ignore")
# Measuring allocates one kernel call's inputs and outputs for real; a call that would take more
# than this share of the memory available now is not run (a huge meta model would otherwise
# allocate, or fail to allocate, what its estimate was meant to avoid).
_MEASURE_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    @property
    def extent(self) -> int:
        """Elements of the storage behind a tensor of this shape and stride."""
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0

    @property
    def nbytes(self) -> int:
        return self.extent * self.dtype.itemsize

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.extent, dtype=self.dtype, device=self.device).as_strided(self.shape, self.stride)


def _call_key(func, args, kwargs) -> tuple:
    leaves, _ = tree_flatten((args, kwargs))
    return (func, *(_TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))


class _WorkspaceRecorder(TorchDispatchMode):
    """Notes each distinct call of a workspace-taking kernel: op, argument shapes, strides, dtypes,
    and the bytes that measuring it alone would allocate for its inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple, tuple] = {}
        self.tensor_bytes: dict[tuple, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _WORKSPACE_OPS:
            leaves, tree = tree_flatten((args, kwargs))
            specs = [_TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            key = _call_key(func, args, kwargs)
            self.calls.setdefault(key, (func, specs, tree))
            self.tensor_bytes[key] = (sum(spec.nbytes for spec in specs if isinstance(spec, _TensorSpec))
                                      + sum(_TensorSpec.of(t).nbytes for t in _tensors(result)))
        return result


class _WorkspaceReporter(TorchDispatchMode):
    """After each workspace-taking kernel returns, reports the private bytes it was measured to hold."""

    def __init__(self, workspaces: dict[tuple, int], report: Callable[[int], None]):
        super().__init__()
        self._workspaces, self._report = workspaces, report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self._workspaces and func in _WORKSPACE_OPS:
            self._report(self._workspaces[_call_key(func, args, kwargs)])
        return result


def _zero_filled(specs: list, tree) -> tuple[tuple, dict]:
    """A recorded call's arguments, with a zero-filled tensor for each tensor spec."""
    return tree_unflatten([spec.zeros() if isinstance(spec, _TensorSpec) else spec for spec in specs], tree)


def _cuda_private_bytes(calls: dict, device: torch.device) -> dict[tuple, int]:
    """Each kernel call alone: the CUDA allocator's peak rise during it, less its new outputs."""
    workspaces = {}
    for key, (func, specs, tree) in calls.items():
        args, kwargs = _zero_filled(specs, tree)
        inputs, kept = {_storage_key(t) for t in _tensors((args, kwargs))}, []
        with torch.no_grad():
            rise = int(peak_bytes_during(lambda: kept.append(func(*args, **kwargs)), device))
        outputs = _unique_bytes([t for t in _tensors(kept) if _storage_key(t) not in inputs], device)
        workspaces[key] = max(0, rise - outputs)
    return workspaces


def _cpu_private_bytes(calls: dict) -> dict[tuple, int]:
    """Every kernel call in one profiler session, each in its own range: within a range, the
    allocations' highest running total less what the range left allocated (its outputs)."""
    from torch.profiler import record_function

    labels = {f"labkit.kernel_workspace.{index}": key for index, key in enumerate(calls)}

    def run_each() -> None:
        for label, key in labels.items():
            func, specs, tree = calls[key]
            args, kwargs = _zero_filled(specs, tree)
            with torch.no_grad(), record_function(label):
                outputs = func(*args, **kwargs)
            # after the range closes, so that the range ends holding the outputs; and before the
            # next call's inputs exist, so that one call's tensors are alive at a time
            del outputs, args, kwargs

    stack, ranges = _profiled_events(run_each), {}
    while stack:
        node = stack.pop()
        if node.name in labels:
            ranges[labels[node.name]] = node
        else:
            stack.extend(node.children)
    return {key: _held_beyond_outputs(_allocations_under([node])) for key, node in ranges.items()}


def _held_beyond_outputs(events: list[tuple[int, int]]) -> int:
    running, peak, live = 0, 0, {}
    for ptr, delta in events:
        running += delta
        peak = max(peak, running)
        if delta > 0:
            live[ptr] = delta
        else:
            live.pop(ptr, None)
    return max(0, peak - sum(live.values()))


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def _too_large_to_measure(recorder: _WorkspaceRecorder, device: torch.device) -> str | None:
    """Why the largest recorded call cannot be run alone here (its tensors would take more than
    `_MEASURE_MEMORY_SHARE` of the memory available now), or None."""
    key = max(recorder.tensor_bytes, key=recorder.tensor_bytes.get)
    needed, available = recorder.tensor_bytes[key], _available_bytes(device)
    if needed <= _MEASURE_MEMORY_SHARE * available:
        return None
    return (f"running {key[0].name().removeprefix('aten::')} alone would allocate {format_bytes(needed)} of "
            f"zero-filled inputs and outputs (its workspace comes on top), more than "
            f"{_MEASURE_MEMORY_SHARE:.0%} of the {format_bytes(available)} available on {device} now; "
            "pass kernel_workspace='ignore' (the report then says the measured peak can be higher), "
            "or estimate a smaller batch")


def _measure_workspaces(recorder: _WorkspaceRecorder, choice: str, model: nn.Module,
                        device: torch.device) -> tuple[dict[tuple, int], str | None]:
    """Private bytes per recorded kernel call, and a note for the report (None: nothing to say)."""
    if choice not in KERNEL_WORKSPACE:
        raise LabkitError(f"kernel_workspace={choice!r} is not one of {KERNEL_WORKSPACE}")
    if not recorder.calls:
        return {}, None
    if choice == "ignore":
        return {}, ("kernel workspaces ignored (kernel_workspace='ignore'): convolution and recurrent kernels "
                    "take private memory while they run, so the measured peak can be higher")
    reason = _no_allocator(device) or (
        "the model is on the meta device, so measuring would allocate what it was meant to avoid "
        "(pass kernel_workspace='measure' to run each such kernel once, alone)"
        if choice == "auto" and any(t.is_meta for t in (*model.parameters(), *model.buffers())) else None)
    reason = reason or _too_large_to_measure(recorder, device)
    if reason:
        if choice == "measure":
            raise LabkitError(f"kernel_workspace='measure' cannot measure on {device}: {reason}")
        return {}, f"kernel workspaces not measured: {reason}"
    workspaces = (_cpu_private_bytes(recorder.calls) if device.type == "cpu"
                  else _cuda_private_bytes(recorder.calls, device))
    ops = sorted({key[0].name().removeprefix("aten::") for key in workspaces})
    return workspaces, (
        f"kernel workspace: measured by running each of the {len(workspaces)} distinct {', '.join(ops)} calls once, "
        f"alone, on zero-filled tensors on {device} (largest: {max(workspaces.values()):,} B)")
