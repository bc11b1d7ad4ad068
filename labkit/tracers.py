"""Hook-based gradient tracers: which parameters got a gradient, how big, and when it went wrong.

Three instruments, each taught in a notebook:

- `GradTracer` (``08_gradient_health``): per-parameter gradient statistics from PyTorch's
  ``register_post_accumulate_grad_hook``, optional activation statistics (forward hooks) and
  update:data ratios (optimizer step hooks), alerts, a bounded history and plots
  (`plot_grad_flow`, `plot_grad_stat`, `plot_grad_histograms`).
- `compare_grads` (``02_gradients_accumulate``, ``11_compile_drift``): an exact / allclose /
  max-diff report between two sets of gradients.
- `autograd_graph` (``01_computation_graph``): the autograd graph behind a tensor, with the tensors
  each node saved and the parameters the output cannot reach.

What a *step* is: one optimizer step. ``GradTracer(model, optimizer)`` closes a step in the
optimizer's step post-hook; without an optimizer, call ``tracer.step()`` once per optimizer step.
Gradient statistics are taken in each parameter's post-accumulate-grad hook, so with k micro-batches
a step's record describes the accumulated gradient after the step's last backward (raw, before any
clipping) and says ``accumulations == k``. The hooks leave their statistics on the device; closing
a step reads everything with one transfer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from labkit._torch_compat import foreach_copy_, foreach_norm, foreach_sub
from labkit.errors import LabkitError


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


class _FullStats(NamedTuple):
    """What a full-statistics step adds to a `_GradRow`; all ``None`` on a cheap step."""

    max_abs: float | None = None
    mean_abs: float | None = None
    zero_frac: float | None = None
    nonfinite: int | None = None
    hist_counts: list[int] | None = None
    hist_lo: float | None = None
    hist_hi: float | None = None


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
NUMERIC_GRAD_STATS = HISTORY_KEYS[6:14]
ALERT_KINDS = ("vanishing", "exploding", "nonfinite", "dead_units", "missing", "skipped_step")

# tanh' = 1 - y^2 and sigmoid' = y(1 - y); a unit is saturated when its derivative is under 2 % of
# the function's peak derivative (1 for tanh, 1/4 for sigmoid), i.e. almost no gradient passes.
SATURATED_DERIVATIVE = 0.02
# dot() and sum() in half precision overflow; these dtypes are reduced as they are.
_REDUCED_AS_IS = (torch.float32, torch.float64)
_FULL_SCALARS = 6  # non-finite count, zero count, sum |g|, max |g|, finite min, finite max
_NO_FULL_STATS = _FullStats()

# Parameters (by id) that a GradTracer is attached to: two tracers on one parameter would run its
# hooks twice and each would see half the truth.
_TRACED_PARAMS: set[int] = set()


@dataclass(frozen=True)
class Alert:
    """A gradient failure seen at one step: ``kind`` is one of `ALERT_KINDS`, ``name`` the
    parameter (or module, for dead units), ``value`` the measured number and ``limit`` the
    threshold it crossed. ``str(alert)`` is the sentence to print. Taught in ``08_gradient_health``."""

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
    ``max_abs``, ``mean_abs``, ``zero_frac`` and a ``histogram_bins``-bin histogram of the finite
    values; on other steps these are ``None``. Each costs another pass over every gradient, which
    is why the every-step mode leaves them out. ``activations=True`` adds forward hooks on the
    model's leaf modules (`activation_history`); ``update_ratio=True`` (needs the optimizer)
    records ``||p_after - p_before|| / ||p_before||`` per parameter.

    Alerts (`alerts`): ``missing`` (a parameter that requires grad got none), ``nonfinite``,
    ``exploding`` (norm above ``explode_factor`` times the median of its last ``baseline_steps``
    finite norms), ``vanishing`` (root-mean-square gradient at most ``vanish_ratio`` times the
    step's largest) and ``dead_units`` (a ReLU module whose share of units that never fired in the
    step reaches ``dead_above``, units along ``unit_dim``; needs ``activations=True``), and,
    with an optimizer, ``skipped_step``: the step's gradients were zeroed
    (``zero_grad(set_to_none=True)``, the default) without ``optimizer.step()`` running, as when
    ``GradScaler`` skips a step on inf/NaN gradients; the step is recorded and closed when the
    next forward or backward starts. (With ``set_to_none=False`` the tensors are zeroed in place
    and a skipped step is not detected.) ``skipped_step`` is taught in ``10_mixed_precision``.

    The history keeps the last ``max_steps`` steps (``None``: all); alerts are kept for the steps
    the history keeps.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        full_every: int = 0,
        histogram_bins: int = 32,
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
        self.model = model
        self.optimizer = optimizer
        self.names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._full_every = full_every
        self._bins = histogram_bins
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
        self._activation_modules: list[tuple[str, nn.Module]] = []
        self._params_before: list[torch.Tensor] = []
        self._reset_pending()

    # ----------------------------------------------------------------- attach / detach

    def __enter__(self) -> GradTracer:
        if self._attached:
            raise LabkitError("this GradTracer is already attached: enter it once, with one `with`")
        ids = {id(p) for p in self._params}
        if ids & _TRACED_PARAMS:
            raise LabkitError(
                f"{type(self.model).__name__} already has a GradTracer attached to its parameters: "
                "exit that tracer's `with` block first (two tracers would run every hook twice)"
            )
        _TRACED_PARAMS.update(ids)
        self._attached = True
        self._grad_handles = [None] * len(self._params)
        self._hook_parameters_needing_grad()
        if self._trace_activations:
            self._hook_activations()
        if self.optimizer is not None:
            self._hook_optimizer(self.optimizer)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in [*self._grad_handles, *self._other_handles]:
            if handle is not None:
                handle.remove()
        self._grad_handles, self._other_handles = [], []
        self._params_before = []
        _TRACED_PARAMS.difference_update(id(p) for p in self._params)
        self._attached = False
        self._reset_pending()

    def _hook_parameters_needing_grad(self) -> None:
        # Re-run at every step boundary so that a parameter unfrozen mid-run gets its hook.
        for index, param in enumerate(self._params):
            if param.requires_grad and self._grad_handles[index] is None:
                hook = partial(self._on_gradient, index)
                self._grad_handles[index] = param.register_post_accumulate_grad_hook(hook)

    def _hook_activations(self) -> None:
        self._activation_modules = [
            (name, module)
            for name, module in self.model.named_modules()
            if next(module.children(), None) is None
        ]
        self._activation_pending = [None] * len(self._activation_modules)
        for index, (_, module) in enumerate(self._activation_modules):
            hook = partial(self._on_activation, index)
            self._other_handles.append(module.register_forward_hook(hook))

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._trace_updates:
            self._params_before = [p.detach().clone() for p in self._params]
            self._other_handles.append(optimizer.register_step_pre_hook(self._before_update))
        self._other_handles.append(optimizer.register_step_post_hook(self._after_update))

    # ----------------------------------------------------------------- hooks (hot path)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        if self._step_was_abandoned():
            self._close_step(None, skipped=True)
        self._accumulations[index] += 1
        grad = param.grad
        if self._first_grad is None:
            self._first_grad = (param, grad)
        if grad.requires_grad:  # backward(create_graph=True): keep the reductions off its graph
            grad = grad.detach()
        if grad.is_sparse:
            grad = grad.to_dense()
        self._pending[index] = _gradient_summary(grad, self._bins if self._full_step else 0)
        self._grads_seen[index] = grad

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
        pending[3] = pending[3] | alive

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        foreach_copy_(self._params_before, [p.detach() for p in self._params])

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        update = None
        if self._trace_updates:
            deltas = foreach_sub([p.detach() for p in self._params], self._params_before)
            update = torch.stack(
                [*foreach_norm(deltas), *foreach_norm(self._params_before)]
            )
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
        activations = [(k, p) for k, p in enumerate(self._activation_pending) if p is not None]
        summaries = [s for s in self._pending if s is not None]
        on_device = _step_tensors(summaries, [p for _, p in activations], update)
        # The one synchronisation of the step: everything the hooks left on the device, at once.
        values = iter(torch.cat(on_device).tolist() if on_device else ())
        cheap = iter([(next(values), next(values)) for _ in summaries])
        rows = [self._gradient_row(index, cheap, values) for index in range(len(self._params))]
        activation_rows = [self._activation_row(k, pending, values) for k, pending in activations]
        if update is not None:
            rows = _with_update_ratios(rows, values)
        self._record(rows, activation_rows)
        if skipped:
            self._alerts.append(_skipped_step_alert(self._step))
        self._step += 1
        self._reset_pending()
        self._hook_parameters_needing_grad()

    def _gradient_row(
        self, index: int, cheap: Iterator[tuple[float, float]], values: Iterator[float]
    ) -> _GradRow:
        param, step, name = self._params[index], self._step, self.names[index]
        numel, frozen = param.numel(), not param.requires_grad
        if self._pending[index] is None:
            return _GradRow(step, name, numel, frozen, True, 0)
        total_sq, total = next(cheap)
        full = _read_full_stats(values, numel, self._bins) if self._full_step else _NO_FULL_STATS
        nonfinite = full.nonfinite
        if nonfinite is None:
            # The sum of squares is non-finite exactly when a value is (or when it overflows).
            nonfinite = 0 if math.isfinite(total_sq) else _count_nonfinite(self._grads_seen[index])
        return _GradRow(
            step, name, numel, frozen, False, self._accumulations[index],
            math.sqrt(total_sq), total / numel, _sample_std(total_sq, total, numel),
            full.max_abs, full.mean_abs, full.zero_frac, nonfinite, None,
            full.hist_counts, full.hist_lo, full.hist_hi,
        )  # fmt: skip

    def _activation_row(self, index: int, pending: list, values: Iterator[float]) -> _ActivationRow:
        calls, count, _, alive = pending
        total, total_sq, saturated, live = (next(values) for _ in range(4))
        name, module = self._activation_modules[index]
        return _ActivationRow(
            self._step, name, type(module).__name__, calls, total / count,
            _sample_std(total_sq, total, count),
            saturated / count if isinstance(module, (nn.Tanh, nn.Sigmoid)) else None,
            1.0 - live / alive.numel() if isinstance(module, nn.ReLU) else None,
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


def _check_tracer_options(
    model: object,
    optimizer: object,
    full_every: int,
    histogram_bins: int,
    update_ratio: bool,
    max_steps: int | None,
    baseline_steps: int,
) -> None:
    if not isinstance(model, nn.Module):
        raise LabkitError(f"GradTracer traces an nn.Module, got {type(model).__name__}: pass the model")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise LabkitError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if update_ratio and optimizer is None:
        raise LabkitError(
            "update_ratio needs the optimizer's step hooks: "
            "GradTracer(model, optimizer, update_ratio=True)"
        )
    for label, value, least in (
        ("full_every", full_every, 0),
        ("histogram_bins", histogram_bins, 1),
        ("baseline_steps", baseline_steps, 1),
        ("max_steps", 1 if max_steps is None else max_steps, 1),
    ):
        if not isinstance(value, int) or value < least:
            raise LabkitError(f"{label} must be an integer >= {least}, got {value!r}")


def _gradient_summary(grad: torch.Tensor, bins: int) -> tuple[torch.Tensor, ...]:
    """Device-side reductions of one gradient: sum of squares and sum; with ``bins``, also a
    tensor of the `_FULL_SCALARS` and a histogram. Each reduction is one pass over the gradient's
    memory, the cost of the every-step mode."""
    flat = grad.reshape(-1)
    if flat.dtype not in _REDUCED_AS_IS:
        flat = flat.float()
    if not bins:
        return (torch.dot(flat, flat), flat.sum())
    finite = torch.isfinite(flat)
    # histc refuses a non-finite range, so non-finite values are counted, then left out.
    clean = torch.where(finite, flat, 0.0)
    low, high = torch.aminmax(clean)
    magnitudes = flat.abs()
    scalars = torch.stack((
        finite.logical_not().sum(), (flat == 0).sum(), magnitudes.sum(), magnitudes.amax(), low, high,
    )).double()  # fmt: skip
    return (torch.dot(flat, flat), flat.sum(), torch.cat((scalars, torch.histc(clean, bins).double())))


def _step_tensors(
    summaries: list[tuple[torch.Tensor, ...]], activations: list[list], update: torch.Tensor | None
) -> list[torch.Tensor]:
    """The step's device tensors in reading order: every (sum of squares, sum) pair, stacked once
    rather than once per hook call; full statistics; activation sums; update norms."""
    tensors = [torch.stack([t for s in summaries for t in s[:2]])] if summaries else []
    tensors += [s[2] for s in summaries if len(s) == 3]
    tensors += [torch.cat((sums, alive.sum().reshape(1))) for _, _, sums, alive in activations]
    if update is not None:
        tensors.append(update)
    return tensors


def _read_full_stats(values: Iterator[float], numel: int, bins: int) -> _FullStats:
    nonfinite, zeros, abs_total, max_abs, low, high = (next(values) for _ in range(_FULL_SCALARS))
    counts = [round(next(values)) for _ in range(bins)]
    if low == high:  # torch.histc widens an empty range by 1 each side
        low, high = low - 1.0, high + 1.0
    return _FullStats(max_abs, abs_total / numel, zeros / numel, int(nonfinite), counts, low, high)


def _count_nonfinite(grad: torch.Tensor) -> int:
    # A second synchronisation, only on a step that has a non-finite value.
    return int(grad.numel() - torch.isfinite(grad).sum().item())


def _sample_std(total_sq: float, total: float, count: int) -> float:
    if count < 2 or not (math.isfinite(total_sq) and math.isfinite(total)):
        return math.nan
    return math.sqrt(max(total_sq - total * total / count, 0.0) / (count - 1))


def _activation_summary(
    output: torch.Tensor, module: nn.Module, unit_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side sums of one forward output and, for ReLU, which units (``unit_dim``) fired."""
    values = output if output.dtype in _REDUCED_AS_IS else output.float()
    if isinstance(module, nn.Tanh):
        saturated = ((1 - values * values) < SATURATED_DERIVATIVE).sum()
    elif isinstance(module, nn.Sigmoid):
        saturated = ((values * (1 - values)) < SATURATED_DERIVATIVE / 4).sum()
    else:
        saturated = values.new_zeros(())
    flat = values.reshape(-1)
    sums = torch.stack((flat.sum(), torch.dot(flat, flat), saturated.to(flat.dtype)))
    if isinstance(module, nn.ReLU) and values.dim() >= 2:
        units = values.movedim(unit_dim, 0)
        alive = units.reshape(units.shape[0], -1).gt(0).any(dim=1)
    else:
        alive = values.new_ones(1, dtype=torch.bool)
    return sums, alive


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
    if len(baseline) >= min(5, baseline.maxlen):
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


# --------------------------------------------------------------------- plots


def plot_grad_flow(source: GradTracer | list[dict], step: int | None = None) -> Any:
    """Gradient flow per parameter at one step: bars of max |g| and mean |g| on a log scale, and
    "no grad" under every parameter that received none. Taught in ``08_gradient_health``.

    ``source`` is a tracer or its `GradTracer.history` records. mean |g| is measured on
    full-statistics steps, so ``step`` defaults to the latest one. Returns the figure."""
    records = _records(source)
    full_steps = sorted({r["step"] for r in records if r["mean_abs"] is not None})
    if not full_steps:
        raise LabkitError(
            "mean |g| is measured on full-statistics steps and none was recorded: "
            "use GradTracer(model, full_every=N) with N >= 1"
        )
    chosen = full_steps[-1] if step is None else step
    rows = [r for r in records if r["step"] == chosen]
    if not rows or chosen not in full_steps:
        raise LabkitError(f"step {chosen} has no full statistics: pick one of {full_steps[-10:]}")
    fig, ax = _subplots(figsize=(max(6.0, 0.5 * len(rows)), 4.0))
    positions = range(len(rows))
    ax.bar(positions, [_plottable(r["max_abs"]) for r in rows], color="c", alpha=0.4, label="max |g|")
    ax.bar(positions, [_plottable(r["mean_abs"]) for r in rows], color="b", label="mean |g|")
    for position, record in zip(positions, rows):
        if record["missing"]:
            ax.text(position, 0.02, "no grad", color="red", rotation=90, ha="center",
                    va="bottom", transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_xticks(list(positions), [r["param"] for r in rows], rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("gradient magnitude")
    ax.set_title(f"gradient flow, step {chosen}")
    ax.legend()
    return fig


def plot_grad_stat(
    source: GradTracer | list[dict], stat: str = "norm", params: Iterable[str] | None = None
) -> Any:
    """One gradient statistic over steps, a line per parameter, log scale. Taught in
    ``08_gradient_health``. ``stat`` is one of `NUMERIC_GRAD_STATS`. Returns the figure."""
    if stat not in NUMERIC_GRAD_STATS:
        raise LabkitError(f"unknown statistic {stat!r}: use one of {', '.join(NUMERIC_GRAD_STATS)}")
    records = [r for r in _selected(_records(source), params) if r[stat] is not None]
    if not records:
        raise LabkitError(
            f"no step recorded {stat!r}: max_abs, mean_abs and zero_frac come from full-statistics "
            "steps (GradTracer(model, full_every=N)), update_ratio from update_ratio=True"
        )
    fig, ax = _subplots(figsize=(7.0, 4.0))
    for name in dict.fromkeys(r["param"] for r in records):
        points = [(r["step"], r[stat]) for r in records if r["param"] == name]
        ax.plot([s for s, _ in points], [_plottable(v) for _, v in points], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.legend(fontsize="small", ncols=2)
    return fig


def plot_grad_histograms(
    source: GradTracer | list[dict], step: int | None = None, params: Iterable[str] | None = None
) -> Any:
    """Histograms of gradient values at one full-statistics step (the latest by default), one
    panel per parameter, log counts. Taught in ``08_gradient_health``. Returns the figure."""
    records = [r for r in _selected(_records(source), params) if r["hist_counts"] is not None]
    if not records:
        raise LabkitError(
            "no gradient histogram recorded: histograms come from full-statistics steps, "
            "use GradTracer(model, full_every=N) with N >= 1"
        )
    chosen = records[-1]["step"] if step is None else step
    rows = [r for r in records if r["step"] == chosen]
    if not rows:
        raise LabkitError(f"step {chosen} has no histograms: full-statistics steps are multiples of full_every")
    columns = min(4, len(rows))
    lines = math.ceil(len(rows) / columns)
    fig, axes = _subplots(lines, columns, figsize=(3.2 * columns, 2.4 * lines), squeeze=False)
    for ax, record in zip(axes.flat, rows):
        counts = record["hist_counts"]
        width = (record["hist_hi"] - record["hist_lo"]) / len(counts)
        edges = [record["hist_lo"] + k * width for k in range(len(counts) + 1)]
        ax.stairs(counts, edges, fill=True)
        ax.set_yscale("log")
        ax.set_title(record["param"], fontsize="small")
    for ax in list(axes.flat)[len(rows):]:
        ax.set_visible(False)
    fig.suptitle(f"gradient values, step {chosen}")
    return fig


def _subplots(*args: Any, **kwargs: Any) -> tuple:
    # pyplot, so that the active backend (inline, widget, Agg) owns the figure; never shown here.
    import matplotlib.pyplot as plt

    return plt.subplots(*args, layout="constrained", **kwargs)


def _records(source: GradTracer | list[dict]) -> list[dict]:
    records = source.history() if isinstance(source, GradTracer) else list(source)
    if not records:
        raise LabkitError("no gradient records to plot: trace at least one step first")
    return records


def _selected(records: list[dict], params: Iterable[str] | None) -> list[dict]:
    if params is None:
        return records
    wanted = set([params] if isinstance(params, str) else params)
    unknown = wanted - {r["param"] for r in records}
    if unknown:
        raise LabkitError(f"no records for {sorted(unknown)}: use names from tracer.names")
    return [r for r in records if r["param"] in wanted]


def _plottable(value: float | None) -> float:
    # A log axis cannot show 0, None or inf; NaN leaves a gap instead of breaking the plot.
    return value if value is not None and math.isfinite(value) and value > 0 else math.nan


# --------------------------------------------------------------------- compare_grads


@dataclass(frozen=True)
class GradDiff:
    """One parameter's row of a `GradComparison`."""

    name: str
    exact: bool
    close: bool
    max_abs_diff: float
    max_rel_diff: float
    dtype_a: str
    dtype_b: str


@dataclass(frozen=True)
class GradComparison:
    """Per-parameter comparison of two gradient sets; prints as a table. Taught in
    ``02_gradients_accumulate`` and ``11_compile_drift``.

    ``exact``: equal after casting to float64 (NaN matches NaN). ``close``:
    ``torch.allclose(a, b, rtol, atol, equal_nan=True)``, with b as the reference.
    ``max_rel_diff``: the largest ``|a - b| / max(|a|, |b|)`` (0 where both are 0)."""

    rows: tuple[GradDiff, ...]
    rtol: float
    atol: float

    @property
    def all_exact(self) -> bool:
        return all(row.exact for row in self.rows)

    @property
    def all_close(self) -> bool:
        return all(row.close for row in self.rows)

    def records(self) -> list[dict]:
        return [asdict(row) for row in self.rows]

    def __str__(self) -> str:
        width = max(len("name"), *(len(row.name) for row in self.rows))
        lines = [
            f"rtol={self.rtol:g} atol={self.atol:g}",
            f"{'name':<{width}}  exact  approx  maxdiff    maxrel",
        ]
        for row in self.rows:
            lines.append(
                f"{row.name:<{width}}  {_yes_no(row.exact):<5}  {_yes_no(row.close):<6}  "
                f"{row.max_abs_diff:<9.3g}  {row.max_rel_diff:.3g}"
            )
        return "\n".join(lines)

    __repr__ = __str__


def compare_grads(
    a: nn.Module | Mapping[str, torch.Tensor],
    b: nn.Module | Mapping[str, torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
) -> GradComparison:
    """Compare two sets of gradients parameter by parameter: eager vs compiled, fp32 vs fp64,
    accumulated vs full batch. Taught in ``02_gradients_accumulate`` and ``11_compile_drift``.

    ``a`` and ``b`` are models (their parameters' ``.grad``, for the parameters that require
    grad) or mappings from name to tensor. Both must hold the same names, shapes and a gradient for
    every name. Values are compared in float64 on the CPU."""
    grads_a, grads_b = _named_grads(a, "a"), _named_grads(b, "b")
    only_a, only_b = grads_a.keys() - grads_b.keys(), grads_b.keys() - grads_a.keys()
    if only_a or only_b:
        raise LabkitError(
            f"the two sides name different parameters (only in a: {sorted(only_a)}, only in b: "
            f"{sorted(only_b)}): compare two copies of the same model"
        )
    rows = tuple(_diff_row(name, grads_a[name], grads_b[name], rtol, atol) for name in grads_a)
    return GradComparison(rows, rtol, atol)


def _named_grads(side: nn.Module | Mapping[str, torch.Tensor], label: str) -> dict:
    if isinstance(side, nn.Module):
        grads = {n: p.grad for n, p in side.named_parameters() if p.requires_grad}
    elif isinstance(side, Mapping):
        grads = dict(side)
    else:
        raise LabkitError(
            f"{label} is a {type(side).__name__}: pass a model or a dict of name -> gradient tensor"
        )
    if not grads:
        raise LabkitError(f"{label} holds no gradients to compare: pass a model with trainable parameters")
    for name, grad in grads.items():
        if not isinstance(grad, torch.Tensor):
            raise LabkitError(
                f"'{name}' has no gradient in {label} (got {type(grad).__name__}): "
                "run backward on both sides before comparing"
            )
    return grads


def _diff_row(name: str, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> GradDiff:
    if a.shape != b.shape:
        raise LabkitError(
            f"'{name}' has shape {tuple(a.shape)} in a and {tuple(b.shape)} in b: "
            "compare gradients of the same architecture"
        )
    x = a.detach().to("cpu", torch.float64)
    y = b.detach().to("cpu", torch.float64)
    same = (x == y) | (x.isnan() & y.isnan())
    # inf - inf and mismatched NaNs are NaN; count them as an infinite difference.
    diff = torch.where(same, 0.0, (x - y).abs().nan_to_num(nan=math.inf))
    scale = torch.maximum(x.abs(), y.abs())
    relative = torch.where(same, 0.0, (diff / scale).nan_to_num(nan=math.inf))
    empty = diff.numel() == 0
    return GradDiff(
        name=name,
        exact=bool(same.all()),
        close=torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True),
        max_abs_diff=0.0 if empty else diff.max().item(),
        max_rel_diff=0.0 if empty else relative.max().item(),
        dtype_a=str(a.dtype).removeprefix("torch."),
        dtype_b=str(b.dtype).removeprefix("torch."),
    )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


# --------------------------------------------------------------------- autograd graph


@dataclass(frozen=True)
class SavedTensor:
    """A tensor an autograd node saved for backward: ``name`` is the attribute without its
    ``_saved_`` prefix; ``nbytes`` is numel x element size of the saved view."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class GraphNode:
    """One node of an `AutogradGraph`: a backward function, or (``leaf`` set) the
    ``AccumulateGrad`` node that writes a leaf tensor's ``.grad``. ``depth`` is the longest
    path from the output's node. ``freed``: backward already released the saved tensors."""

    index: int
    name: str
    depth: int
    saved: tuple[SavedTensor, ...]
    freed: bool
    leaf: str | None


@dataclass(frozen=True)
class AutogradGraph:
    """The autograd graph behind a tensor, walked from its ``grad_fn`` through
    ``next_functions``. Taught in ``01_computation_graph``.

    ``edges`` are ``(node, next_node)`` index pairs in the direction gradient flows (one per
    input, so repeated pairs mean a tensor used twice). ``leaves``: names of the leaf tensors
    reached. ``unreachable_params``: parameters that require grad but no path reaches: this is
    where gradient flow is cut (``detach()``, ``no_grad``, or not used). ``frozen_params``:
    ``requires_grad=False``."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[tuple[int, int], ...]
    unreachable_params: tuple[str, ...]
    frozen_params: tuple[str, ...]

    @property
    def leaves(self) -> list[str]:
        return [node.leaf for node in self.nodes if node.leaf is not None]

    def to_dot(self) -> str:
        """The graph as Graphviz DOT text (no Graphviz needed to produce it)."""
        lines = ["digraph autograd {", '  node [shape=box, fontname="Helvetica"];']
        for node in self.nodes:
            style = ', shape=ellipse, style=filled, fillcolor="lightblue"' if node.leaf else ""
            lines.append(f'  n{node.index} [label="{_dot_escape(_node_label(node))}"{style}];')
        lines += [f"  n{src} -> n{dst};" for src, dst in self.edges]
        for k, (name, note) in enumerate(self._cut_params()):
            lines.append(f'  cut{k} [label="{_dot_escape(name)}\\n({note})", color=red, style=dashed];')
        lines.append("}")
        return "\n".join(lines)

    def draw(self) -> Any:
        """Draw the graph with matplotlib in layers by depth: the output's node on top, leaves
        (blue) below, cut parameters (red, dashed) in a last row. Returns the figure."""
        layers: dict[int, list[GraphNode]] = {}
        for node in self.nodes:
            layers.setdefault(node.depth, []).append(node)
        cut = self._cut_params()
        rows = len(layers) + (1 if cut else 0)
        widest = max([len(nodes) for nodes in layers.values()] + [len(cut)])
        fig, ax = _subplots(figsize=(max(4.0, 2.6 * widest), max(3.0, 1.3 * rows)))
        where = {}
        for depth, nodes in layers.items():
            for k, node in enumerate(nodes):
                where[node.index] = (k - (len(nodes) - 1) / 2, -depth)
        for src, dst in self.edges:
            ax.annotate("", xy=where[dst], xytext=where[src],
                        arrowprops={"arrowstyle": "->", "color": "0.4", "shrinkA": 14, "shrinkB": 14})  # fmt: skip
        for node in self.nodes:
            colour = "lightblue" if node.leaf else "lightyellow"
            ax.text(*where[node.index], _node_label(node), ha="center", va="center", fontsize=7,
                    bbox={"boxstyle": "round", "facecolor": colour})  # fmt: skip
        for k, (name, note) in enumerate(cut):
            ax.text(k - (len(cut) - 1) / 2, -len(layers), f"{name}\n({note})", ha="center",
                    va="center", fontsize=7, color="red",
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "red", "linestyle": "--"})  # fmt: skip
        ax.set_xlim(-widest / 2 - 0.5, widest / 2 + 0.5)
        ax.set_ylim(-rows + 0.5, 0.5)
        ax.axis("off")
        return fig

    def _cut_params(self) -> list[tuple[str, str]]:
        return [(name, "unreachable") for name in self.unreachable_params] + [
            (name, "frozen") for name in self.frozen_params
        ]


def autograd_graph(
    output: torch.Tensor,
    params: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
) -> AutogradGraph:
    """Walk the autograd graph that ``output.backward()`` would traverse. Taught in
    ``01_computation_graph``.

    ``params`` (a model, a dict, or ``model.named_parameters()``) names the leaves and lets the
    graph report parameters the output cannot reach. Saved tensors are read from each node's
    ``_saved_*`` attributes; after a backward without ``retain_graph=True`` they are gone and the
    node says ``freed``."""
    if not isinstance(output, torch.Tensor):
        raise LabkitError(f"autograd_graph walks from a tensor, got {type(output).__name__}")
    if output.grad_fn is None:
        raise LabkitError(
            "this tensor has no grad_fn, so there is no graph behind it: it is a leaf, or it was "
            "computed under torch.no_grad() or from detached tensors; pass the loss itself"
        )
    named = _named_params(params)
    functions, edges = _walk(output.grad_fn)
    depths = _longest_depths(len(functions), edges)
    names = {id(tensor): name for name, tensor in named.items()}
    nodes = tuple(_graph_node(k, fn, depths[k], names) for k, fn in enumerate(functions))
    reached = {id(fn.variable) for fn in functions if hasattr(fn, "variable")}
    unreachable = tuple(n for n, p in named.items() if p.requires_grad and id(p) not in reached)
    frozen = tuple(n for n, p in named.items() if not p.requires_grad)
    return AutogradGraph(nodes, tuple(edges), unreachable, frozen)


def _named_params(params: Any) -> dict[str, torch.Tensor]:
    if params is None:
        return {}
    if isinstance(params, nn.Module):
        return dict(params.named_parameters())
    named = dict(params.items() if isinstance(params, Mapping) else params)
    if not all(isinstance(t, torch.Tensor) for t in named.values()):
        raise LabkitError("params must map names to tensors: pass model.named_parameters()")
    return named


def _walk(root: Any) -> tuple[list[Any], list[tuple[int, int]]]:
    # Breadth-first, so node numbering follows distance from the output and is reproducible.
    functions, index, edges = [root], {id(root): 0}, []
    queue = deque([root])
    while queue:
        fn = queue.popleft()
        for next_fn, _ in fn.next_functions:
            if next_fn is None:
                continue
            if id(next_fn) not in index:
                index[id(next_fn)] = len(functions)
                functions.append(next_fn)
                queue.append(next_fn)
            edges.append((index[id(fn)], index[id(next_fn)]))
    return functions, edges


def _longest_depths(count: int, edges: list[tuple[int, int]]) -> list[int]:
    # Longest path from the root in topological order, so every node sits below all its users.
    users = [0] * count
    targets: list[list[int]] = [[] for _ in range(count)]
    for src, dst in edges:
        users[dst] += 1
        targets[src].append(dst)
    depth, ready = [0] * count, deque([0])
    while ready:
        node = ready.popleft()
        for dst in targets[node]:
            depth[dst] = max(depth[dst], depth[node] + 1)
            users[dst] -= 1
            if users[dst] == 0:
                ready.append(dst)
    return depth


def _graph_node(index: int, fn: Any, depth: int, names: dict[int, str]) -> GraphNode:
    leaf = None
    if hasattr(fn, "variable"):
        tensor = fn.variable
        leaf = names.get(id(tensor), f"leaf {tuple(tensor.shape)}")
    saved, freed = _saved_tensors(fn)
    return GraphNode(index, type(fn).__name__, depth, saved, freed, leaf)


def _saved_tensors(fn: Any) -> tuple[tuple[SavedTensor, ...], bool]:
    saved = []
    for attribute in sorted(a for a in dir(fn) if a.startswith("_saved_")):
        try:
            value = getattr(fn, attribute)
        except RuntimeError as error:
            if "modified by an inplace operation" in str(error):
                raise LabkitError(
                    f"{type(fn).__name__} saved a tensor that was modified in place after the forward "
                    "(an optimizer.step() or an in-place op), so its saved values are gone: call "
                    "autograd_graph right after the forward, before anything updates tensors in place"
                ) from error
            if "freed" not in str(error):
                raise
            return (), True
        values = value if isinstance(value, (tuple, list)) else (value,)
        label = attribute.removeprefix("_saved_")
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        for k, tensor in enumerate(tensors):
            saved.append(SavedTensor(
                label if len(tensors) == 1 else f"{label}[{k}]", tuple(tensor.shape),
                str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size(),
            ))  # fmt: skip
    return tuple(saved), False


def _node_label(node: GraphNode) -> str:
    if node.leaf is not None:
        return node.leaf
    details = [f"{s.name}: {list(s.shape)} {s.dtype} {_size(s.nbytes)}" for s in node.saved]
    if node.freed:
        details = ["saved tensors freed"]
    return "\n".join([node.name, *details])


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
