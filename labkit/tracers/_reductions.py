"""`GradTracer`'s numeric kernels: a gradient's sums, full statistics and histogram counts, on its device."""

from __future__ import annotations

import torch
from torch import nn

from labkit._torch_compat import foreach_copy_

__all__ = ["SATURATED_DERIVATIVE"]

# tanh' = 1 - y^2 and sigmoid' = y(1 - y); a unit is saturated when its derivative is under 2 % of
# the function's peak derivative (1 for tanh, 1/4 for sigmoid), i.e. almost no gradient passes.
SATURATED_DERIVATIVE = 0.02
# dot() and sum() in half precision overflow; these dtypes are reduced as they are.
_REDUCED_AS_IS = (torch.float32, torch.float64)
_FULL_SCALARS = 6  # non-finite count, zero count, sum |g|, max |g|, finite min, finite max


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
        # amin and amax, two vectorised passes over a chunk in cache: faster on the CPU than one
        # aminmax (benchmarks/tracer_overhead.py)
        low, high = values.amin(), values.amax()
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
    for _, _, sums, alive, *counted_on_device in activations:
        tensors.append(sums)
        if alive is not None:
            tensors.append(alive.sum(0, keepdim=True))
        tensors += counted_on_device
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


def _count_nonfinite(grad: torch.Tensor) -> int:
    # A second synchronisation, only on a step that has a non-finite value.
    return int(grad.numel() - torch.isfinite(grad).sum().item())


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
