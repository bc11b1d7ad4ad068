"""`GradTracer`: per-parameter gradient statistics, step by step, from PyTorch's own hooks, with the
records it keeps (`HISTORY_KEYS`, `ACTIVATION_KEYS`) and the alerts it raises (`Alert`).

What a *step* is: one optimizer step. ``GradTracer(model, optimizer)`` closes a step in the
optimizer's step post-hook; without an optimizer, call ``tracer.step()`` once per optimizer step.
Gradient statistics are taken in each parameter's post-accumulate-grad hook, so with k micro-batches
a step's record describes the accumulated gradient after the step's last backward (raw, before any
clipping) and says ``accumulations == k``. The hooks leave their statistics on the device; closing
a step reads everything with one transfer.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from labkit._torch_compat import (
    foreach_copy_,
    foreach_norm,
    foreach_sub_,
    graph_task_id,
    queue_backward_callback,
    rearm_post_accumulate_grad_hooks,
    tensor_identity,
)
from labkit.errors import LabkitError
from labkit.tracers._options import (
    _check_histogram_sample,
    _check_optimizer_owns_some,
    _check_thresholds,
    _check_tracer_options,
)

__all__ = [
    "ACTIVATION_KEYS",
    "ALERT_KINDS",
    "EXPLODE_MIN_BASELINE",
    "HISTOGRAM_SAMPLE",
    "HISTORY_KEYS",
    "NUMERIC_GRAD_STATS",
    "SATURATED_DERIVATIVE",
    "Alert",
    "GradTracer",
]


class _GradRow(NamedTuple):
    """One parameter at one step; `GradTracer.history` hands these out as dicts."""

    step: int
    param: str
    numel: int
    frozen: bool
    missing: bool
    accumulations: int
    norm: float | None = None
    mean: float | None = None
    std: float | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    zero_frac: float | None = None
    nonfinite: int | None = None
    update_ratio: float | None = None
    hist_counts: list[int] | None = None
    hist_lo: float | None = None
    hist_hi: float | None = None
    hist_sample: int | None = None


class _FullStats(NamedTuple):
    """What a full-statistics step adds to a `_GradRow`; all ``None`` on a cheap step."""

    max_abs: float | None = None
    mean_abs: float | None = None
    zero_frac: float | None = None
    nonfinite: int | None = None
    hist_counts: list[int] | None = None
    hist_lo: float | None = None
    hist_hi: float | None = None
    hist_sample: int | None = None


class _ActivationRow(NamedTuple):
    step: int
    module: str
    kind: str
    calls: int
    mean: float
    std: float
    saturated: float | None
    dead: float | None


# The keys of one `GradTracer.history()` record, in order, and of `activation_history()`.
HISTORY_KEYS = _GradRow._fields
ACTIVATION_KEYS = _ActivationRow._fields
# The per-step numbers of a record that `plot_grad_stat` can draw over steps: named, not sliced out
# of HISTORY_KEYS, so that a field added to _GradRow cannot shift what this holds.
NUMERIC_GRAD_STATS = (
    "norm", "mean", "std", "max_abs", "mean_abs", "zero_frac", "nonfinite", "update_ratio",
)  # fmt: skip
ALERT_KINDS = ("vanishing", "exploding", "nonfinite", "dead_units", "missing", "skipped_step")

# tanh' = 1 - y^2 and sigmoid' = y(1 - y); a unit is saturated when its derivative is under 2 % of
# the function's peak derivative (1 for tanh, 1/4 for sigmoid), i.e. almost no gradient passes.
SATURATED_DERIVATIVE = 0.02
# dot() and sum() in half precision overflow; these dtypes are reduced as they are.
_REDUCED_AS_IS = (torch.float32, torch.float64)
_FULL_SCALARS = 6  # non-finite count, zero count, sum |g|, max |g|, finite min, finite max
# A gradient larger than this many values gets its histogram from a fixed sample of this size:
# an exact torch.histc costs ~7 ns a value (31 ms on 4.3 M values, a whole training step), the
# sample's binning a few microseconds; the record says how many values the counts come from.
HISTOGRAM_SAMPLE = 16_384
_NO_FULL_STATS = _FullStats()
# Gradients of at most this many values are reduced together on a full-statistics step (`_Batched`):
# on them the cost is per-op dispatch (~10 us an op, a dozen ops a parameter), not memory passes;
# larger ones keep their own reductions, whose per-op cost their size hides.
_BATCHED_NUMEL = 2**17
# An exploding alert compares a norm with the median of the parameter's last finite norms, and
# waits until it has this many (or all `baseline_steps`, if fewer): the median of one or two norms
# is just those steps' own, often the large, noisy norms of the first steps after initialisation,
# while the median of five is unmoved by up to two outliers.
EXPLODE_MIN_BASELINE = 5

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


@dataclass(frozen=True)
class Alert:
    """A gradient failure seen at one step, as `GradTracer.alerts` returns it: ``kind`` is one of
    `ALERT_KINDS`, ``name`` the parameter (or module, for dead units), ``value`` the measured
    number and ``limit`` the threshold it crossed. ``str(alert)`` is the sentence to print."""

    kind: str
    step: int
    name: str
    value: float | None
    limit: float | None
    message: str

    def __str__(self) -> str:
        return self.message


class GradTracer:
    """Trace every parameter's gradient, step by step, with PyTorch's own hooks.

    Taught in ``08_gradient_health``. Use it as a context manager: hooks attach on enter and are
    all removed on exit, also when the traced code raises::

        with GradTracer(model, optimizer) as tracer:
            for x, y in batches:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()          # closes the step; without an optimizer: tracer.step()
        tracer.history()                  # one dict per parameter per step (`HISTORY_KEYS`)

    Every step records, per parameter, from two reductions over the gradient: ``norm``, ``mean``,
    ``std`` (sample std, like ``Tensor.std``) and ``nonfinite`` (counted only on a step that has a
    non-finite value, from the gradient tensor the hook saw); whether it is ``frozen``
    (``requires_grad=False``); whether it is ``missing`` a gradient (none reached it during the
    step: frozen, detached or unused); and how many backward passes accumulated into it.

    With ``full_every=N`` (0, the default, is never), steps 0, N, 2N... are full-statistics steps
    that also record
    ``max_abs``, ``mean_abs``, ``zero_frac`` (all exact) and a ``histogram_bins``-bin histogram of
    the finite values over their exact range [``hist_lo``, ``hist_hi``]; on other steps these are
    ``None``. The histogram counts every value of a gradient of at most ``histogram_sample``
    values (default `HISTOGRAM_SAMPLE` = 16,384) and, of a larger one, a fixed sample of that
    many positions, drawn once per parameter from ``histogram_seed`` (the same seed gives the same
    histogram); ``hist_sample`` says how many values the counts come from (``numel`` when exact;
    ``histogram_sample=None`` counts them all, at ~7 ns a value). Together these read every gradient
    about four more times and write its signs once. Gradients of at most 131,072 values (of one
    dtype and device) are copied into one buffer and reduced there together, the same numbers from
    a few ops over the buffer and two sums per parameter rather than a dozen ops per parameter;
    a larger CPU gradient is reduced 131,072 values at a time, so that those reads find each
    chunk in cache. ``activations=True`` adds forward hooks on the model's leaf modules
    (`activation_history`); ``update_ratio=True`` (needs the optimizer) records
    ``||p_after - p_before|| / ||p_before||`` per parameter, exactly, from one copy of the
    parameters kept across steps (a large CPU parameter copied and differenced chunk by chunk,
    each chunk's norm taken while it is in cache).

    Alerts (`alerts`): ``missing`` (a parameter that requires grad got none), ``nonfinite``,
    ``exploding`` (norm above ``explode_factor`` times the median of its last ``baseline_steps``
    finite norms; only once it has `EXPLODE_MIN_BASELINE` = 5 of them, or all ``baseline_steps``
    if fewer, so by default a parameter's first 5 finite norms raise none: the median of one or two
    norms is just the noisy first steps' own, a median of five ignores two outliers), ``vanishing``
    (root-mean-square gradient at most ``vanish_ratio`` times the step's largest) and
    ``dead_units`` (a ReLU module whose share of units that never fired in the step reaches
    ``dead_above``, units along ``unit_dim``; needs ``activations=True``), and, with an
    optimizer, ``skipped_step``: the step's gradients were zeroed
    (``zero_grad(set_to_none=True)``, the default) without ``optimizer.step()`` running, as when
    ``GradScaler`` skips a step on inf/NaN gradients; the step is recorded and closed when the
    next forward or backward starts. (With ``set_to_none=False`` the tensors are zeroed in place
    and a skipped step is not detected.) ``skipped_step`` is taught in ``10_mixed_precision``.

    The history keeps the last ``max_steps`` steps (``None``: all); alerts are kept for the steps
    the history keeps.

    Faults: a backward pass that raises midway counts for nothing (``accumulations`` counts the
    backward passes that finished; zero the gradients before retrying, as its partial gradients
    stay in ``.grad``). The optimizer must update at least one of the model's parameters (one that
    updates only some, such as the trainable ones, is fine: each of its steps closes a step).
    Parameters replaced while attached (``load_state_dict(..., assign=True)``, ``.to()`` across
    devices, conversions under ``torch.__future__.set_swap_module_params_on_conversion(True)``) are
    noticed before the next forward pass and traced from then on; a move to the meta device, a
    different set of parameters, or an optimizer still holding the old ones is a `LabkitError`.
    The hooks hold the tracer weakly: a tracer entered and never exited is removed, hooks and all,
    once nothing refers to it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        full_every: int = 0,
        histogram_bins: int = 32,
        histogram_sample: int | None = HISTOGRAM_SAMPLE,
        histogram_seed: int = 0,
        activations: bool = False,
        update_ratio: bool = False,
        max_steps: int | None = 10_000,
        vanish_ratio: float = 1e-3,
        explode_factor: float = 10.0,
        baseline_steps: int = 20,
        dead_above: float = 0.5,
        unit_dim: int = 1,
    ) -> None:
        _check_tracer_options(
            model, optimizer, full_every, histogram_bins, update_ratio, max_steps, baseline_steps
        )
        _check_histogram_sample(histogram_sample, histogram_seed)
        _check_thresholds(activations, update_ratio, vanish_ratio, explode_factor, dead_above, unit_dim)
        if unit_dim == 0:
            raise LabkitError(
                "unit_dim=0 is the batch: a unit is dead when it is 0 for every sample, so name the "
                "units' dimension (1 for (batch, features) and convolutions, -1 for (batch, time, features))"
            )
        named = [(name, p) for name, p in model.named_parameters() if p.numel() > 0]
        if not named:
            raise LabkitError(
                f"{type(model).__name__} has no parameters, so there is no gradient to trace: "
                "pass the nn.Module that owns the parameters you train"
            )
        if optimizer is not None:
            _check_optimizer_owns_some(optimizer, model, [p for _, p in named])
        self.model = model
        self.optimizer = optimizer
        self.names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._full_every = full_every
        self._bins = histogram_bins
        self._sample_size = histogram_sample
        self._sample_seed = histogram_seed
        # Per parameter, the positions its histogram samples (None: all), drawn on first use.
        self._sample_positions: dict[int, torch.Tensor | None] = {}
        # One |g| buffer per (dtype, device), as long as the largest gradient: full steps reuse it.
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._trace_activations = activations
        self._trace_updates = update_ratio
        self._vanish_ratio = vanish_ratio
        self._explode_factor = explode_factor
        self._dead_above = dead_above
        self._unit_dim = unit_dim
        self._steps: deque[list[_GradRow]] = deque(maxlen=max_steps)
        self._activation_steps: deque[list[_ActivationRow]] = deque(maxlen=max_steps)
        self._alerts: deque[Alert] = deque()
        self._baselines = [deque(maxlen=baseline_steps) for _ in self._params]
        self._step = 0
        self._attached = False
        self._grad_handles: list[Any] = []
        self._other_handles: list[Any] = []
        self._traced_ids: set[int] = set()
        self._finalizer: weakref.finalize | None = None
        # Which C++ tensor each traced parameter was when hooked (a swap replaces it in place).
        self._identities: list[int] = []
        # The module and attribute name that hold each traced parameter.
        self._owners = [_owner(model, name) for name in self.names]
        # Each backward pass's gradients (by graph task), until that backward finishes: a backward
        # that raises midway never counts (its callback never runs), and is dropped at step close.
        self._backwards: dict[int, dict[int, tuple]] = {}
        self._activation_modules: list[tuple[str, nn.Module]] = []
        self._params_before: _ParameterCopy | None = None
        self._norms_before: torch.Tensor | None = None
        self._batched: _Batched | None = None
        self._reset_pending()

    # ----------------------------------------------------------------- attach / detach

    def __enter__(self) -> GradTracer:
        if self._attached:
            raise LabkitError("this GradTracer is already attached: enter it once, with one `with`")
        ids = {id(p) for p in self._params}
        _refuse_traced(ids, self.model)
        _TRACED_PARAMS.update(ids)
        self._attached = True
        self._traced_ids = ids
        self._grad_handles = [None] * len(self._params)
        self._other_handles = []
        # A tracer entered and never exited is collected (its hooks hold it weakly); this removes
        # its hooks then. __exit__ runs it at once.
        self._finalizer = weakref.finalize(
            self, _release_hooks, self._grad_handles, self._other_handles, self._traced_ids
        )
        self._identities = [tensor_identity(p) for p in self._params]
        self._batched = self._build_batched()
        self._hook_parameters_needing_grad()
        # Before each forward pass: are the model's parameters still the ones hooked?
        self._other_handles.append(
            self.model.register_forward_pre_hook(_WeakHook(self._before_forward))
        )
        if self._trace_activations:
            self._hook_activations()
        if self.optimizer is not None:
            self._hook_optimizer(self.optimizer)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._params_before = None
        self._batched = None
        self._scratch.clear()
        self._attached = False
        self._backwards.clear()
        self._reset_pending()

    def _hook_parameters_needing_grad(self) -> None:
        # Re-run at every step boundary so that a parameter unfrozen mid-run gets its hook.
        for index, param in enumerate(self._params):
            if param.requires_grad and self._grad_handles[index] is None:
                hook = _WeakHook(self._on_gradient, index)
                self._grad_handles[index] = param.register_post_accumulate_grad_hook(hook)

    def _parameters_replaced(self) -> bool:
        # load_state_dict(..., assign=True) and .to() across device types put new Parameter objects
        # in the model; a conversion with swap_tensors keeps the object but swaps the tensor behind
        # it. Either way the hooks on the old ones never run again.
        # Runs before every forward pass: one dict look-up per parameter, no module walk (and not
        # Module.__getattr__, which costs several times more).
        return any(
            owner._parameters.get(key) is not param or tensor_identity(param) != identity
            for (owner, key), param, identity in zip(self._owners, self._params, self._identities)
        )

    def _reattach(self) -> None:
        """Move the gradient hooks to the model's current parameters (see `_parameters_replaced`)."""
        named = [(name, p) for name, p in self.model.named_parameters() if p.numel() > 0]
        what = (
            "the model's parameters were replaced while the tracer was attached "
            "(load_state_dict(..., assign=True), .to(), or a conversion that swaps tensors)"
        )
        if [name for name, _ in named] != self.names:
            raise LabkitError(
                f"{what} and are no longer the same set ({len(named)} now, {len(self.names)} "
                "traced): exit this tracer and attach a new GradTracer to the new model"
            )
        params = [p for _, p in named]
        if any(p.device.type == "meta" for p in params):
            raise LabkitError(
                f"{what}, and they are on the meta device now: meta tensors hold no values, so "
                "there is no gradient to trace; exit the tracer before moving the model to meta"
            )
        if self.optimizer is not None:
            _check_optimizer_owns_some(self.optimizer, self.model, params, replaced=True)
        new_ids = {id(p) for p in params} - self._traced_ids
        _refuse_traced(new_ids, self.model)
        for handle in self._grad_handles:
            if handle is not None:
                handle.remove()
        _TRACED_PARAMS.difference_update(self._traced_ids)
        self._traced_ids.clear()
        self._traced_ids.update(id(p) for p in params)
        _TRACED_PARAMS.update(self._traced_ids)
        for param in params:
            rearm_post_accumulate_grad_hooks(param)
        self._params = params
        self._owners = [_owner(self.model, name) for name in self.names]
        self._identities = [tensor_identity(p) for p in params]
        self._grad_handles[:] = [None] * len(params)
        self._batched = self._build_batched()
        self._hook_parameters_needing_grad()
        if self._trace_updates:
            self._params_before = _ParameterCopy(params)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._parameters_replaced():
            self._reattach()

    def _hook_activations(self) -> None:
        self._activation_modules = [
            (name, module)
            for name, module in self.model.named_modules()
            if next(module.children(), None) is None
        ]
        self._activation_pending = [None] * len(self._activation_modules)
        for index, (_, module) in enumerate(self._activation_modules):
            hook = _WeakHook(self._on_activation, index)
            self._other_handles.append(module.register_forward_hook(hook))

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._trace_updates:
            self._params_before = _ParameterCopy(self._params)
            pre_hook = _WeakHook(self._before_update)
            self._other_handles.append(optimizer.register_step_pre_hook(pre_hook))
        self._other_handles.append(optimizer.register_step_post_hook(_WeakHook(self._after_update)))

    # ----------------------------------------------------------------- hooks (hot path)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        task = graph_task_id()
        staged = self._backwards.get(task)
        if staged is None:
            staged = self._begin_backward(task)
        grad = param.grad
        seen = grad.detach() if grad.requires_grad else grad  # create_graph=True: off its graph
        if seen.is_sparse:
            seen = seen.to_dense()
        flat = _flat_for_reduction(seen)
        if self._full_step and not (self._batched is not None and index in self._batched.slots):
            summary = self._full_summary(index, flat)
        else:
            summary = _sums(flat)
        staged[index] = (grad, seen, summary)
        if task < 0:  # not inside the autograd engine's backward: nothing to wait for
            self._commit(staged)

    def _full_summary(self, index: int, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sum of squares, the sum, the `_FULL_SCALARS` (with the histogram when it is exact)
        and the histogram's sample (when it is not)."""
        if self._sample_size is None:
            return (*_sums(flat), _exact_full_summary(flat, self._bins))
        positions = self._histogram_positions(index, flat)
        sample = flat.clone() if positions is None else flat.index_select(0, positions)
        return (*_fast_full_scalars(flat, self._scratch_for(flat)), sample)

    def _build_batched(self) -> _Batched | None:
        """The small gradients that full-statistics steps reduce together (the sampled histogram
        mode only): those of at most `_BATCHED_NUMEL` values of the first such parameter's dtype and
        device; None when fewer than two qualify."""
        if self._full_every == 0 or self._sample_size is None:
            return None
        small = [(k, p) for k, p in enumerate(self._params)
                 if p.numel() <= _BATCHED_NUMEL and p.dtype in _REDUCED_AS_IS and not p.is_sparse]  # fmt: skip
        if not small:
            return None
        kind = (small[0][1].dtype, small[0][1].device)
        chosen = [(k, p) for k, p in small if (p.dtype, p.device) == kind]
        if len(chosen) < 2:
            return None
        positions = [self._histogram_positions(k, p.detach().reshape(-1)) for k, p in chosen]
        return _Batched(chosen, positions)

    def _histogram_positions(self, index: int, flat: torch.Tensor) -> torch.Tensor | None:
        """The fixed positions of ``flat`` that parameter ``index``'s histogram counts, or None
        for all of them; drawn once (per size) from the seed, so every step samples the same ones."""
        key = (index, flat.numel(), flat.device)
        if key not in self._sample_positions:
            positions = None
            if self._sample_size is not None and flat.numel() > self._sample_size:
                generator = torch.Generator().manual_seed(self._sample_seed + index)
                drawn = torch.randint(flat.numel(), (self._sample_size,), generator=generator)
                positions = drawn.sort().values.to(flat.device)  # sorted: reads memory in order
            self._sample_positions[key] = positions
        return self._sample_positions[key]

    def _hist_sample(self, numel: int) -> int:
        if self._sample_size is None or numel <= self._sample_size:
            return numel
        return self._sample_size

    def _scratch_for(self, flat: torch.Tensor) -> torch.Tensor:
        """A buffer for one chunk's signs (`_fast_full_scalars`), one per (dtype, device), reused
        by every chunk of every gradient: on the CPU it stays in cache."""
        key = (flat.dtype, flat.device)
        length = _chunk_length(flat)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < length:
            scratch = self._scratch[key] = torch.empty(length, dtype=flat.dtype, device=flat.device)
        return scratch[:length]

    def _begin_backward(self, task: int) -> dict[int, tuple]:
        # The first gradient of a backward pass; the step's gradients may have been thrown away
        # since the last one (a skipped step).
        if self._step_was_abandoned():
            self._close_step(None, skipped=True)
        staged: dict[int, tuple] = {}
        if task >= 0:
            self._backwards[task] = staged
            queue_backward_callback(_WeakHook(self._finish_backward, task))
        return staged

    def _finish_backward(self, task: int) -> None:
        # Runs only when the backward pass finished without raising.
        staged = self._backwards.pop(task, None)
        if staged:
            self._commit(staged)

    def _commit(self, staged: dict[int, tuple]) -> None:
        for index, (grad, seen, summary) in staged.items():
            self._accumulations[index] += 1
            if self._first_grad is None:
                self._first_grad = (self._params[index], grad)
            self._pending[index] = summary
            self._grads_seen[index] = seen
        if self._full_step and self._batched is not None:
            # Here, not in the hook: a backward that raises midway must not overwrite the buffer.
            self._batched.store(staged)

    def _step_was_abandoned(self) -> bool:
        # The step's .grad tensor is gone or replaced although optimizer.step() has not closed the
        # step: zero_grad(set_to_none=True) ran without an update (GradScaler skips the update on
        # inf/NaN gradients). Micro-batches accumulate into the same tensor; create_graph=True
        # replaces it, so a replacement that requires grad does not count.
        if self.optimizer is None or self._first_grad is None:
            return False
        param, seen = self._first_grad  # one parameter's .grad stands for all: O(1) in the hooks
        grad = param.grad
        return grad is not seen and (grad is None or not grad.requires_grad)

    def _on_activation(self, index: int, module: nn.Module, inputs: Any, output: Any) -> None:
        # Only forward passes that build a graph feed a gradient; evaluation under no_grad does not.
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or output.numel() == 0:
            return
        if self._step_was_abandoned():
            self._close_step(None, skipped=True)
        if isinstance(module, nn.ReLU) and not -output.dim() <= self._unit_dim < output.dim():
            raise LabkitError(
                f"unit_dim={self._unit_dim} does not exist in the {tuple(output.shape)} output of "
                f"ReLU '{self._activation_modules[index][0]}': pass GradTracer(..., unit_dim=...) "
                "naming the units' dimension"
            )
        sums, alive = _activation_summary(output.detach(), module, self._unit_dim)
        pending = self._activation_pending[index]
        if pending is None:
            self._activation_pending[index] = [1, output.numel(), sums, alive]
            return
        pending[0] += 1
        pending[1] += output.numel()
        pending[2] = pending[2] + sums
        if alive is not None:
            pending[3] = pending[3] | alive

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._norms_before = self._params_before.take(self._params)

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        update = None
        if self._trace_updates:
            update = torch.cat((self._params_before.difference_norms(self._params), self._norms_before))
        self._close_step(update)

    # ----------------------------------------------------------------- step boundary

    def step(self) -> None:
        """Close the current step (one optimizer step). Only without an optimizer: a tracer
        given the optimizer closes steps itself when ``optimizer.step()`` runs."""
        if not self._attached:
            raise LabkitError(
                "the tracer is not attached: call step() inside `with GradTracer(model) as tracer:`"
            )
        if self.optimizer is not None:
            raise LabkitError(
                "this tracer closes a step when optimizer.step() runs; calling tracer.step() too "
                "would count every step twice: drop the tracer.step() call"
            )
        self._close_step(None)

    @property
    def steps(self) -> int:
        """How many steps the tracer has closed."""
        return self._step

    def _reset_pending(self) -> None:
        count = len(self._params)
        self._pending: list[tuple[torch.Tensor, ...] | None] = [None] * count
        self._grads_seen: list[torch.Tensor | None] = [None] * count
        # The first parameter to get a gradient this step, and the .grad tensor it got.
        self._first_grad: tuple[torch.Tensor, torch.Tensor] | None = None
        self._accumulations = [0] * count
        self._activation_pending = [None] * len(self._activation_modules)
        self._full_step = self._full_every > 0 and self._step % self._full_every == 0

    def _close_step(self, update: torch.Tensor | None, skipped: bool = False) -> None:
        self._backwards.clear()  # backward passes that raised: their gradients never count
        if self._parameters_replaced():
            # Replaced after this step's forward pass (the forward pre-hook re-attaches before it):
            # the step's gradients went to parameters the tracer did not hook.
            step = self._step
            self._reattach()
            self._reset_pending()
            raise LabkitError(
                f"step {step}: the model's parameters were replaced during the step, after its "
                "forward pass, so its gradients reached parameters the tracer was not hooked to: "
                "the step is not recorded; the tracer follows the new parameters from the next step "
                "(replace parameters between steps, before the forward pass)"
            )
        activations = [(k, p) for k, p in enumerate(self._activation_pending) if p is not None]
        summaries = [s for s in self._pending if s is not None]
        batched = [] if self._batched is None or not self._full_step else [
            k for k in self._batched.slots if self._pending[k] is not None
        ]  # fmt: skip
        block = self._batched.full_block(batched, self._bins) if batched else None
        on_device = _step_tensors(summaries, [p for _, p in activations], update, self._bins, block)
        # The one synchronisation of the step: everything the hooks left on the device, at once.
        values = iter(torch.cat(on_device).tolist() if on_device else ())
        cheap = iter([(next(values), next(values)) for _ in summaries])
        full = self._full_values(values, batched)
        rows = [self._gradient_row(index, cheap, full) for index in range(len(self._params))]
        activation_rows = [self._activation_row(k, pending, values) for k, pending in activations]
        if update is not None:
            rows = _with_update_ratios(rows, values)
        self._record(rows, activation_rows)
        if skipped:
            self._alerts.append(_skipped_step_alert(self._step))
        self._step += 1
        self._reset_pending()
        self._hook_parameters_needing_grad()

    def _full_values(self, values: Iterator[float], batched: list[int]) -> dict[int, Iterator[float]]:
        """Each full-statistics row's numbers, by parameter: the per-tensor ones first, in parameter
        order, then the batched ones (`_step_tensors`' layout)."""
        if not self._full_step:
            return {}
        width = _FULL_SCALARS + self._bins
        taken = set(batched)
        order = [k for k, s in enumerate(self._pending) if s is not None and k not in taken] + batched
        return {k: iter([next(values) for _ in range(width)]) for k in order}

    def _gradient_row(
        self, index: int, cheap: Iterator[tuple[float, float]], full_values: dict[int, Iterator[float]]
    ) -> _GradRow:
        param, step, name = self._params[index], self._step, self.names[index]
        numel, frozen = param.numel(), not param.requires_grad
        if self._pending[index] is None:
            return _GradRow(step, name, numel, frozen, True, 0)
        total_sq, total = next(cheap)
        full = _NO_FULL_STATS
        if self._full_step:
            sample = self._hist_sample(numel)
            full = _read_full_stats(full_values[index], numel, self._bins, sample)
            if self._sample_size is not None and not math.isfinite(total_sq):
                full = self._nonfinite_full_stats(index, sample)
        nonfinite = full.nonfinite
        if nonfinite is None:
            # The sum of squares is non-finite exactly when a value is (or when it overflows).
            nonfinite = 0 if math.isfinite(total_sq) else _count_nonfinite(self._grads_seen[index])
        return _GradRow(
            step, name, numel, frozen, False, self._accumulations[index],
            math.sqrt(total_sq), total / numel, _sample_std(total_sq, total, numel),
            full.max_abs, full.mean_abs, full.zero_frac, nonfinite, None,
            full.hist_counts, full.hist_lo, full.hist_hi, full.hist_sample,
        )  # fmt: skip

    def _nonfinite_full_stats(self, index: int, sample: int) -> _FullStats:
        # The sampled path assumed finite values; a non-finite sum of squares says otherwise, so
        # this step's full statistics are taken again, exactly, from the gradient the hook saw
        # (a second synchronisation, only on such a step).
        flat = _flat_for_reduction(self._grads_seen[index])
        positions = self._histogram_positions(index, flat)
        values = iter(_nonfinite_full_summary(flat, positions, self._bins).tolist())
        return _read_full_stats(values, flat.numel(), self._bins, sample)

    def _activation_row(self, index: int, pending: list, values: Iterator[float]) -> _ActivationRow:
        # `_activation_summary`'s layout: the sums, a saturated count (tanh, sigmoid), then a
        # live-unit count (ReLU)
        calls, count, _, alive = pending
        total, total_sq = next(values), next(values)
        name, module = self._activation_modules[index]
        saturating = isinstance(module, (nn.Tanh, nn.Sigmoid))
        saturated = next(values) / count if saturating else None
        dead = None if alive is None else 1.0 - next(values) / alive.numel()
        return _ActivationRow(
            self._step, name, type(module).__name__, calls, total / count,
            _sample_std(total_sq, total, count), saturated, dead,
        )  # fmt: skip

    def _record(self, rows: list[_GradRow], activation_rows: list[_ActivationRow]) -> None:
        self._steps.append(rows)
        if activation_rows:
            self._activation_steps.append(activation_rows)
        self._alerts.extend(self._gradient_alerts(rows))
        self._alerts.extend(_dead_unit_alerts(activation_rows, self._dead_above))
        oldest_kept = self._steps[0][0].step
        while self._alerts and self._alerts[0].step < oldest_kept:
            self._alerts.popleft()

    def _gradient_alerts(self, rows: list[_GradRow]) -> list[Alert]:
        received = [row for row in rows if not row.missing and math.isfinite(row.norm)]
        largest_rms = max((_rms(row) for row in received), default=0.0)
        alerts = []
        for row, baseline in zip(rows, self._baselines):
            alert = _row_alert(row, baseline, largest_rms, self._vanish_ratio, self._explode_factor)
            if alert is not None:
                alerts.append(alert)
            if not row.missing and math.isfinite(row.norm):
                baseline.append(row.norm)
        return alerts

    # ----------------------------------------------------------------- reading

    def history(self) -> list[dict]:
        """One plain dict per parameter per step, keys `HISTORY_KEYS` (``08_gradient_health``)."""
        self._require_steps()
        return [row._asdict() for rows in self._steps for row in rows]

    def activation_history(self) -> list[dict]:
        """One dict per leaf module per step (keys `ACTIVATION_KEYS`; needs ``activations=True``).

        ``mean``/``std`` over every output value of the step's forward passes that built a graph;
        ``saturated`` (tanh, sigmoid modules): share of outputs whose derivative is under 2 % of its
        peak; ``dead`` (ReLU modules): share of units (dimension ``unit_dim``, default 1: the
        features of a (batch, features) output, the channels of a convolution's) that were 0 for
        every sample of the step; pass ``unit_dim=-1`` for (batch, time, features) outputs.
        Taught in ``08_gradient_health``."""
        if not self._trace_activations:
            raise LabkitError("activation statistics are off: use GradTracer(model, activations=True)")
        self._require_steps()
        return [row._asdict() for rows in self._activation_steps for row in rows]

    def frame(self) -> Any:
        """`history` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame.from_records(self.history(), columns=list(HISTORY_KEYS))

    def alerts(self, kind: str | None = None) -> list[Alert]:
        """The alerts of the steps the history keeps, oldest first; ``kind`` filters them."""
        if kind is not None and kind not in ALERT_KINDS:
            raise LabkitError(f"unknown alert kind {kind!r}: use one of {', '.join(ALERT_KINDS)}")
        self._require_steps()
        return [a for a in self._alerts if kind is None or a.kind == kind]

    def _require_steps(self) -> None:
        if self._steps:
            return
        if any(self._accumulations):
            raise LabkitError(
                "backward ran but no step was closed yet: pass the optimizer, "
                "GradTracer(model, optimizer), or call tracer.step() after each optimizer step"
            )
        raise LabkitError(
            "no gradient statistics yet: run a backward pass and close the step "
            "(optimizer.step() with GradTracer(model, optimizer), or tracer.step()) before reading"
        )


# --------------------------------------------------------------------- tracer helpers


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_path, _, key = name.rpartition(".")
    return model.get_submodule(module_path), key


def _refuse_traced(ids: set[int], model: nn.Module) -> None:
    if ids & _TRACED_PARAMS:
        raise LabkitError(
            f"{type(model).__name__} already has a GradTracer attached to its parameters: "
            "exit that tracer's `with` block first (two tracers would run every hook twice)"
        )


def _flat_for_reduction(grad: torch.Tensor) -> torch.Tensor:
    """The gradient as one row, in a dtype whose sums do not overflow. The every-step mode's
    statistics are two reductions of it, ``dot(g, g)`` and ``sum(g)``, one pass each."""
    flat = grad.reshape(-1)
    return flat if flat.dtype in _REDUCED_AS_IS else flat.float()


def _sums(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g . g`` and ``sum g``, the every-step statistics. A CPU gradient longer than `_CHUNK` is
    reduced chunk by chunk, so that the sum finds each chunk in cache, the chunks' numbers combined
    in float64, as `_fast_full_scalars` combines them: a step's norm is the same whether or not it
    is a full-statistics step."""
    chunk = _chunk_length(flat)
    if flat.numel() == chunk:
        return torch.dot(flat, flat), flat.sum()
    parts = []
    for values in flat.split(chunk):
        parts += (torch.dot(values, values), values.sum())
    total_sq, total = torch.stack(parts).double().view(-1, 2).sum(0).unbind()
    return total_sq, total


def _scalars_with_nonfinite(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `_FULL_SCALARS` of a gradient that may hold NaN or inf, with its finite mask and its
    values with the non-finite ones zeroed (histc refuses a non-finite range, so non-finite values
    are counted, then left out of the histogram)."""
    finite = torch.isfinite(flat)
    clean = torch.where(finite, flat, 0.0)
    low, high = torch.aminmax(clean)
    magnitudes = flat.abs()
    scalars = torch.stack((
        finite.logical_not().sum(), (flat == 0).sum(), magnitudes.sum(), magnitudes.amax(), low, high,
    )).double()  # fmt: skip
    return scalars, finite, clean


def _exact_full_summary(flat: torch.Tensor, bins: int) -> torch.Tensor:
    """The `_FULL_SCALARS` and a histogram of every finite value, on the device."""
    scalars, _, clean = _scalars_with_nonfinite(flat)
    return torch.cat((scalars, torch.histc(clean, bins).double()))


# Full statistics read a large gradient six times (g . g, sum, min and max, signs, two products).
# On the CPU they run chunk by chunk: a chunk this size and its signs (1 MiB in float32) stay in a
# core's L2 cache between those reads, where the whole gradient is read back from L3 or memory
# each time.
_CHUNK = 2**17
# A chunk's non-zero count is a float32 sum of ones, exact up to this many.
_EXACT_FLOAT_COUNT = 2**24


def _chunk_length(flat: torch.Tensor) -> int:
    """How many values of ``flat`` `_fast_full_scalars` reduces at a time: `_CHUNK` on the CPU;
    elsewhere as many as a float32 count holds exactly (on a GPU each op is a kernel launch, which
    costs more than a pass)."""
    limit = _CHUNK if flat.device.type == "cpu" else _EXACT_FLOAT_COUNT
    return min(flat.numel(), limit)


def _fast_full_scalars(flat: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The sum of squares, the sum and the `_FULL_SCALARS`, exact, of a gradient assumed finite:
    step close checks that from the sum of squares and takes a non-finite one again
    (`_nonfinite_full_summary`). Per chunk (`_CHUNK`): g . g and sum g, min and max together
    (max |g| is max(-min, max)), then the signs of g into ``scratch``: sign(g) . g is sum |g| and
    sign(g) . sign(g) the non-zero count, as two dot products: one pass that writes (the signs),
    where |g| and then its signs take two. The chunks' numbers are combined in float64."""
    parts = []
    for values in flat.split(scratch.numel()):
        signs = scratch[: values.numel()]
        total_sq, total = torch.dot(values, values), values.sum()
        low, high = torch.aminmax(values)
        torch.sign(values, out=signs)
        parts += (total_sq, total, low, high, torch.dot(signs, values), torch.dot(signs, signs))
    combined = torch.stack(parts).double().view(-1, 6)  # one row per chunk
    total_sq, total, abs_total, nonzero = combined[:, [0, 1, 4, 5]].sum(0).unbind()
    low, high = combined[:, 2].amin(), combined[:, 3].amax()
    scalars = torch.stack(
        # max(-min, max) >= 0 always; abs() turns the -0.0 of an all-zero gradient into 0.0
        (low.new_zeros(()), flat.numel() - nonzero, abs_total, torch.maximum(-low, high).abs(), low, high)
    )
    return total_sq, total, scalars


def _nonfinite_full_summary(flat: torch.Tensor, positions: torch.Tensor | None, bins: int) -> torch.Tensor:
    """`_exact_full_summary`'s numbers, with the histogram of the finite values at ``positions``."""
    scalars, finite, clean = _scalars_with_nonfinite(flat)
    if positions is not None:
        clean, finite = clean.index_select(0, positions), finite.index_select(0, positions)
    # Binned in float64: this path also takes finite gradients whose sum of squares overflowed,
    # where (value - low) * bins can overflow float32 (a range of 1e37 times 32 bins) and every
    # value would land in bin 0. Elsewhere |g| < 2**64, so the values' own dtype cannot overflow.
    counts = _binned([clean.double()], scalars[4:5], scalars[5:6], bins, keep=finite)
    return torch.cat((scalars, counts.reshape(-1)))


def _binned(
    samples: list[torch.Tensor], lows: torch.Tensor, highs: torch.Tensor, bins: int,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch.histc's counts of each sample over its [low, high] (device tensors, so nothing is read
    back), all samples in one bincount: histc's bin arithmetic, the top edge in the last bin, an
    empty range widened by 1 each side; values where ``keep`` is False are not counted. Returns
    one row of ``bins`` counts per sample."""
    lengths = torch.tensor([sample.numel() for sample in samples], device=lows.device)
    row = torch.repeat_interleave(torch.arange(len(samples), device=lows.device), lengths)
    return _binned_rows(torch.cat(samples), row, len(samples), lows, highs, bins, keep)


def _binned_rows(
    values: torch.Tensor, row: torch.Tensor, count: int, lows: torch.Tensor, highs: torch.Tensor,
    bins: int, keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """`_binned` of ``count`` samples laid end to end in ``values``, ``row`` saying whose each is."""
    # histc's own arithmetic, (value - low) * bins / (high - low) in the values' dtype, so the
    # counts are histc's also for a value on a bin edge; the range's ends are values of that dtype
    lows, highs = lows.to(values.dtype), highs.to(values.dtype)
    empty = highs <= lows
    lows, highs = torch.where(empty, lows - 1, lows), torch.where(empty, highs + 1, highs)
    spans = highs - lows  # per sample, then gathered: one gather fewer over every value
    # index_select, not lows[row]: the same gather without advanced indexing's overhead
    position = values.sub(lows.index_select(0, row)).mul_(bins).div_(spans.index_select(0, row))
    position = position.long().clamp_(0, bins - 1)
    position += row * bins
    if keep is not None:
        position = torch.where(keep, position, count * bins)  # past the end, then dropped
    # bincount without weights: deterministic on CUDA too (histc is not)
    counts = torch.bincount(position, minlength=count * bins + 1)[: count * bins]
    return counts.reshape(count, bins).double()


def _step_tensors(
    summaries: list[tuple[torch.Tensor, ...]], activations: list[list], update: torch.Tensor | None,
    bins: int, batched_block: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The step's device tensors in reading order: every (sum of squares, sum) pair, stacked once
    rather than once per hook call; full statistics (the sampled histograms binned all at once),
    the per-tensor ones then the batched ones (`_Batched.full_block`); activation sums; update
    norms."""
    tensors = [torch.stack([t for s in summaries for t in s[:2]])] if summaries else []
    tensors += [s[2] for s in summaries if len(s) == 3]
    sampled = [s for s in summaries if len(s) == 4]
    if sampled:
        scalars = torch.stack([s[2] for s in sampled])
        counts = _binned([s[3] for s in sampled], scalars[:, 4], scalars[:, 5], bins)
        tensors.append(torch.cat((scalars, counts), dim=1).reshape(-1))
    if batched_block is not None:
        tensors.append(batched_block)
    for _, _, sums, alive in activations:
        tensors.append(sums)
        if alive is not None:
            tensors.append(alive.sum(0, keepdim=True))
    if update is not None:
        tensors.append(update)
    return tensors


class _Batched:
    """The small gradients of a full-statistics step, copied end to end into one buffer as each
    backward finishes, and reduced there together at step close: one |g| and one sign over the
    whole buffer, two sums per segment, one gather of every histogram sample and one binning,
    instead of a dozen ops per parameter. The numbers are the per-tensor path's
    (`_fast_full_scalars`, the same sampled positions); like it, it assumes finite values, and
    step close takes a non-finite gradient again exactly."""

    def __init__(self, chosen: list[tuple[int, torch.Tensor]], positions: list[torch.Tensor | None]) -> None:
        first = chosen[0][1]
        numels = [p.numel() for _, p in chosen]
        # zeros, not empty: the segments of parameters without a gradient this step are reduced too
        # (then dropped), and uninitialised memory may hold NaN
        self.buffer = torch.zeros(sum(numels), dtype=first.dtype, device=first.device)
        self.segments = list(self.buffer.split(numels))
        self.slots = {k: slot for slot, (k, _) in enumerate(chosen)}
        device = first.device
        self.sizes = numels
        self.numels = torch.tensor(numels, device=device, dtype=torch.float64)
        offsets = [0]
        for numel in numels[:-1]:
            offsets.append(offsets[-1] + numel)
        taken = [
            torch.arange(numel, device=device) if where is None else where
            for numel, where in zip(numels, positions)
        ]  # fmt: skip
        self.positions = torch.cat([where + offset for where, offset in zip(taken, offsets)])
        sizes = torch.tensor([len(where) for where in taken], device=device)
        self.rows = torch.repeat_interleave(torch.arange(len(chosen), device=device), sizes)
        # each segment's (min, max), from `store`; zeros for a parameter without a gradient yet
        self.extremes = [self.buffer.new_zeros(2) for _ in chosen]

    def store(self, staged: dict[int, tuple]) -> None:
        pairs = [(self.slots[k], seen.reshape(-1)) for k, (_, seen, _) in staged.items() if k in self.slots]
        if pairs:
            foreach_copy_([self.segments[slot] for slot, _ in pairs], [flat for _, flat in pairs])
        # min and max one gradient at a time: torch's segment min/max on the CPU is a scalar
        # loop, several times slower than an aminmax per gradient
        for slot, flat in pairs:
            self.extremes[slot] = torch.stack(torch.aminmax(flat))

    def full_block(self, present: list[int], bins: int) -> torch.Tensor:
        """`_FULL_SCALARS` and histogram counts of the ``present`` parameters, one row each, flat."""
        # a sum per segment, not torch's segment_reduce, which is slower on the CPU
        magnitudes = self.buffer.abs()
        abs_total = torch.stack([segment.sum() for segment in magnitudes.split(self.sizes)])
        # sign(|g|) is 1 where g != 0, already a float to sum (exact: a segment has at most
        # _BATCHED_NUMEL values, far below float32's 2**24): one op, not a compare and a cast
        nonzero = torch.stack([segment.sum() for segment in magnitudes.sign_().split(self.sizes)])
        low, high = torch.stack(self.extremes).unbind(1)
        sampled = self.buffer.index_select(0, self.positions)
        counts = _binned_rows(sampled, self.rows, len(self.segments), low, high, bins)
        scalars = torch.stack((
            # max(-min, max) >= 0 always; abs() turns the -0.0 of an all-zero gradient into 0.0
            torch.zeros_like(low), self.numels - nonzero, abs_total, torch.maximum(-low, high).abs(),
            low, high,
        ), dim=1).double()  # fmt: skip
        block = torch.cat((scalars, counts), dim=1)
        if len(present) < len(self.segments):
            block = block[torch.tensor([self.slots[k] for k in present], device=block.device)]
        return block.reshape(-1)


class _ParameterCopy:
    """The parameters as they were before an optimizer step, in buffers kept across steps (a
    fresh copy would allocate, and page in, a second set of parameters every step), and the norms
    the update:data ratio needs, in float64: ``take`` copies the parameters and returns their
    norms, ``difference_norms`` the norms of (before - after). Parameters larger than `_CHUNK`
    values (float32/float64, on the CPU) go chunk by chunk, each chunk's norm taken while it is in
    cache, their differences written to one chunk-sized buffer that stays there (not back into
    the copy, which would write the whole copy to memory again); the others with foreach ops, their
    differences in place in the copy."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._build(params)

    def _build(self, params: list[torch.Tensor]) -> None:
        self.layout = _layout(params)
        self.chunked = [k for k, p in enumerate(params)
                        if p.device.type == "cpu" and p.numel() > _CHUNK and p.dtype in _REDUCED_AS_IS]  # fmt: skip
        chunked = set(self.chunked)
        self.whole = [k for k in range(len(params)) if k not in chunked]
        self.copies = [
            p.detach().new_empty(p.numel()) if k in chunked else p.detach().clone() for k, p in enumerate(params)
        ]  # fmt: skip
        self.differences = {params[k].dtype: params[k].new_empty(_CHUNK) for k in self.chunked}

    def take(self, params: list[torch.Tensor]) -> torch.Tensor:
        if _layout(params) != self.layout:
            # converted in place since the last step (model.double() keeps the Parameter objects
            # and changes their dtype): copies of the new kind, so the difference keeps its precision
            self._build(params)
        norms = self._whole_norms(params, foreach_copy_)
        with torch.no_grad():  # the parameters themselves, no per-step detach() of each
            for k in self.chunked:
                squares = [torch.dot(copy.copy_(part), copy) for copy, part in self._pieces(k, params)]
                norms[k] = torch.stack(squares).double().sum().sqrt()
        return torch.stack(norms)

    def difference_norms(self, params: list[torch.Tensor]) -> torch.Tensor:
        norms = self._whole_norms(params, foreach_sub_)
        with torch.no_grad():
            for k in self.chunked:
                difference = self.differences[params[k].dtype]
                squares = []
                for copy, part in self._pieces(k, params):
                    change = torch.sub(copy, part, out=difference[: copy.numel()])
                    squares.append(torch.dot(change, change))
                norms[k] = torch.stack(squares).double().sum().sqrt()
        return torch.stack(norms)

    def _whole_norms(self, params: list[torch.Tensor], foreach_op: Callable) -> list[torch.Tensor | None]:
        """Per parameter, in order: the norm of the unchunked ones' copies after ``foreach_op(copies,
        params)``; None for the chunked ones."""
        norms: list[torch.Tensor | None] = [None] * len(params)
        if self.whole:
            copies = [self.copies[k] for k in self.whole]
            with torch.no_grad():
                foreach_op(copies, [params[k] for k in self.whole])
            for k, norm in zip(self.whole, foreach_norm(copies)):
                norms[k] = norm.double()
        return norms

    def _pieces(self, k: int, params: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.copies[k].split(_CHUNK), params[k].reshape(-1).split(_CHUNK))


def _layout(params: list[torch.Tensor]) -> list[tuple]:
    return [(p.dtype, p.device, p.shape) for p in params]


def _read_full_stats(values: Iterator[float], numel: int, bins: int, sample: int) -> _FullStats:
    nonfinite, zeros, abs_total, max_abs, low, high = (next(values) for _ in range(_FULL_SCALARS))
    counts = [round(next(values)) for _ in range(bins)]
    if low == high:  # torch.histc widens an empty range by 1 each side
        low, high = low - 1.0, high + 1.0
    return _FullStats(max_abs, abs_total / numel, zeros / numel, int(nonfinite), counts, low, high, sample)


def _count_nonfinite(grad: torch.Tensor) -> int:
    # A second synchronisation, only on a step that has a non-finite value.
    return int(grad.numel() - torch.isfinite(grad).sum().item())


def _sample_std(total_sq: float, total: float, count: int) -> float:
    if count < 2 or not (math.isfinite(total_sq) and math.isfinite(total)):
        return math.nan
    return math.sqrt(max(total_sq - total * total / count, 0.0) / (count - 1))


def _activation_summary(
    output: torch.Tensor, module: nn.Module, unit_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Device-side sums of one forward output (sum, sum of squares and, for tanh and sigmoid, the
    saturated count) and, for ReLU, which units (``unit_dim``) fired (None for other modules).
    As few ops as that: on small models the cost is per op, once per module per forward."""
    values = output if output.dtype in _REDUCED_AS_IS else output.float()
    flat = values.reshape(-1)
    if isinstance(module, nn.ReLU):
        return _relu_summary(values, flat, unit_dim)
    parts = [flat.sum(), torch.dot(flat, flat)]
    if isinstance(module, nn.Tanh):
        parts.append(((1 - values * values) < SATURATED_DERIVATIVE).sum().to(flat.dtype))
    elif isinstance(module, nn.Sigmoid):
        parts.append(((values * (1 - values)) < SATURATED_DERIVATIVE / 4).sum().to(flat.dtype))
    return torch.stack(parts), None


def _relu_summary(
    values: torch.Tensor, flat: torch.Tensor, unit_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_activation_summary` of a ReLU's output, which is never negative: a unit fired when its
    sum is > 0, and the units' sums add up to the total, so one reduction gives both (a NaN sum
    is not > 0, as a NaN maximum is not)."""
    if values.dim() < 2:
        return torch.stack([flat.sum(), torch.dot(flat, flat)]), values.new_ones(1, dtype=torch.bool)
    others = [d for d in range(values.dim()) if d != unit_dim % values.dim()]
    unit_sums = values.sum(dim=others)
    return torch.stack([unit_sums.sum(), torch.dot(flat, flat)]), unit_sums.gt(0)


def _with_update_ratios(rows: list[_GradRow], values: Iterator[float]) -> list[_GradRow]:
    deltas = [next(values) for _ in rows]
    before = [next(values) for _ in rows]
    return [
        row._replace(update_ratio=delta / norm if norm > 0 else math.nan)
        for row, delta, norm in zip(rows, deltas, before)
    ]


def _median(values: Iterable[float]) -> float:
    # statistics.median costs several times more, and this runs per parameter per step.
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _rms(row: _GradRow) -> float:
    return row.norm / math.sqrt(row.numel)


def _row_alert(
    row: _GradRow, baseline: deque, largest_rms: float, vanish_ratio: float, explode_factor: float
) -> Alert | None:
    step, name = row.step, row.param
    if row.missing:
        if row.frozen:
            return None  # freezing is a decision; the record still says missing and frozen
        return Alert("missing", step, name, None, None,
                     f"step {step}: '{name}' requires grad but received no gradient this step "
                     "(detached from the loss, or not used in the forward pass)")  # fmt: skip
    if row.nonfinite:
        return Alert("nonfinite", step, name, float(row.nonfinite), 0.0,
                     f"step {step}: '{name}' has {row.nonfinite} non-finite gradient values "
                     f"of {row.numel}")  # fmt: skip
    if len(baseline) >= min(EXPLODE_MIN_BASELINE, baseline.maxlen):
        typical = _median(baseline)
        if typical > 0 and row.norm > explode_factor * typical:
            return Alert("exploding", step, name, row.norm, explode_factor * typical,
                         f"step {step}: '{name}' gradient norm {row.norm:.3g} is "
                         f"{row.norm / typical:.3g}x its rolling median {typical:.3g} "
                         f"(limit {explode_factor:g}x)")  # fmt: skip
    rms = _rms(row)
    if math.isfinite(rms) and rms <= vanish_ratio * largest_rms:
        return Alert("vanishing", step, name, rms, vanish_ratio * largest_rms,
                     f"step {step}: '{name}' rms gradient {rms:.3g} is at most {vanish_ratio:g} x "
                     f"the step's largest ({largest_rms:.3g})")  # fmt: skip
    return None


def _skipped_step_alert(step: int) -> Alert:
    return Alert("skipped_step", step, "(optimizer)", None, None,
                 f"step {step}: its gradients were zeroed for the next step without optimizer.step() "
                 "running (GradScaler skips it when it finds inf/NaN gradients): recorded, "
                 "no update applied")  # fmt: skip


def _dead_unit_alerts(rows: list[_ActivationRow], dead_above: float) -> list[Alert]:
    return [
        Alert("dead_units", row.step, row.module, row.dead, dead_above,
              f"step {row.step}: {row.dead:.0%} of the units of {row.kind} '{row.module}' never "
              f"fired (output 0 for every sample; limit {dead_above:.0%})")  # fmt: skip
        for row in rows
        if row.dead is not None and row.dead >= dead_above
    ]
