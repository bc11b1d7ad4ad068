"""Full-statistics steps: what they take of each gradient, and the sample positions and buffers they keep."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from labkit.tracers._reductions import (
    _REDUCED_AS_IS,
    _Batched,
    _chunk_length,
    _exact_full_summary,
    _fast_full_scalars,
    _flat_for_reduction,
    _nonfinite_full_summary,
    _sums,
)
from labkit.tracers._rows import _FullStats, _read_full_stats

__all__: list[str] = []

# Gradients of at most this many values are reduced together on a full-statistics step (`_Batched`):
# on them the cost is per-op dispatch (~10 us an op, a dozen ops a parameter), not memory passes;
# larger ones keep their own reductions, whose per-op cost their size hides.
_BATCHED_NUMEL = 2**17


class _FullStatistics:
    """A tracer's full-statistics settings: ``bins`` histogram bins, counted from a sample of
    ``sample_size`` values of a larger gradient (None: from every value), drawn from ``seed``."""

    def __init__(self, bins: int, sample_size: int | None, seed: int) -> None:
        self.bins = bins
        self.sample_size = sample_size
        self._seed = seed
        # Per parameter, the positions its histogram samples (None: all), drawn on first use.
        self._positions: dict[tuple, torch.Tensor | None] = {}
        # One buffer per (dtype, device) for a chunk's signs (`_scratch_for`): every full step reuses it.
        self._scratch: dict[tuple, torch.Tensor] = {}

    def summary(self, index: int, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sum of squares, the sum, the `_FULL_SCALARS` (with the histogram when it is exact)
        and the histogram's sample (when it is not)."""
        if self.sample_size is None:
            return (*_sums(flat), _exact_full_summary(flat, self.bins))
        positions = self.positions(index, flat)
        sample = flat.clone() if positions is None else flat.index_select(0, positions)
        return (*_fast_full_scalars(flat, self._scratch_for(flat)), sample)

    def batched(self, params: list[torch.Tensor]) -> _Batched | None:
        """The small gradients that full-statistics steps reduce together (the sampled histogram
        mode only): those of at most `_BATCHED_NUMEL` values of the first such parameter's dtype and
        device; None when fewer than two qualify."""
        if self.sample_size is None:
            return None
        small = [(k, p) for k, p in enumerate(params)
                 if p.numel() <= _BATCHED_NUMEL and p.dtype in _REDUCED_AS_IS and not p.is_sparse]  # fmt: skip
        if not small:
            return None
        kind = (small[0][1].dtype, small[0][1].device)
        chosen = [(k, p) for k, p in small if (p.dtype, p.device) == kind]
        if len(chosen) < 2:
            return None
        positions = [self.positions(k, p.detach().reshape(-1)) for k, p in chosen]
        return _Batched(chosen, positions)

    def positions(self, index: int, flat: torch.Tensor) -> torch.Tensor | None:
        """The fixed positions of ``flat`` that parameter ``index``'s histogram counts, or None
        for all of them; drawn once (per size) from the seed, so every step samples the same ones."""
        key = (index, flat.numel(), flat.device)
        if key not in self._positions:
            positions = None
            if self.sample_size is not None and flat.numel() > self.sample_size:
                generator = torch.Generator().manual_seed(self._seed + index)
                drawn = torch.randint(flat.numel(), (self.sample_size,), generator=generator)
                positions = drawn.sort().values.to(flat.device)  # sorted: reads memory in order
            self._positions[key] = positions
        return self._positions[key]

    def read(self, values: Iterator[float], numel: int) -> _FullStats:
        """A gradient of ``numel`` values' full statistics, from the numbers the step read back."""
        return _read_full_stats(values, numel, self.bins, self._sample_count(numel))

    def retaken(self, index: int, seen: torch.Tensor, numel: int) -> _FullStats:
        """The full statistics of a gradient that holds a non-finite value, taken again exactly."""
        # The sampled path assumed finite values; a non-finite sum of squares says otherwise, so
        # this step's full statistics are taken again, exactly, from the gradient the hook saw
        # (a second synchronisation, only on such a step).
        flat = _flat_for_reduction(seen)
        positions = self.positions(index, flat)
        values = iter(_nonfinite_full_summary(flat, positions, self.bins).tolist())
        return _read_full_stats(values, flat.numel(), self.bins, self._sample_count(numel))

    def release_buffers(self) -> None:
        self._scratch.clear()

    def _sample_count(self, numel: int) -> int:
        if self.sample_size is None or numel <= self.sample_size:
            return numel
        return self.sample_size

    def _scratch_for(self, flat: torch.Tensor) -> torch.Tensor:
        """A buffer for one chunk's signs (`_fast_full_scalars`), one per (dtype, device), reused
        by every chunk of every gradient: on the CPU it stays in cache."""
        key = (flat.dtype, flat.device)
        length = _chunk_length(flat)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < length:
            scratch = self._scratch[key] = torch.empty(length, dtype=flat.dtype, device=flat.device)
        return scratch[:length]
