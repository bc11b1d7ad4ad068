"""Checks for the exercise of 16_speed_and_memory: activation checkpointing by segments.

16.1 asks for a forward that checkpoints segments of several blocks, so that only each segment's
input is kept (the planted bug checkpoints only the activation function, the article's K4 approach,
and saves nothing; checkpointing every block, the notebook's fix, keeps one input per block). The
check watches what autograd saves through `torch.autograd.graph.saved_tensors_hooks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import NotYet, by_how_much, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "16_speed_and_memory"
BLOCKS, BLOCK_WIDTH, BLOCK_HIDDEN, BLOCK_ROWS = 6, 16, 64, 8
# Segment lengths the check tries: 6 blocks in 3 segments of 2, and in segments of 4 and 2 (a short last one).
SEGMENT_LENGTHS = (2, 4)
TOLERANCE = 1e-12


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
)
def check_checkpointed_forward(checkpointed_forward: Callable) -> str:
    """Same output and gradients as the plain forward, with only each segment's input saved."""
    blocks, x = _blocks_fixture()
    plain_output = _plain_forward(blocks, x)
    plain_grads = torch.autograd.grad(plain_output.square().sum(), list(blocks.parameters()))
    plain_saved = _saved_bytes(lambda: _plain_forward(blocks, x))
    kept = {}
    for per_segment in SEGMENT_LENGTHS:
        kept[per_segment] = _checked_segments(checkpointed_forward, blocks, x, per_segment, plain_output, plain_grads)
    kept_text = " and ".join(f"{saved:,} B with segments of {length}" for length, saved in kept.items())
    return (
        f"output and gradients match the plain forward, and for {len(blocks)} blocks autograd kept {kept_text}, "
        f"against {plain_saved:,} B without checkpointing"
    )


def _checked_segments(checkpointed_forward: Callable, blocks: nn.ModuleList, x: torch.Tensor, per_segment: int,
                      plain_output: torch.Tensor, plain_grads: tuple) -> int:
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = checkpointed_forward(blocks, x, per_segment)
    _require_same_output(output, plain_output)
    if not output.requires_grad:
        raise NotYet(
            "the output does not require grad, so no parameter gets a gradient (reentrant checkpoint, "
            "use_reentrant=True, behaves so when the input does not require grad)",
            hint="use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)",
        )
    grads = torch.autograd.grad(output.square().sum(), list(blocks.parameters()), allow_unused=True)
    _require_same_gradients(grads, plain_grads)
    input_bytes = x.untyped_storage().nbytes()
    segments = math.ceil(len(blocks) / per_segment)
    if sum(saved) > len(blocks) * input_bytes:
        raise NotYet(
            f"with segments of {per_segment}, autograd kept {sum(saved):,} B for backward, against "
            f"{len(blocks) * input_bytes:,} B for the {len(blocks)} block inputs alone: the inside of each block "
            "is still saved"
        )
    if sum(saved) > segments * input_bytes:
        raise NotYet(
            f"with segments of {per_segment} blocks, autograd kept {sum(saved):,} B, one input per block, but "
            f"only the {segments} segment inputs ({segments * input_bytes:,} B) need to be kept"
        )
    return sum(saved)


def _blocks_fixture() -> tuple[nn.ModuleList, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(BLOCK_WIDTH, BLOCK_HIDDEN), nn.ReLU(), nn.Linear(BLOCK_HIDDEN, BLOCK_WIDTH))
        for _ in range(BLOCKS)
    ).double()
    with torch.no_grad():
        for parameter in blocks.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    return blocks, torch.randn(BLOCK_ROWS, BLOCK_WIDTH, generator=generator, dtype=torch.float64)


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
