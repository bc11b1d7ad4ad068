"""The records `GradTracer` keeps, a row per parameter (or leaf module) per step, and how a row is read back."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from labkit.tracers._reductions import _FULL_SCALARS

__all__ = ["ACTIVATION_KEYS", "HISTORY_KEYS", "NUMERIC_GRAD_STATS"]


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
_NO_FULL_STATS = _FullStats()


def _read_full_stats(values: Iterator[float], numel: int, bins: int, sample: int) -> _FullStats:
    nonfinite, zeros, abs_total, max_abs, low, high = (next(values) for _ in range(_FULL_SCALARS))
    counts = [round(next(values)) for _ in range(bins)]
    if low == high:  # torch.histc widens an empty range by 1 each side
        low, high = low - 1.0, high + 1.0
    return _FullStats(max_abs, abs_total / numel, zeros / numel, int(nonfinite), counts, low, high, sample)


def _sample_std(total_sq: float, total: float, count: int) -> float:
    if count < 2 or not (math.isfinite(total_sq) and math.isfinite(total)):
        return math.nan
    return math.sqrt(max(total_sq - total * total / count, 0.0) / (count - 1))


def _add_compiled_activation(
    pending: list, index: int, numel: int, sums: torch.Tensor, alive: torch.Tensor | None
) -> None:
    """`GradTracer._on_activation` when dynamo traces it into a ``torch.compile`` graph. A Python int
    read there would be a constant of the graph, recompiled at every micro-batch (and past dynamo's
    recompile limit, ``fullgraph=True`` fails), so the calls and values of compiled forward passes are
    counted on the device, in a fifth entry [calls, values] that `_activation_row` reads after the
    sums; an eager forward pass in the same step adds to the two ints as usual."""
    counts = sums.new_tensor([1, numel])
    entry = pending[index]
    if entry is None:
        pending[index] = [0, 0, sums, alive, counts]
        return
    entry[2] = entry[2] + sums
    if alive is not None:
        entry[3] = entry[3] | alive
    if len(entry) == 4:
        entry.append(counts)
    else:
        entry[4] = entry[4] + counts


def _activation_row(
    step: int, name: str, module: nn.Module, pending: list, values: Iterator[float]
) -> _ActivationRow:
    """One leaf module's row, from its pending counts and the numbers the step read back."""
    # `_step_tensors`' layout: the sums, a saturated count (tanh, sigmoid), then a live-unit count
    # (ReLU), then the compiled forward passes' calls and values (`_add_compiled_activation`)
    calls, count, _, alive, *counted_on_device = pending
    total, total_sq = next(values), next(values)
    saturating = isinstance(module, (nn.Tanh, nn.Sigmoid))
    saturated = next(values) if saturating else None
    live = None if alive is None else next(values)
    if counted_on_device:
        calls, count = calls + round(next(values)), count + round(next(values))
    return _ActivationRow(
        step, name, type(module).__name__, calls, total / count, _sample_std(total_sq, total, count),
        None if saturated is None else saturated / count, None if live is None else 1.0 - live / alive.numel(),
    )  # fmt: skip
