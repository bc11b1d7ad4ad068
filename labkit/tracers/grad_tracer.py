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
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from labkit._torch_compat import (
    graph_task_id,
    queue_backward_callback,
    tensor_identity,
)
from labkit.errors import LabkitError
from labkit.tracers._alerts import (
    ALERT_KINDS,
    EXPLODE_MIN_BASELINE,
    Alert,
    _dead_unit_alerts,
    _gradient_alerts,
    _skipped_step_alert,
)
from labkit.tracers._full_statistics import _FullStatistics
from labkit.tracers._hooks import (
    _TRACED_PARAMS,
    _owner,
    _refuse_traced,
    _release_hooks,
    _replacement_parameters,
    _unhook_and_register,
    _WeakHook,
)
from labkit.tracers._options import (
    _check_histogram_sample,
    _check_optimizer_owns_some,
    _check_thresholds,
    _check_tracer_options,
)
from labkit.tracers._reductions import (
    _FULL_SCALARS,
    SATURATED_DERIVATIVE,
    _activation_summary,
    _Batched,
    _count_nonfinite,
    _flat_for_reduction,
    _step_tensors,
    _sums,
)
from labkit.tracers._rows import (
    _NO_FULL_STATS,
    ACTIVATION_KEYS,
    HISTORY_KEYS,
    NUMERIC_GRAD_STATS,
    _activation_row,
    _ActivationRow,
    _add_compiled_activation,
    _GradRow,
    _sample_std,
)
from labkit.tracers._update_ratio import _ParameterCopy, _with_update_ratios

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


# A gradient larger than this many values gets its histogram from a fixed sample of this size:
# torch.histc alone costs ~4 ns of CPU time a value, and full mode with exact histograms ~17 ns a value
# more than with the sample (80 ms a step on the MLP benchmark; benchmarks/results/tracer_overhead.md), the
# sample's binning a few microseconds; the record says how many values the counts come from.
HISTOGRAM_SAMPLE = 16_384


class GradTracer:
    """Trace every parameter's gradient, step by step, with PyTorch's own hooks.

    Used in ``08_gradient_health``. Use it as a context manager: hooks attach on enter and are
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
    ``histogram_sample=None`` counts them all, at about 17 ns of CPU time a value more than the sample:
    the MLP of ``benchmarks/tracer_overhead.py``, ``benchmarks/results/tracer_overhead.md``). Together these read every gradient
    about four more times and write its signs once. Gradients of at most 131,072 values (of one
    dtype and device) are copied into one buffer and reduced there together, the same numbers from
    a few ops over the buffer and two sums per parameter rather than a dozen ops per parameter;
    a larger CPU gradient is reduced 131,072 values at a time, so that those reads find each
    chunk in cache. ``activations=True`` adds forward hooks on the model's leaf modules
    (`activation_history`); ``update_ratio=True`` (needs the optimizer) records
    ``||p_after - p_before|| / ||p_before||`` per parameter, exactly, from one copy of the
    parameters kept across steps (copied before the step and differenced in place after it, whole
    tensors at a time: chunk by chunk measured slower, benchmarks/results/tracer_overhead.md).

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
    once nothing refers to it. Under ``torch.compile`` (``fullgraph=True`` too) the module hooks are
    traced into the graph and record what they record eagerly; a parameter replaced under a compiled
    forward pass is found when the step closes (the `LabkitError` above).
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
        self._full = _FullStatistics(histogram_bins, histogram_sample, histogram_seed)
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
        self._batched = self._full.batched(self._params) if self._full_every else None
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
        self._full.release_buffers()
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
        params = _replacement_parameters(self.model, self.names, self.optimizer, self._traced_ids)
        _unhook_and_register(self._grad_handles, self._traced_ids, params)
        self._params = params
        self._owners = [_owner(self.model, name) for name in self.names]
        self._identities = [tensor_identity(p) for p in params]
        self._grad_handles[:] = [None] * len(params)
        self._batched = self._full.batched(self._params) if self._full_every else None
        self._hook_parameters_needing_grad()
        if self._trace_updates:
            self._params_before = _ParameterCopy(params)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # Traced into a compiled graph, it cannot read a C++ tensor's identity: `_close_step` finds a
        # replacement there.
        if not torch.compiler.is_compiling() and self._parameters_replaced():
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
            summary = self._full.summary(index, flat)
        else:
            summary = _sums(flat)
        staged[index] = (grad, seen, summary)
        if task < 0:  # not inside the autograd engine's backward: nothing to wait for
            self._commit(staged)

    def _begin_backward(self, task: int) -> dict[int, tuple]:
        # The first gradient of a backward pass; the step's gradients may have been thrown away
        # since the last one (a skipped step).
        if self._skipped_activations is not None or self._step_was_abandoned():
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
        compiling = torch.compiler.is_compiling()  # traced into a torch.compile graph
        if self._step_was_abandoned():
            if compiling:
                self._set_aside_skipped_step()
            else:
                self._close_step(None, skipped=True)
        if isinstance(module, nn.ReLU) and not -output.dim() <= self._unit_dim < output.dim():
            raise LabkitError(
                f"unit_dim={self._unit_dim} does not exist in the {tuple(output.shape)} output of "
                f"ReLU '{self._activation_modules[index][0]}': pass GradTracer(..., unit_dim=...) "
                "naming the units' dimension"
            )
        sums, alive = _activation_summary(output.detach(), module, self._unit_dim)
        if compiling:
            _add_compiled_activation(self._activation_pending, index, output.numel(), sums, alive)
            return
        pending = self._activation_pending[index]
        if pending is None:
            self._activation_pending[index] = [1, output.numel(), sums, alive]
            return
        pending[0] += 1
        pending[1] += output.numel()
        pending[2] = pending[2] + sums
        if alive is not None:
            pending[3] = pending[3] | alive

    def _set_aside_skipped_step(self) -> None:
        # A compiled graph cannot close a step (that reads the device): the skipped step's activations
        # wait here for the next backward's first gradient hook, which closes the step.
        self._skipped_activations = self._activation_pending
        self._activation_pending = [None] * len(self._activation_modules)
        self._first_grad = None

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
        self._skipped_activations: list | None = None  # `_set_aside_skipped_step`
        self._full_step = self._full_every > 0 and self._step % self._full_every == 0

    def _close_step(self, update: torch.Tensor | None, skipped: bool = False) -> None:
        self._backwards.clear()  # backward passes that raised: their gradients never count
        next_activations = self._skipped_activations  # the next step's, if this one was set aside
        if next_activations is not None:
            next_activations, self._activation_pending = self._activation_pending, next_activations
        if self._parameters_replaced():
            # Replaced after this step's forward pass (the forward pre-hook re-attaches before it):
            # the step's gradients went to parameters the tracer did not hook.
            step = self._step
            self._reattach()
            self._reset_pending()
            raise LabkitError(
                f"step {step}: the model's parameters were replaced during the step, after its "
                "forward pass (or before a forward pass compiled by torch.compile, which cannot check), "
                "so its gradients reached parameters the tracer was not hooked to: the step is not "
                "recorded; the tracer follows the new parameters from the next step (replace parameters "
                "between steps, before the forward pass; a compiled model's first step after it is lost)"
            )
        activations = [(k, p) for k, p in enumerate(self._activation_pending) if p is not None]
        summaries = [s for s in self._pending if s is not None]
        batched = [] if self._batched is None or not self._full_step else [
            k for k in self._batched.slots if self._pending[k] is not None
        ]  # fmt: skip
        bins = self._full.bins
        block = self._batched.full_block(batched, bins) if batched else None
        on_device = _step_tensors(summaries, [p for _, p in activations], update, bins, block)
        # The one synchronisation of the step: everything the hooks left on the device, at once.
        values = iter(torch.cat(on_device).tolist() if on_device else ())
        cheap = iter([(next(values), next(values)) for _ in summaries])
        full = self._full_values(values, batched)
        rows = [self._gradient_row(index, cheap, full) for index in range(len(self._params))]
        activation_rows = [
            _activation_row(self._step, *self._activation_modules[k], pending, values) for k, pending in activations
        ]
        if update is not None:
            rows = _with_update_ratios(rows, values)
        self._record(rows, activation_rows)
        if skipped:
            self._alerts.append(_skipped_step_alert(self._step))
        self._step += 1
        self._reset_pending()
        if next_activations is not None:
            self._activation_pending = next_activations
        self._hook_parameters_needing_grad()

    def _full_values(self, values: Iterator[float], batched: list[int]) -> dict[int, Iterator[float]]:
        """Each full-statistics row's numbers, by parameter: the per-tensor ones first, in parameter
        order, then the batched ones (`_step_tensors`' layout)."""
        if not self._full_step:
            return {}
        width = _FULL_SCALARS + self._full.bins
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
            full = self._full.read(full_values[index], numel)
            if self._full.sample_size is not None and not math.isfinite(total_sq):
                full = self._full.retaken(index, self._grads_seen[index], numel)
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

    def _record(self, rows: list[_GradRow], activation_rows: list[_ActivationRow]) -> None:
        self._steps.append(rows)
        if activation_rows:
            self._activation_steps.append(activation_rows)
        self._alerts.extend(_gradient_alerts(rows, self._baselines, self._vanish_ratio, self._explode_factor))
        self._alerts.extend(_dead_unit_alerts(activation_rows, self._dead_above))
        oldest_kept = self._steps[0][0].step
        while self._alerts and self._alerts[0].step < oldest_kept:
            self._alerts.popleft()

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
        Used in ``08_gradient_health``."""
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

