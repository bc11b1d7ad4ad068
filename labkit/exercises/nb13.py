"""Checks for the exercise of 13_memory: graphs kept alive across steps.

13.1 asks for a validation loss that keeps no batch's autograd graph alive once the next batch has
started (the planted bug adds each loss tensor into a running total, so every graph and its saved
activations live until the end). The check watches what autograd saves through
`torch.autograd.graph.saved_tensors_hooks`. Activation checkpointing's exercise moved with case K4 to
16_speed_and_memory (`labkit/exercises/nb16.py`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "13_memory"
FEATURES, HIDDEN, CLASSES = 8, 32, 4
BATCHES, ROWS = 5, 6
TOLERANCE = 1e-12


class _SavedTensor:
    """What our pack hook stores in the graph instead of the tensor: it dies when the graph does.

    It holds a detached alias, never the tensor it was given: for an op that saves its own output
    (Tanh), that tensor's grad_fn is the node holding this object, and the cycle
    tensor -> grad_fn -> saved variable -> _SavedTensor -> tensor runs through C++, where gc cannot
    break it, so the check itself would keep every graph alive.
    """

    __slots__ = ("tensor", "batch", "__weakref__")

    def __init__(self, tensor: torch.Tensor, batch: int) -> None:
        self.tensor, self.batch = tensor, batch


@exercise(
    "13.1",
    notebook=NOTEBOOK,
    title="a validation loss that frees its graphs",
    hint=(
        "watch what your running total holds: a tensor keeps the graph that made it",
        "a Python float holds no graph; computing the losses without recording a graph saves the activations too",
        (
            "compute the losses under torch.no_grad() and add loss.item() (a Python float) to the total: a "
            "running total of loss tensors keeps every batch's graph and its saved activations alive"
        ),
    ),
    planted="the autograd graph of batch 1 was still alive",
)
def check_mean_validation_loss(mean_validation_loss: Callable) -> str:
    """The mean must be right, and no graph older than the previous batch may be alive."""
    model, batches = _validation_fixture()
    with torch.no_grad():
        expected = sum(F.cross_entropy(model(x), y).item() for x, y in batches) / len(batches)
    alive: weakref.WeakSet = weakref.WeakSet()
    batch_index = [0]
    stale: list[tuple[int, int]] = []

    def before_forward(module, args) -> None:
        batch_index[0] += 1
        older = [held.batch for held in alive if held.batch < batch_index[0] - 1]
        if older:
            stale.append((batch_index[0], min(older)))

    def pack(tensor: torch.Tensor) -> _SavedTensor:
        held = _SavedTensor(tensor.detach(), batch_index[0])
        alive.add(held)
        return held

    model.register_forward_pre_hook(before_forward)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        result = mean_validation_loss(model, batches)
    _require_mean(result, expected)
    if stale:
        now, oldest = stale[0]
        raise NotYet(
            f"when batch {now} started, the autograd graph of batch {oldest} was still alive with its saved "
            "activations: memory grows with every batch"
        )
    if len(alive):
        raise NotYet("after your function returned, an autograd graph was still alive: return a float, not a tensor")
    return f"the mean of {BATCHES} batch losses is right, and no batch's graph outlived the next batch"


def _validation_fixture() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    batches = [(torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64),
                torch.randint(0, CLASSES, (ROWS,), generator=generator)) for _ in range(BATCHES)]
    return model, batches


def _require_mean(result: object, expected: float) -> None:
    if isinstance(result, torch.Tensor):
        raise NotYet("you returned a tensor: return the mean as a Python float (.item()), which holds no graph")
    if not isinstance(result, float):
        raise NotYet(f"you returned a {type(result).__name__}, not the mean loss as a Python float")
    if not math.isclose(result, expected, rel_tol=1e-9, abs_tol=TOLERANCE):
        raise NotYet(
            f"you returned {result:.6g}, but the mean of F.cross_entropy(model(x), y) over the "
            f"{BATCHES} batches is {expected:.6g}"
        )
