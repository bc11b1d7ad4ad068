"""Checks for the exercises of 13_memory: graphs kept alive across steps, and counting what autograd keeps.

13.1 asks for a validation loss that keeps no batch's autograd graph alive once the next batch has
started (the planted bug adds each loss tensor into a running total, so every graph and its saved
activations live until the end). The check watches what autograd saves through
`torch.autograd.graph.saved_tensors_hooks`, which names the batch whose graph outlived the next, and
bounds the memory the kernel counted for the answer's process, which the answer cannot rewrite. 13.2
asks for that count itself, written with the same hook: the activation bytes a module's forward keeps,
as `memory.saved_bytes` counts them, on blocks the notebook does not show (the planted bug adds up every
tensor the hook is handed, so the parameters, the input and a tensor two operations save are all
counted). Activation checkpointing's exercises moved with case K4 to 16_speed_and_memory
(`labkit/exercises/nb16.py`).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, exercise, run_beside_measuring_memory
from labkit.memory import saved_bytes

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "13_memory"
FEATURES, HIDDEN, CLASSES = 8, 32, 4
ROWS = 6
# 13.1's validation batches are big enough that what a graph keeps shows in the process's memory: each full
# batch's hidden activations take VALIDATION_ROWS * VALIDATION_HIDDEN float64s (64 MiB), above the size glibc
# always maps apart, so freeing them gives the memory back and the kernel's count follows what is alive.
BATCHES, VALIDATION_ROWS, LAST_ROWS, VALIDATION_HIDDEN = 5, 1024, 256, 8192  # the last batch short, as they often are
ACTIVATION_BYTES = VALIDATION_ROWS * VALIDATION_HIDDEN * 8
# A batch's forward holds two activations at once (before and after the ReLU), and the previous batch's graph
# one more: a right answer peaks at three, the planted running total of loss tensors at five, each plus the
# code of torch's a first call pages in (about 25 MiB, counted in the same peak). The bound is between them.
PEAK_ALLOWED_BYTES = 4 * ACTIVATION_BYTES + 16 * 2**20
TOLERANCE = 1e-12


class _SavedTensor:
    """What our pack hook stores in the graph instead of the tensor: it dies when the graph does.

    It holds a detached alias, never the tensor it was given: for an op that saves its own output
    (ReLU), that tensor's grad_fn is the node holding this object, and the cycle
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
    answer_apart=True,
)
def check_mean_validation_loss(mean_validation_loss: Callable) -> str:
    """The mean must be right, and no graph older than the previous batch may be alive."""
    model, batches = _validation_fixture()
    expected, row_weighted = _expected_means()
    (result, stale, alive), peak = run_beside_measuring_memory(mean_validation_loss, _watched_validation, model,
                                                               batches)
    _require_mean(result, expected, row_weighted)
    if stale:
        now, oldest = stale[0]
        raise NotYet(
            f"when batch {now} started, the autograd graph of batch {oldest} was still alive with its saved "
            "activations: memory grows with every batch"
        )
    if alive:
        raise NotYet("after your function returned, an autograd graph was still alive: return a float, not a tensor")
    _require_memory_freed(peak)
    return f"the mean of {BATCHES} batch losses is right, and no batch's graph outlived the next batch"


def _watched_validation(mean_validation_loss: Callable, model: nn.Module,
                        batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[object, list, int]:
    """Where the answer runs: its result, the first (batch, older batch) whose graph was still alive when the
    batch started, and how many saved tensors were still alive when it returned."""
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

    handle = model.register_forward_pre_hook(before_forward)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
            result = mean_validation_loss(model, batches)
    finally:
        handle.remove()
    return result, stale, len(alive)


def _require_memory_freed(peak: int | None) -> None:
    """The memory the kernel counted for the process the answer ran in, which the answer cannot lower (its
    driver's facts it could change): None where the kernel keeps no count."""
    if peak is not None and peak > PEAK_ALLOWED_BYTES:
        raise NotYet(  # the bound, not the count: the count varies a little with the process (threads, code paged in)
            f"while your function ran, its process held more than {PEAK_ALLOWED_BYTES // 2**20} MiB beyond what it "
            f"held before (one batch's hidden activations take {ACTIVATION_BYTES // 2**20} MiB, and a function that "
            "frees each batch's graph holds at most three at once): the graphs of earlier batches were still alive "
            "with their saved activations"
        )


@functools.lru_cache(maxsize=1)
def _expected_means() -> tuple[float, float]:
    """The mean of the fixture's batch losses, and the mean over its rows (a likely wrong answer's)."""
    model, batches = _validation_fixture()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x), y).item() for x, y in batches]
    row_weighted = sum(loss * len(y) for loss, (_, y) in zip(losses, batches)) / sum(len(y) for _, y in batches)
    return sum(losses) / len(batches), row_weighted


def _validation_fixture() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, VALIDATION_HIDDEN), nn.ReLU(), nn.Linear(VALIDATION_HIDDEN, CLASSES))
    model = model.double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    sizes = [VALIDATION_ROWS] * (BATCHES - 1) + [LAST_ROWS]
    batches = [(torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64),
                torch.randint(0, CLASSES, (rows,), generator=generator)) for rows in sizes]
    return model, batches


def _require_mean(result: object, expected: float, row_weighted: float) -> None:
    if isinstance(result, torch.Tensor):
        raise NotYet("you returned a tensor: return the mean as a Python float (.item()), which holds no graph")
    if not isinstance(result, float):
        raise NotYet(f"you returned a {type(result).__name__}, not the mean loss as a Python float")
    if math.isclose(result, row_weighted, rel_tol=1e-9, abs_tol=TOLERANCE):
        raise NotYet(
            f"you returned {result:.6g}, the mean over all rows, which weighs each batch by its rows; the task asks "
            f"for the mean of the {BATCHES} batch losses, each batch counting once ({expected:.6g}): the last "
            f"batch has {LAST_ROWS} rows, not {VALIDATION_ROWS}",
            hint="add up F.cross_entropy(model(x), y).item() per batch and divide by len(batches)",
        )
    if not math.isclose(result, expected, rel_tol=1e-9, abs_tol=TOLERANCE):
        raise NotYet(
            f"you returned {result:.6g}, but the mean of F.cross_entropy(model(x), y) over the "
            f"{BATCHES} batches is {expected:.6g}"
        )


@exercise(
    "13.2",
    notebook=NOTEBOOK,
    title="count what autograd keeps, with its own hook",
    hint=(
        "look at each tensor your pack hook is handed: is it an activation, and have you seen its storage before?",
        (
            "keep only tensors whose storage is not a parameter's, a buffer's or an input's, and count each storage "
            "once: a tensor two operations save is one tensor"
        ),
        (
            "collect the storages to leave out first ({t.untyped_storage().data_ptr() for t in [*module.parameters(), "
            "*module.buffers(), *inputs]}); in the pack hook, add t.untyped_storage().nbytes() to a dict keyed by "
            "t.untyped_storage().data_ptr() unless that key is left out; return the sum of the dict's values"
        ),
    ),
    planted="includes the parameters",
    answer_apart=True,
)
def check_activation_bytes(activation_bytes: Callable) -> str:
    """Equal to memory.saved_bytes on two blocks the notebook does not show; a wrong count is diagnosed."""
    counted = []
    for label, module, inputs in _counting_fixtures():
        expected = saved_bytes(module, *inputs)
        result = activation_bytes(module, *inputs)
        if isinstance(result, bool) or not isinstance(result, int):
            raise NotYet(f"on {label}, you returned a {type(result).__name__}: return the bytes as an int")
        if result != expected:
            raise NotYet(_miscount(label, module, inputs, result, expected))
        counted.append(f"{expected:,} B for {label}")
    return "your count matches memory.saved_bytes: " + " and ".join(counted)


class _GatedBlock(nn.Module):
    """A GLU-style block: half of one projection gates the other half, so a saved view (a chunk) appears."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.up(x).chunk(2, dim=-1)
        return self.down(value * torch.sigmoid(gate))


def _counting_fixtures() -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]]:
    generator = torch.Generator().manual_seed(1)
    mlp = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).double()
    gated = _GatedBlock(FEATURES, HIDDEN // 2).double()
    return [
        ("a Linear → ReLU → Linear block", mlp, (torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64),)),
        ("a gated block (value * sigmoid(gate), from one projection's two halves)", gated,
         (torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64),)),
    ]  # fmt: skip


# How a count can go wrong, each as the flag that gets it right, and what the diagnosis says when it is off.
_MISREADINGS = {
    "skip_state": "includes the parameters ({:,} B), which the model holds whether or not you train",
    "skip_inputs": "includes the input ({:,} B), which existed before the forward",
    "once": "has {:,} B twice: a tensor that two operations save is one tensor, so count each storage once",
    "storage": (
        "misses {:,} B of a saved view (a chunk of a larger tensor): a view keeps its whole storage alive, so count "
        "t.untyped_storage().nbytes(), not t.numel() * t.element_size()"
    ),
}


def _miscount(label: str, module: nn.Module, inputs: tuple, result: int, expected: int) -> str:
    said = f"on {label}, you counted {result:,} B, but autograd keeps {expected:,} B of activations for backward"
    outputs = _layer_outputs_bytes(module, inputs)
    if result == outputs:
        return (
            f"{said}: you counted what every layer outputs, but autograd keeps what backward needs (a layer whose "
            "backward needs its output keeps it, one that needs its input keeps that, and the last layer's output "
            "is kept by none)"
        )
    right = dict.fromkeys(_MISREADINGS, True)
    # The fewest wrong flags that reproduce the learner's number name the likeliest mistakes.
    for wrong in sorted(_flag_subsets(), key=len):
        flags = {**right, **dict.fromkeys(wrong, False)}
        if wrong and _count(module, inputs, **flags) == result:
            clauses = [
                _MISREADINGS[flag].format(abs(_count(module, inputs, **{**right, flag: False}) - expected))
                for flag in wrong
            ]
            return f"{said}: your count " + "; it ".join(clauses)
    element_size = next(module.parameters()).element_size()
    if result * element_size == expected:
        return (f"{said}: {result:,} is a count of elements; each {next(module.parameters()).dtype} element "
                f"takes {element_size} B")
    return f"{said} (each storage once, leaving out the parameters, the buffers and the input)"


def _flag_subsets() -> list[tuple[str, ...]]:
    names = list(_MISREADINGS)
    return [tuple(n for bit, n in enumerate(names) if mask >> bit & 1) for mask in range(2 ** len(names))]


def _count(module: nn.Module, inputs: tuple, *, skip_state: bool, skip_inputs: bool, once: bool,
           storage: bool) -> int:
    left_out = set()
    if skip_state:
        left_out |= {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    if skip_inputs:
        left_out |= {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}
    repeats = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        nbytes = tensor.untyped_storage().nbytes() if storage else tensor.numel() * tensor.element_size()
        if key in left_out:
            return tensor
        if key in seen:
            repeats[0] += nbytes
        else:
            seen[key] = nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sum(seen.values()) + (0 if once else repeats[0])


def _layer_outputs_bytes(module: nn.Module, inputs: tuple) -> int:
    outputs = [0]

    def add(layer, args, output) -> None:
        outputs[0] += output.numel() * output.element_size()

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [leaf.register_forward_hook(add) for leaf in leaves]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs[0]
