"""`compare_grads`: an exact / allclose / max-difference report between two sets of gradients,
parameter by parameter, and its result types `GradComparison` and `GradDiff`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from numbers import Real
from typing import Any

import torch
from torch import nn

from labkit.errors import LabkitError

__all__ = ["GradComparison", "GradDiff", "compare_grads"]


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
    """Per-parameter comparison of two gradient sets, what `compare_grads` returns. ``str()``
    and a notebook's display show it as a table; ``repr()`` is the dataclass's.

    ``exact``: equal after casting to float64, or complex128 when either side is complex (NaN
    matches NaN); sparse gradients are compared as their dense values. ``close``:
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

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # IPython's display of a bare `report` (or one inside a displayed list) shows the table,
        # as print(report) does; repr() stays the one-line dataclass repr.
        printer.text(str(self))


def compare_grads(
    a: nn.Module | Mapping[str, torch.Tensor],
    b: nn.Module | Mapping[str, torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
) -> GradComparison:
    """Compare two sets of gradients parameter by parameter: eager vs compiled, fp32 vs fp64,
    accumulated vs full batch. Used in ``02_gradients_accumulate`` and ``11_compile_drift``.

    ``a`` and ``b`` are models (their parameters' ``.grad``, for the parameters that require
    grad) or mappings from name to tensor. Both must hold the same names, shapes and a gradient for
    every name. Values are compared in float64 (complex128 for complex gradients) on the CPU."""
    for label, tolerance in (("rtol", rtol), ("atol", atol)):
        if not _is_number(tolerance) or not math.isfinite(tolerance) or tolerance < 0:
            raise LabkitError(f"{label} must be a finite number >= 0, got {tolerance!r}")
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
    for label, grad in (("a", a), ("b", b)):
        if grad.device.type == "meta":
            raise LabkitError(
                f"'{name}' is a meta-device gradient in {label}: meta tensors hold no values, so "
                "there is nothing to compare; run both sides on a real device (cpu, cuda)"
            )
    # Complex gradients keep their imaginary part: casting them to float64 would drop it.
    common = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    x, y = (_dense(grad).to("cpu", common) for grad in (a, b))
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


def _dense(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.detach()
    return grad.to_dense() if grad.layout != torch.strided else grad


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"
