"""What the allocator really did: measured peaks and live bytes, on CPU via profiler events,
on CUDA via torch.cuda statistics; unavailable, with the reason, where nothing can be read."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from labkit._torch_compat import cpu_allocation, profiler_enabled, profiler_event_tree
from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.memory._common import (
    _as_inputs,
    _check_inputs,
    _check_model,
    _device_of,
    _forward,
    _gc_paused,
    _model_left_unchanged,
    _optimizer_factory,
    _optimizer_tensors,
    _tensors,
    _train_step,
    _unique_bytes,
    _with_autograd,
)
from labkit.memory.report import MemoryReport
from labkit.readings import Reading

__all__ = ["live_bytes_after_forward", "live_bytes_timeline", "measure_step_peak", "peak_bytes_during"]


def _profiled_events(fn: Callable[[], object]) -> list:
    """The profiler's event tree (its roots) for one run of fn, with CPU allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with _gc_paused(), _profiler_notices_dropped():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    return profiler_event_tree(prof)


# Kineto writes a timestamped "USDT:... profiler_start" / "profiler_stop" line to the process's
# stderr (file descriptor 2, below Python) each time a profiler starts and stops. It says nothing
# about the measurement and would be stored in every notebook output that measures memory.
PROFILER_NOTICE = "USDT:"


@contextlib.contextmanager
def _profiler_notices_dropped() -> Iterator[None]:
    """Run the block with fd 2 captured; pass every captured line on except the profiler's notices."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(PROFILER_NOTICE)]
            if kept:
                sys.stderr.write("".join(kept))


def _allocations_under(roots: list) -> list[tuple[int, int]]:
    """(address, +bytes or -bytes) for every CPU allocator event in these subtrees, in time order."""
    stack, events = list(roots), []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if (event := cpu_allocation(node)) is not None:
            events.append(event)
    return [(ptr, size) for _, ptr, size in sorted(events, key=lambda event: event[0])]


def _allocation_events(fn: Callable[[], object]) -> list[tuple[int, int]]:
    """(address, +bytes or -bytes) for every CPU allocator event while fn runs, in time order."""
    return _allocations_under(_profiled_events(fn))


def _no_allocator(device: torch.device) -> str | None:
    if device.type == "cuda" and not torch.cuda.is_available():
        return ("no CUDA on this machine or in this PyTorch build (torch.cuda.is_available() is False); "
                "torch.cuda.max_memory_allocated() would return 0 here, which is not a measurement")
    if device.type == "meta":
        return "meta tensors have no storage: nothing is allocated, so there is nothing to measure"
    if device.type not in ("cpu", "cuda"):
        return f"labkit has no allocator statistics for device type {device.type!r}"
    if device.type == "cpu" and profiler_enabled():
        return ("a torch profiler is already running, and CPU allocations are read with one: starting "
                "another would end yours; measure outside the profiler's `with` block")
    return None


def peak_bytes_during(fn: Callable[[], object], device="cpu") -> Reading:
    """The measured rise of allocated bytes above their level at the start, at its highest, while
    ``fn()`` runs.

    On CPU from the profiler's allocation events (``profile_memory=True``); on CUDA from
    ``torch.cuda`` statistics (reset, run, read). Unavailable, with the reason, where there is
    nothing to measure. Used in ``13_memory``. ``fn`` runs in the caller's autograd mode (under
    ``torch.no_grad()`` it measures an inference forward).
    """
    if not callable(fn):
        raise LabkitError(f"peak_bytes_during needs a function to call, not {type(fn).__name__}: "
                          "pass lambda: model(x) (the work, not its result)")
    device = resolve_device(device, kinds=("cpu", "cuda", "mps", "meta"), must_exist=False)
    reason = _no_allocator(device)
    if reason:
        return Reading.unavailable("B", reason)
    if device.type == "cuda":
        return Reading(_cuda_peak_rise(fn, device), "B", "measured",
                       source="torch.cuda.max_memory_allocated after reset_peak_memory_stats")
    running, peak = 0, 0
    for _, delta in _allocation_events(fn):
        running += delta
        peak = max(peak, running)
    return Reading(peak, "B", "measured", source="torch.profiler allocation events")


def _cuda_peak_rise(fn, device) -> int:
    with _gc_paused():  # collect first, then read the baseline
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


@_with_autograd
def live_bytes_after_forward(model: nn.Module, *inputs) -> Reading:
    """Bytes allocated during one ``model(*inputs)`` that are still allocated when it returns.

    The allocator's view of what a forward leaves behind: the saved activations plus the outputs
    nothing saved (compare with ``saved_tensors(...)``, whose ``total + output_only_bytes`` should be
    the same number). Used in ``13_memory``.
    """
    _check_model(model)
    _check_inputs(inputs)
    device = _device_of(model, inputs)
    reason = _no_allocator(device)
    if reason:
        return Reading.unavailable("B", reason)
    kept: list = []
    with _model_left_unchanged(model, include_parameters=False):
        if device.type == "cuda":
            return _cuda_live_after(lambda: kept.append(_forward(model, inputs)), device)
        live: dict[int, int] = {}
        for ptr, delta in _allocation_events(lambda: kept.append(_forward(model, inputs))):
            if delta > 0:
                live[ptr] = delta
            else:
                live.pop(ptr, None)
    return Reading(sum(live.values()), "B", "measured", source="torch.profiler allocation events")


def live_bytes_timeline(phases: Mapping[str, Callable[[], object]]) -> list[tuple[str, int]]:
    """Bytes alive on the CPU allocator after every allocation and every free while ``phases`` run.

    ``phases`` maps a name to a function, e.g. ``{"forward": ..., "backward": ..., "optimizer
    step": ...}``; they run in that order, each under the profiler, and the result is one
    ``(phase name, bytes alive)`` pair per allocator event, counted from the level before the first
    phase (a phase that frees what an earlier one allocated goes below it). CPU tensors only: a
    step's memory over time, forward rising, backward falling, the peak where they meet. Used in
    ``13_memory``.
    """
    if not isinstance(phases, Mapping) or not phases:
        raise LabkitError("live_bytes_timeline() takes a dict of phase name -> function, e.g. "
                          "{'forward': run_forward, 'backward': run_backward}")
    not_callable = [name for name, fn in phases.items() if not callable(fn)]
    if not_callable:
        raise LabkitError(f"phases {not_callable} are not functions: pass a function (a lambda) for each phase")
    if profiler_enabled():
        raise LabkitError("a torch profiler is already running, and CPU allocations are read with one: "
                          "call live_bytes_timeline outside the profiler's `with` block")
    timeline, alive = [], 0
    for name, fn in phases.items():
        for _, delta in _allocation_events(fn):
            alive += delta
            timeline.append((name, alive))
    return timeline


def _cuda_live_after(fn, device) -> Reading:
    with _gc_paused():  # collect first, then read the baseline
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        fn()
    torch.cuda.synchronize(device)
    return Reading(torch.cuda.memory_allocated(device) - start, "B", "measured",
                   source="torch.cuda.memory_allocated before and after")


def _state_rows(model, optimizer, inputs, device) -> list[tuple[str, Reading]]:
    groups = [("parameters", list(model.parameters())), ("buffers", list(model.buffers())),
              ("gradients", [p.grad for p in model.parameters() if p.grad is not None]),
              ("optimizer state", _optimizer_tensors(optimizer)), ("inputs", _tensors(inputs))]
    seen: set[int] = set()
    source = "storages alive at the start of step 2"
    return [(label, Reading(_unique_bytes(tensors, device, seen), "B", "measured", source=source))
            for label, tensors in groups]


@_with_autograd
def measure_step_peak(model: nn.Module, inputs, optimizer="adamw", loss_fn=None) -> MemoryReport:
    """The measured steady-state peak of one training step: the counterpart of
    :func:`estimate_step_peak`, on the model's device.

    Runs two real steps (the model's weights, buffers, grads and RNG are restored afterwards).
    Rows: what is alive when step 2 starts (counted from the live tensors), plus the allocator's
    highest rise during step 2 (profiler events on CPU, ``torch.cuda`` statistics on CUDA). On a
    device with no allocator to read, the rows say why instead of giving 0. Used in ``13_memory``.
    """
    _check_model(model)
    inputs = _as_inputs(inputs)
    _check_inputs(inputs)
    device = _device_of(model, inputs)
    make_optimizer = _optimizer_factory(model, optimizer, device)
    reason = _no_allocator(device)
    if reason:
        return MemoryReport("Step peak (measured)", (("step 2 peak", Reading.unavailable("B", reason)),))
    with _model_left_unchanged(model, include_parameters=True):
        real_optimizer = make_optimizer(model.parameters())
        _train_step(model, real_optimizer, inputs, loss_fn)
        rows = _state_rows(model, real_optimizer, inputs, device)
        rise = peak_bytes_during(lambda: _train_step(model, real_optimizer, inputs, loss_fn), device)
    rows.append(("rise during step 2", rise))
    return MemoryReport("Step peak (measured)", tuple(rows))
