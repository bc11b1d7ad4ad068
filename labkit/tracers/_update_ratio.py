"""The update:data ratio's copy of the parameters: taken before an optimizer step, differenced after it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from labkit._torch_compat import foreach_copy_, foreach_norm, foreach_sub_
from labkit.tracers._rows import _GradRow

__all__: list[str] = []


class _ParameterCopy:
    """The parameters as they were before an optimizer step, in buffers kept across steps (a
    fresh copy would allocate, and page in, a second set of parameters every step), and the norms
    the update:data ratio needs, in float64: ``take`` copies the parameters and returns their
    norms, ``difference_norms`` the norms of (before - after), the differences taken in place in
    the copies. Whole tensors through foreach ops, three passes over the copies a step: measured
    (benchmarks/tracer_overhead.py) cheaper than chunk-by-chunk passes that keep each chunk in
    cache, which pay an op's dispatch per chunk and copy into a cold buffer either way."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._build(params)

    def _build(self, params: list[torch.Tensor]) -> None:
        self.layout = _layout(params)
        self.copies = [p.detach().clone() for p in params]

    def take(self, params: list[torch.Tensor]) -> torch.Tensor:
        if _layout(params) != self.layout:
            # converted in place since the last step (model.double() keeps the Parameter objects
            # and changes their dtype): copies of the new kind, so the difference keeps its precision
            self._build(params)
        return self._norms_after(foreach_copy_, params)

    def difference_norms(self, params: list[torch.Tensor]) -> torch.Tensor:
        return self._norms_after(foreach_sub_, params)

    def _norms_after(self, foreach_op: Callable, params: list[torch.Tensor]) -> torch.Tensor:
        """The copies' norms after ``foreach_op(copies, params)``, in float64."""
        with torch.no_grad():  # the parameters themselves, no per-step detach() of each
            foreach_op(self.copies, params)
        return torch.stack([norm.double() for norm in foreach_norm(self.copies)])


def _layout(params: list[torch.Tensor]) -> list[tuple]:
    return [(p.dtype, p.device, p.shape) for p in params]


def _with_update_ratios(rows: list[_GradRow], values: Iterator[float]) -> list[_GradRow]:
    deltas = [next(values) for _ in rows]
    before = [next(values) for _ in rows]
    return [
        row._replace(update_ratio=delta / norm if norm > 0 else math.nan)
        for row, delta, norm in zip(rows, deltas, before)
    ]
