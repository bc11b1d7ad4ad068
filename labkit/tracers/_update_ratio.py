"""The update:data ratio's copy of the parameters: taken before an optimizer step, differenced after it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from labkit._torch_compat import foreach_copy_, foreach_norm, foreach_sub_
from labkit.tracers._reductions import _CHUNK, _REDUCED_AS_IS
from labkit.tracers._rows import _GradRow

__all__: list[str] = []


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


def _with_update_ratios(rows: list[_GradRow], values: Iterator[float]) -> list[_GradRow]:
    deltas = [next(values) for _ in rows]
    before = [next(values) for _ in rows]
    return [
        row._replace(update_ratio=delta / norm if norm > 0 else math.nan)
        for row, delta, norm in zip(rows, deltas, before)
    ]
