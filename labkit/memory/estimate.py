"""The allocation-free estimate of a training step's peak: the step run on fake tensors.

The breakdown at the peak comes from PyTorch's MemTracker where the build has it, else from a
storage timeline of labkit's own; the kernels' private workspace is added from
`labkit.memory.workspace`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from labkit._torch_compat import (
    FAKE_TENSOR_FAILURES,
    FakeTensorMode,
    TorchDispatchMode,
    aten_arguments,
    mem_tracker_class,
)
from labkit.errors import LabkitError
from labkit.memory._common import (
    _allocated_nbytes,
    _as_inputs,
    _check_inputs,
    _check_model,
    _device_of,
    _optimizer_factory,
    _optimizer_tensors,
    _optional_device,
    _tensors,
    _train_step,
    _unique_bytes,
    _with_autograd,
)
from labkit.memory._fake import _fake_copy, _fake_run
from labkit.memory.formulas import onednn_lstm_workspace_bytes
from labkit.memory.report import MemoryReport
from labkit.memory.workspace import _measure_workspaces, _WorkspaceRecorder, _WorkspaceReporter
from labkit.readings import Reading

__all__ = ["estimate_step_peak"]


class _OneDnnWorkspaceOnFake(TorchDispatchMode):
    """PyTorch's fake kernel for oneDNN's LSTM returns an empty workspace; give it its real size."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.mkldnn_rnn_layer.default:
            return result
        x, hidden_size, train = aten_arguments(func, args, kwargs, "input", "hidden_size", "train")
        # the schema's outputs are (output, hy, cy, workspace), unnamed; only training keeps a workspace
        if train and result[3].numel() == 0:
            # the input arrives (seq, batch, features) whatever its batch_first flag says
            size = onednn_lstm_workspace_bytes(x.shape[0], x.shape[1], x.shape[-1], hidden_size)
            result = (*result[:3], torch.empty(size, dtype=torch.uint8, device=x.device))
        return result


_WORKSPACE = "kernel workspace"
_CATEGORIES = ("parameters", "buffers", "gradients", "optimizer state", "activations", "temporaries", _WORKSPACE,
               "inputs")
_MEM_TRACKER_CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
                           "Optstate": "optimizer state", "Activation": "activations",
                           "Temp": "temporaries", "Other": "inputs"}


def _peak_with_mem_tracker(tracker_class, model, optimizer, inputs, loss_fn, device, workspaces) -> dict[str, int]:
    tracker = tracker_class()
    tracker.track_external(model, optimizer, *_tensors(inputs))

    def categorised(kind: str) -> dict[str, int]:
        snapshot = tracker.get_tracker_snapshot(kind).get(device, {})
        named = {str(getattr(key, "value", key)): nbytes for key, nbytes in snapshot.items()}
        return {_MEM_TRACKER_CATEGORIES[key]: nbytes for key, nbytes in named.items() if key in _MEM_TRACKER_CATEGORIES}

    inside_kernels = _PeakInsideKernels(lambda: categorised("current"))
    with tracker, _WorkspaceReporter(workspaces, inside_kernels.add):
        _train_step(model, optimizer, inputs, loss_fn)
    breakdown = inside_kernels.higher_of(categorised("peak"))
    # MemTracker files everything created inside optimizer.step() as optimizer state, including the
    # step's temporaries (Adam's sqrt and division); the state itself is what optimizer.state holds.
    state = _unique_bytes(_optimizer_tensors(optimizer), device)
    misfiled = max(0, breakdown.get("optimizer state", 0) - state)
    breakdown["optimizer state"] = breakdown.get("optimizer state", 0) - misfiled
    breakdown["temporaries"] = breakdown.get("temporaries", 0) + misfiled
    return breakdown


class _PeakInsideKernels:
    """The highest moment inside a workspace-taking kernel: what the tracker holds when the kernel
    returns (inputs and outputs) plus the private bytes the kernel held on top."""

    def __init__(self, current: Callable[[], dict[str, int]]):
        self._current = current
        self.best: dict[str, int] = {}

    def add(self, workspace: int) -> None:
        moment = {**self._current(), _WORKSPACE: workspace}
        if sum(moment.values()) > sum(self.best.values()):
            self.best = moment

    def higher_of(self, tracked_peak: dict[str, int]) -> dict[str, int]:
        return dict(self.best) if sum(self.best.values()) > sum(tracked_peak.values()) else dict(tracked_peak)


class _StorageTimeline(TorchDispatchMode):
    """Fallback for builds without MemTracker: every storage the step creates, with its lifetime.

    Storages are followed by weak reference; the peak is found by replaying the timeline, and its
    breakdown uses each storage's final category (a gradient is only known as one after backward).
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self._device = device
        self._ids = WeakIdKeyDictionary()
        self._category: dict[int, str] = {}
        self._events: list[tuple[int, int]] = []
        self.current = "activations"

    def track(self, tensors, category: str) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device != self._device:
                continue
            if storage in self._ids:
                self._category[self._ids[storage]] = category
                continue
            self._add(storage, _allocated_nbytes(tensor), category)

    def add_workspace(self, nbytes: int) -> None:
        """Private bytes a kernel held while it ran: alive for that moment only."""
        workspace_id = len(self._category)
        self._category[workspace_id] = _WORKSPACE
        self._events += [(workspace_id, nbytes), (workspace_id, -nbytes)]

    def _add(self, storage, nbytes: int, category: str) -> None:
        storage_id = len(self._category)
        self._ids[storage] = storage_id
        self._category[storage_id] = category
        self._events.append((storage_id, nbytes))
        events = self._events
        weakref.finalize(storage, lambda: events.append((storage_id, -nbytes)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.track([t for t in _tensors(result) if t.untyped_storage() not in self._ids], self.current)
        return result

    def peak_breakdown(self) -> dict[str, int]:
        running, peak, peak_at = 0, 0, 0
        for index, (_, delta) in enumerate(self._events):
            running += delta
            if running > peak:
                peak, peak_at = running, index + 1
        live: dict[int, int] = {}
        for storage_id, delta in self._events[:peak_at]:
            live[storage_id] = live.get(storage_id, 0) + delta
        breakdown = dict.fromkeys(_CATEGORIES, 0)
        for storage_id, nbytes in live.items():
            breakdown[self._category[storage_id]] += nbytes
        return breakdown


def _peak_with_timeline(model, optimizer, inputs, loss_fn, device, workspaces) -> dict[str, int]:
    timeline = _StorageTimeline(device)
    timeline.track(model.parameters(), "parameters")
    timeline.track(model.buffers(), "buffers")
    timeline.track(_optimizer_tensors(optimizer), "optimizer state")
    timeline.track(_tensors(inputs), "inputs")

    def phase(name: str) -> None:
        if name == "optimizer":
            timeline.track([p.grad for p in model.parameters() if p.grad is not None], "gradients")
        timeline.current = "activations" if name == "forward" else "temporaries"

    with timeline, _WorkspaceReporter(workspaces, timeline.add_workspace):
        _train_step(model, optimizer, inputs, loss_fn, phase)
    return timeline.peak_breakdown()


@_with_autograd
def estimate_step_peak(model: nn.Module, inputs, optimizer="adamw", loss_fn=None, device=None,
                       kernel_workspace: str = "auto") -> MemoryReport:
    """The steady-state peak bytes of one training step, without running the step on real tensors.

    Runs forward, ``loss_fn(output)`` (default: sum of the first output), backward,
    ``optimizer.step()`` and ``zero_grad()`` twice on fake tensors and reports the peak of the
    second step, when the optimizer state exists; the rows are the breakdown at that moment.
    Uses PyTorch's MemTracker when the build has it, else a storage timeline of our own.
    ``int(report)`` is the peak in bytes. ``device`` runs the fake step as if the tensors lived
    there (a meta-device model estimated with the CPU's or CUDA's kernels). Used in ``13_memory``.

    Convolution and recurrent kernels also take private memory while they run (oneDNN reorders
    and scratchpads, im2col buffers, cuDNN workspaces) that is never a tensor, so fake tensors
    cannot see it. ``kernel_workspace`` says what to do about it: ``"measure"`` runs each distinct
    such call once, alone, on zero-filled tensors of its shapes, and adds the bytes it held beyond
    its outputs at that moment of the step (memory for one layer's call, never the model's step);
    ``"ignore"`` leaves it out (the report's note says the measured peak can be higher);
    ``"auto"`` (default) measures unless the model is on the meta device or the device has no
    allocator to read.
    """
    _check_model(model)
    inputs = _as_inputs(inputs)
    _check_inputs(inputs)
    device = _optional_device(device) or _device_of(model, inputs)
    make_optimizer = _optimizer_factory(model, optimizer, device)
    mode = FakeTensorMode()
    fake_model, fake_inputs = _fake_copy(model, inputs, mode, device=device)
    recorder = _WorkspaceRecorder()
    with _fake_run(mode), _OneDnnWorkspaceOnFake(), recorder:
        fake_optimizer = make_optimizer(fake_model.parameters())
        _guarded_fake_step(fake_model, fake_optimizer, fake_inputs, loss_fn)
    workspaces, workspace_note = _measure_workspaces(recorder, kernel_workspace, model, device)
    tracker_class = mem_tracker_class()
    with _fake_run(mode), _OneDnnWorkspaceOnFake():
        step = (fake_model, fake_optimizer, fake_inputs, loss_fn, device, workspaces)
        if tracker_class is not None:
            breakdown = _peak_with_mem_tracker(tracker_class, *step)
        else:
            breakdown = _peak_with_timeline(*step)
    return _estimate_report(breakdown, tracker_class is not None, workspaces, workspace_note)


def _guarded_fake_step(model, optimizer, inputs, loss_fn) -> None:
    try:
        _train_step(model, optimizer, inputs, loss_fn)
    except LabkitError as error:
        if isinstance(error.__cause__, FAKE_TENSOR_FAILURES):
            raise LabkitError(
                f"{type(model).__name__} uses an operation fake tensors cannot run ({error.__cause__}): "
                "use measure_step_peak on a real device instead"
            ) from error.__cause__
        raise


def _estimate_report(breakdown: dict[str, int], used_mem_tracker: bool, workspaces: dict,
                     workspace_note: str | None) -> MemoryReport:
    source = "fake tensors + " + ("torch MemTracker" if used_mem_tracker else "labkit storage timeline")
    rows = [(c, Reading(breakdown.get(c, 0), "B", "estimated", source=source)) for c in _CATEGORIES if c != _WORKSPACE]
    if workspaces:
        rows.insert(-1, (_WORKSPACE, Reading(breakdown.get(_WORKSPACE, 0), "B", "estimated",
                                             source="each kernel call measured alone")))
    notes = ["steady state: the peak of step 2, once the optimizer state exists"]
    if workspace_note:
        notes.append(workspace_note)
    return MemoryReport("Step peak (estimated, allocation-free)", tuple(rows), tuple(notes))
