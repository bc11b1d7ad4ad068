"""The exact count of what autograd saves for backward, per module, via saved_tensors_hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.utils.module_tracker import ModuleTracker

from labkit._torch_compat import compiled_original, raw_saved_tensors
from labkit.memory._common import (
    _OUTSIDE,
    _ROOT,
    _check_inputs,
    _check_model,
    _forward,
    _model_left_unchanged,
    _module_names,
    _storage_key,
    _storage_nbytes,
    _tensors,
    _with_autograd,
)
from labkit.memory.report import MemoryReport
from labkit.readings import Reading

__all__ = ["SavedTensors", "saved_bytes", "saved_tensors"]


@dataclass(frozen=True)
class SavedTensors:
    """What autograd keeps for backward after one forward, each storage counted once.

    ``per_module`` maps a module name (as in ``model.named_modules()``; the model itself is
    ``"(model)"``) to the bytes of the storages it was first to save. Parameters, buffers and the
    inputs are not counted: they exist whether or not you train. ``unhooked_bytes`` (already
    included) are tensors autograd saved without calling the hooks: Python scalars it wraps as
    0-d tensors. ``output_only_bytes`` are the forward's outputs that nothing saved: they are alive
    after the forward too, but are not activations. ``recomputed`` counts tensors another pack hook
    took over (``torch.utils.checkpoint``): they are not kept but recomputed in backward, so they
    are not counted; checkpoint's inputs are (it saves them through the hooks), while the RNG state
    it keeps per call (5,056 B on CPU) is not a saved tensor and is not.
    """

    per_module: dict[str, int]
    unhooked_bytes: int
    output_only_bytes: int
    tensor_count: int
    recomputed: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_module.values())

    def __int__(self) -> int:
        return self.total

    def report(self) -> MemoryReport:
        rows = tuple(
            (name, Reading(nbytes, "B", "measured", source="saved_tensors_hooks"))
            for name, nbytes in self.per_module.items()
        )
        notes = [
            f"{self.tensor_count} storages; {self.unhooked_bytes:,} B of wrapped Python scalars "
            "found on the graph (autograd saves those without calling the hooks)",
            f"outputs nothing saved: {self.output_only_bytes:,} B (alive after forward, not counted)",
        ]
        if self.recomputed:
            notes.append(f"{self.recomputed} saved tensors belong to another pack hook (torch.utils.checkpoint): "
                         "recomputed in backward, not kept, not counted; checkpoint's RNG state per call is not counted")
        return MemoryReport("Saved for backward, per module (exact)", rows, tuple(notes))

    def __str__(self) -> str:
        return str(self.report())


class _SavedTensorCounter:
    """Counts storages autograd saves, attributing each to the innermost module running."""

    def __init__(self, model: nn.Module, inputs: Sequence):
        state = [*model.parameters(), *model.buffers(), *_tensors(inputs)]
        self._excluded = {_storage_key(t) for t in state}
        self._counted: dict[int, tuple[str, int]] = {}
        self._names = _module_names(model)
        self._tracker = ModuleTracker()
        self._seen_nodes: set = set()
        self.unhooked_bytes = 0
        self.recomputed = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        after_forward = register_module_forward_hook(self._find_unhooked, with_kwargs=True)
        try:
            with self._tracker, torch.autograd.graph.saved_tensors_hooks(self._pack, _identity):
                yield
        finally:
            after_forward.remove()

    def result(self, output) -> SavedTensors:
        per_module: dict[str, int] = {}
        for owner, nbytes in self._counted.values():
            per_module[owner] = per_module.get(owner, 0) + nbytes
        outputs = {_storage_key(t): _storage_nbytes(t) for t in _tensors(output)}
        output_only = sum(
            nbytes for key, nbytes in outputs.items() if key not in self._counted and key not in self._excluded
        )
        return SavedTensors(per_module, self.unhooked_bytes, output_only, len(self._counted), self.recomputed)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count(tensor, self._innermost_module())
        return tensor

    def _count(self, tensor: torch.Tensor, owner: str) -> int:
        key = _storage_key(tensor)
        if key in self._excluded or key in self._counted:
            return 0
        self._counted[key] = (owner, _storage_nbytes(tensor))
        return self._counted[key][1]

    def _innermost_module(self) -> str:
        # ModuleTracker names a module "RootClass.child.grandchild"; the deepest active one is running.
        deepest = max(self._tracker.parents, key=lambda name: (name != "Global", name.count(".")))
        if deepest == "Global":
            return _OUTSIDE
        return deepest.partition(".")[2] or _ROOT

    def _find_unhooked(self, module, args, kwargs, output) -> None:
        # Autograd saves Python scalars (e.g. the 0.5 in x * 0.5) as 0-d tensors without calling
        # saved_tensors_hooks; they are only visible on the graph this module just built.
        stop = {t.grad_fn for t in _tensors((args, kwargs)) if t.grad_fn is not None}
        owner = self._names.get(module, _OUTSIDE)
        for node in _new_graph_nodes(_tensors(output), stop, self._seen_nodes):
            for handle in raw_saved_tensors(node):
                if handle.unpack_hook is None:
                    # data is None for an undefined saved tensor (an absent optional input)
                    if isinstance(handle.data, torch.Tensor):
                        self.unhooked_bytes += self._count(handle.data, owner)
                elif handle.unpack_hook is not _identity:
                    self.recomputed += 1


def _identity(tensor):
    return tensor


def _new_graph_nodes(outputs: list[torch.Tensor], stop: set, seen: set) -> list:
    """Nodes between a module's outputs and its inputs that no inner module claimed already.

    The walk goes on through claimed nodes: functional code between two submodules (an F.relu
    in the parent's forward) lies beyond the submodules' nodes."""
    frontier = [t.grad_fn for t in outputs if t.grad_fn is not None]
    walked, found = set(), []
    while frontier:
        node = frontier.pop()
        if node is None or node in walked or node in stop:
            continue
        walked.add(node)
        if node not in seen:
            seen.add(node)
            found.append(node)
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return found


@_with_autograd
def saved_tensors(model: nn.Module, *inputs) -> SavedTensors:
    """Run ``model(*inputs)`` once and count, exactly, the bytes autograd saves for backward.

    Each storage is counted once (a tensor saved by two layers, or two views of one tensor, cost
    memory once), parameters, buffers and the inputs are left out, and every byte is attributed
    to the module that saved it first. The model's train/eval mode is used as is; gradient mode is
    switched on (under ``torch.no_grad()`` and ``torch.inference_mode()`` too); buffers (BatchNorm
    statistics) and the RNG are restored afterwards. Works on the meta device too. A
    ``torch.compile`` model is measured as the eager module it wraps (what eager autograd saves; the
    compiled graph's partitioner may keep other tensors). Used in ``13_memory``.
    """
    model = compiled_original(model) or model
    _check_model(model)
    _check_inputs(inputs)
    counter = _SavedTensorCounter(model, inputs)
    with _model_left_unchanged(model, include_parameters=False):
        with counter.counting():
            output = _forward(model, inputs)
        return counter.result(output)


def saved_bytes(model: nn.Module, *inputs) -> int:
    """The exact bytes autograd saves for backward in one ``model(*inputs)``, as an int.

    See :func:`saved_tensors` for the per-module breakdown. Used in ``13_memory``.
    """
    return saved_tensors(model, *inputs).total
