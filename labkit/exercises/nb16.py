"""Checks for the exercises of 16_speed_and_memory: activation checkpointing by segments, and which blocks.

16.1 asks for a forward that checkpoints segments of several blocks, so that only each segment's
input is kept (the planted bug checkpoints only the activation function, the article's K4 approach,
and saves nothing; checkpointing every block, the notebook's fix, keeps one input per block). The
check watches what autograd saves through `torch.autograd.graph.saved_tensors_hooks`, to the byte, and
bounds the memory the kernel counted for a larger forward, which the answer cannot rewrite.

16.2 asks which blocks to checkpoint so that what autograd keeps fits a budget with the fewest
blocks recomputed; the blocks have the same shapes and keep different bytes (the planted bug assumes
each frees what the first does, and misses the budget). The check applies the plan and measures it
with `memory.saved_bytes`, the counter the learner is handed too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import NotYet, by_how_much, exercise, run_beside, run_beside_measuring_memory
from labkit.memory import saved_bytes

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "16_speed_and_memory"
BLOCKS, BLOCK_WIDTH, BLOCK_HIDDEN, BLOCK_ROWS = 6, 16, 64, 8
# Segment lengths the check tries: 6 blocks in 3 segments of 2, and in segments of 4 and 2 (a short last one).
SEGMENT_LENGTHS = (2, 4)
TOLERANCE = 1e-12
# The saved bytes above are exact, but noted in the answer's process. A second forward, of blocks whose hidden
# activations take MEMORY_ROWS * MEMORY_HIDDEN float64s (32 MiB, above the size glibc always maps apart), shows
# what autograd keeps in the memory the kernel counts, which the answer cannot lower (`labkit._resident`).
MEMORY_ROWS, MEMORY_HIDDEN, MEMORY_WIDTH = 512, 8192, 2
HIDDEN_BYTES = MEMORY_ROWS * MEMORY_HIDDEN * 8
# A checkpointed forward holds one block's activations at a time (before and after the ReLU: two), a plain one
# every block's besides (seven for six blocks), each plus code a first call pages in. The bound is between them.
FORWARD_PEAK_ALLOWED_BYTES = 4 * HIDDEN_BYTES + 16 * 2**20


@exercise(
    "16.1",
    notebook=NOTEBOOK,
    title="checkpoint segments of blocks",
    hint=(
        "count what autograd saves: is the inside of each block still saved, and how many inputs are kept?",
        "checkpoint a whole group of blocks at once: autograd then keeps only the group's input, and recomputes "
        "the group's inside in backward",
        (
            "for each start in range(0, len(blocks), blocks_per_segment), run blocks[start:start + "
            "blocks_per_segment] inside one torch.utils.checkpoint.checkpoint(run_segment, x, use_reentrant=False), "
            "where run_segment applies those blocks in turn"
        ),
    ),
    planted="the inside of each block is still saved",
    answer_apart=True,
)
def check_checkpointed_forward(checkpointed_forward: Callable) -> str:
    """Same output and gradients as the plain forward, with only each segment's input saved."""
    # Tiny matmuls: on a busy machine a second intra-op thread spins for each of them and costs more CPU
    # time than the matmul itself. The count is restored here, not only by grading's sandbox, so a caller
    # of the check outside it (a test, the grading process) keeps its own.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _checked_forward(checkpointed_forward)
    finally:
        torch.set_num_threads(threads)


def _checked_forward(checkpointed_forward: Callable) -> str:
    blocks, x = _blocks_fixture()
    plain_output = _plain_forward(blocks, x)
    plain_grads = torch.autograd.grad(plain_output.square().sum(), list(blocks.parameters()))
    plain_saved = _saved_bytes(lambda: _plain_forward(blocks, x))
    kept = {}
    for per_segment in SEGMENT_LENGTHS:
        kept[per_segment] = _checked_segments(checkpointed_forward, blocks, x, per_segment, plain_output, plain_grads)
    _require_activations_freed(checkpointed_forward)
    kept_text = " and ".join(f"{saved:,} B with segments of {length}" for length, saved in kept.items())
    return (
        f"output and gradients match the plain forward, and for {len(blocks)} blocks autograd kept {kept_text}, "
        f"against {plain_saved:,} B without checkpointing"
    )


def _checked_segments(checkpointed_forward: Callable, blocks: nn.ModuleList, x: torch.Tensor, per_segment: int,
                      plain_output: torch.Tensor, plain_grads: tuple) -> int:
    output, grads, saved = run_beside(checkpointed_forward, _segments_run, blocks, x, per_segment)
    _require_same_output(output, plain_output)
    if not output.requires_grad:
        raise NotYet(
            "the output does not require grad, so no parameter gets a gradient (reentrant checkpoint, "
            "use_reentrant=True, behaves so when the input does not require grad)",
            hint="use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)",
        )
    _require_same_gradients(grads, plain_grads)
    input_bytes = x.untyped_storage().nbytes()
    segments = math.ceil(len(blocks) / per_segment)
    if saved > len(blocks) * input_bytes:
        raise NotYet(
            f"with segments of {per_segment}, autograd kept {saved:,} B for backward, against "
            f"{len(blocks) * input_bytes:,} B for the {len(blocks)} block inputs alone: the inside of each block "
            "is still saved"
        )
    if saved > segments * input_bytes:
        raise NotYet(
            f"with segments of {per_segment} blocks, autograd kept {saved:,} B, one input per block, but "
            f"only the {segments} segment inputs ({segments * input_bytes:,} B) need to be kept"
        )
    if saved < segments * input_bytes:
        raise NotYet(
            f"with segments of {per_segment} blocks, autograd kept {saved:,} B, fewer than the {segments} "
            f"segment inputs ({segments * input_bytes:,} B): one checkpoint spans more than {per_segment} blocks, "
            "so backward recomputes and holds all of them at once",
            hint=(
                "how many inputs does autograd keep, and how many segments did you ask for?",
                "checkpoint each run of blocks_per_segment blocks on its own, one checkpoint call per segment",
            ),
        )
    return saved


def _require_activations_freed(checkpointed_forward: Callable) -> None:
    blocks, x = _blocks_fixture(MEMORY_WIDTH, MEMORY_HIDDEN, MEMORY_ROWS)
    _, peak = run_beside_measuring_memory(checkpointed_forward, _forward_only, blocks, x, SEGMENT_LENGTHS[0])
    if peak is not None and peak > FORWARD_PEAK_ALLOWED_BYTES:
        raise NotYet(  # the bound, not the count: the count varies a little with the process
            f"with segments of {SEGMENT_LENGTHS[0]} blocks, on {BLOCKS} blocks whose hidden activations take "
            f"{HIDDEN_BYTES // 2**20} MiB each, the forward's process held more than "
            f"{FORWARD_PEAK_ALLOWED_BYTES // 2**20} MiB beyond what it held before (a checkpointed forward holds one "
            "block's at a time): autograd still keeps the inside of each block for backward"
        )


def _forward_only(checkpointed_forward: Callable, blocks: nn.ModuleList, x: torch.Tensor, per_segment: int) -> None:
    """Where the answer runs: its forward, whose graph lives until the driver returns, as it would until backward."""
    output = checkpointed_forward(blocks, x, per_segment)
    del output


def _segments_run(checkpointed_forward: Callable, blocks: nn.ModuleList, x: torch.Tensor,
                  per_segment: int) -> tuple[object, tuple | None, int]:
    """Where the answer runs: its forward, the bytes autograd keeps for backward meanwhile, and the gradients
    of the output's sum of squares with respect to the blocks' parameters (None without a graph)."""
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = checkpointed_forward(blocks, x, per_segment)
    grads = None
    if isinstance(output, torch.Tensor) and output.requires_grad:
        grads = torch.autograd.grad(output.square().sum(), list(blocks.parameters()), allow_unused=True)
    return output, grads, sum(saved)


def _blocks_fixture(width: int = BLOCK_WIDTH, hidden: int = BLOCK_HIDDEN,
                    rows: int = BLOCK_ROWS) -> tuple[nn.ModuleList, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)) for _ in range(BLOCKS)
    ).double()
    with torch.no_grad():
        for parameter in blocks.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    return blocks, torch.randn(rows, width, generator=generator, dtype=torch.float64)


def _plain_forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _saved_bytes(forward: Callable[[], torch.Tensor]) -> int:
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved)


def _require_same_output(output: object, expected: torch.Tensor) -> None:
    if not isinstance(output, torch.Tensor):
        raise NotYet(f"you returned a {type(output).__name__}: return the last block's output tensor")
    if output.shape != expected.shape:
        raise NotYet(f"the output has shape {tuple(output.shape)}, but the blocks give {tuple(expected.shape)}")
    difference = (output.detach() - expected.detach()).abs().max().item()
    if difference > TOLERANCE:
        raise NotYet(f"the output differs {by_how_much(difference)} from running the blocks one after another")


def _require_same_gradients(grads: tuple, expected: tuple) -> None:
    if any(g is None for g in grads):
        raise NotYet("some parameters get no gradient from your output: every block must stay in the graph")
    difference = max((g - e).abs().max().item() for g, e in zip(grads, expected))
    if difference > 1e-10:
        raise NotYet(f"the gradients differ {by_how_much(difference)} from those of the plain forward")


class _WrittenOutSiLU(nn.Module):
    """x * sigmoid(x) in two operations: sigmoid keeps its output and the product keeps both factors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


# Four blocks with the same Linear shapes (so the same FLOPs to recompute) and different activations,
# so they keep different bytes (3, 1, 2 and 1 hidden tensors): the heaviest first, the next heaviest third.
MIXED_ACTIVATIONS = (_WrittenOutSiLU, nn.ReLU, nn.GELU, nn.Tanh)
# How much each budget asks to free, in units of what the lightest block frees: 2.5 needs the heaviest
# block alone, 4.5 needs it and the next heaviest.
DEFICITS = (2.5, 4.5)


@exercise(
    "16.2",
    notebook=NOTEBOOK,
    title="checkpoint the blocks that keep the most",
    hint=(
        "the blocks have the same shapes, but do they keep the same bytes? measure before you pick",
        (
            "checkpointing a block frees what it keeps inside (its input stays kept, by checkpoint): measure that "
            "for each block with kept_bytes(block, block_input), then take the largest first"
        ),
        (
            "excess = kept_bytes(blocks, x) - budget; frees = [kept_bytes(block, x) for block in blocks] (the bytes do "
            "not depend on the values); then add the indices in order of decreasing frees until their sum is at "
            "least excess, and return them"
        ),
    ),
    planted="over the budget",
    answer_apart=True,
)
def check_blocks_to_checkpoint(blocks_to_checkpoint: Callable) -> str:
    """Each budget met, measured with the plan applied, by checkpointing no more blocks than needed."""
    torch.set_num_threads(1)  # tiny matmuls, as in check_checkpointed_forward
    blocks, x = _mixed_blocks_fixture()
    plain = saved_bytes(blocks, x)
    frees = _what_each_block_frees(blocks, x)
    picked_text = []
    for deficit in DEFICITS:
        budget = plain - int(deficit * min(frees))
        plan = _require_plan(blocks_to_checkpoint(blocks, x, budget, saved_bytes), len(blocks), budget)
        kept = saved_bytes(_Planned(blocks, plan), x)
        if kept > budget:
            raise NotYet(
                f"with a budget of {budget:,} B (the plain forward keeps {plain:,} B), you checkpoint blocks "
                f"{_indices(plan)}, and autograd still keeps {kept:,} B, over the budget: those blocks free less "
                "than you assumed"
            )
        needed = _fewest_blocks(frees, plain - budget)
        if len(plan) > len(needed):
            which = (f"the one that keeps the most (block {needed[0]})" if len(needed) == 1
                     else f"the {len(needed)} that keep the most (blocks {_indices(needed)})")
            raise NotYet(
                f"with a budget of {budget:,} B, you checkpoint {len(plan)} blocks, so backward recomputes the "
                f"forward of {len(plan)} blocks; checkpointing {which} fits the budget too"
            )
        picked_text.append(f"{len(plan)} for {plain - budget:,} B")
    return (
        f"both budgets met with the fewest blocks recomputed ({' and '.join(picked_text)} to free; the {len(blocks)} "
        f"blocks, all of the same shapes, free from {min(frees):,} to {max(frees):,} B each)"
    )


class _Planned(nn.Module):
    """The blocks in turn, with the planned ones checkpointed."""

    def __init__(self, blocks: nn.Sequential, plan: list[int]) -> None:
        super().__init__()
        self.blocks, self.plan = blocks, set(plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if index in self.plan else block(x)
        return x


def _mixed_blocks_fixture() -> tuple[nn.Sequential, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    blocks = nn.Sequential(*(
        nn.Sequential(nn.Linear(BLOCK_WIDTH, BLOCK_HIDDEN), activation(), nn.Linear(BLOCK_HIDDEN, BLOCK_WIDTH))
        for activation in MIXED_ACTIVATIONS
    )).double()
    with torch.no_grad():
        for parameter in blocks.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    return blocks, torch.randn(BLOCK_ROWS, BLOCK_WIDTH, generator=generator, dtype=torch.float64)


def _what_each_block_frees(blocks: nn.Sequential, x: torch.Tensor) -> list[int]:
    """What checkpointing each block alone frees: what it keeps besides its input (checkpoint keeps that)."""
    frees = []
    with torch.no_grad():
        for block in blocks:
            frees.append(saved_bytes(block, x))
            x = block(x)
    return frees


def _fewest_blocks(frees: list[int], excess: int) -> list[int]:
    # Every block costs the same to recompute, so the heaviest first frees the most per recomputed block.
    chosen: list[int] = []
    for index in sorted(range(len(frees)), key=lambda i: -frees[i]):
        if sum(frees[i] for i in chosen) >= excess:
            break
        chosen.append(index)
    return sorted(chosen)


def _require_plan(plan: object, count: int, budget: int) -> list[int]:
    try:
        indices = list(plan)  # type: ignore[call-overload]
    except TypeError:
        raise NotYet(
            f"with a budget of {budget:,} B you returned a {type(plan).__name__}: return a list of block indices"
        ) from None
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in indices):
        raise NotYet(f"with a budget of {budget:,} B you returned {indices!r}: return indices from 0 to {count - 1}")
    if len(set(indices)) != len(indices):
        raise NotYet(f"with a budget of {budget:,} B you returned {indices!r}: name each block at most once")
    return indices


def _indices(indices: list[int]) -> str:
    return ", ".join(map(str, sorted(indices)))
