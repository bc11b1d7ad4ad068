"""The analytic calculator: per-layer formulas for what backward keeps, plus the training state.

`activation_table` reads a fake-tensor trace of the forward and applies one formula per layer
type; `training_state` counts weights, gradients, master weights and optimizer state from the
parameter counts at a chosen precision; `analytic_memory` is the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from labkit.memory._common import _check_inputs, _check_model, _check_precision, _optional_device, _with_autograd
from labkit.memory._fake import _Call, _Trace, _trace
from labkit.memory._layer_formulas import _formula_for, _Item, onednn_lstm_workspace_bytes
from labkit.memory._op_formulas import _op_items
from labkit.memory._table import ActivationLine, ActivationTable, AnalyticBytes
from labkit.memory._training_state import training_state
from labkit.memory.report import MemoryReport
from labkit.readings import Reading

__all__ = [
    "ActivationLine",
    "AnalyticBytes",
    "ActivationTable",
    "AnalyticMemory",
    "activation_table",
    "analytic_activation_bytes",
    "analytic_memory",
    "onednn_lstm_workspace_bytes",
    "training_state",
]


def _module_items(call: _Call) -> list[_Item] | None:
    """The module formula's items for one call; None when no module formula covers it."""
    formula = _formula_for(call.module)
    if formula is None:
        return None
    return formula(call) if call.needs_grad else []  # a module no output of which needs grad saves nothing


def _op_line_items(call: _Call) -> list[_Item]:
    return [item for op in call.own_ops for item in (_op_items(op) or [])]


def _line(call: _Call, items: list[_Item], counted: set, excluded: set, layer: str) -> ActivationLine:
    texts, nbytes = [], 0
    for item in dict.fromkeys(items):
        if _is_model_state(item, excluded):
            texts.append(f"{item.what} (model input or state: not counted)")
        elif item.key in counted:
            texts.append(f"{item.what} (already counted above)")
        else:
            counted.add(item.key)
            texts.append(item.what)
            nbytes += item.nbytes
    return ActivationLine(call.name, layer, "; ".join(texts) or "nothing", nbytes)


def _is_model_state(item: _Item, excluded: set) -> bool:
    return isinstance(item.key, tuple) and item.key[0] == "storage" and item.key[1] in excluded


def _formula_lines(trace: _Trace) -> tuple[list[ActivationLine], set, set]:
    """Module lines where a module formula covers the call, op lines for the code of the other
    calls; returns the lines, the storages they counted, and the calls a module formula covers."""
    counted: set = set()
    covered: set = set()
    lines = []
    for call in trace.calls:
        if call in covered:
            continue
        items = _module_items(call)
        if items is not None:
            # a container's formula (TransformerEncoderLayer's) covers its own code; its children
            # have their own lines
            covered.add(call)
            lines.append(_line(call, items, counted, trace.excluded, type(call.module).__name__))
            continue
        op_items = _op_line_items(call)
        if op_items or next(call.module.children(), None) is None:
            layer = f"{type(call.module).__name__} (ops)"
            lines.append(_line(call, op_items, counted, trace.excluded, layer))
    return lines, counted, covered


def _unexplained_lines(trace: _Trace, counted: set, covered: set) -> list[ActivationLine]:
    """What autograd saved that no formula explains, grouped by module and the op that saved it."""
    groups: dict[tuple[str, str], list[int]] = {}
    for key, saved in trace.saved.items():
        if ("storage", key) in counted or saved.call in covered:
            continue
        owner = saved.call.name if saved.call is not None else "(outside any module)"
        op = trace.op_names.get(key, "an op whose node is off the output's graph")
        groups.setdefault((owner, op), []).append(saved.nbytes)
    return [ActivationLine(owner, f"unexplained: {op}",
                           f"saved by {op}, which no formula covers: {len(sizes)} storage(s), exact bytes",
                           sum(sizes), has_formula=False)
            for (owner, op), sizes in groups.items()]


def _merge_by_module(lines: list[ActivationLine]) -> tuple[ActivationLine, ...]:
    # a module called twice (weight sharing) gets one line, as in the exact count
    merged: dict[tuple[str, bool], ActivationLine] = {}
    for line in lines:
        key = (line.module, line.has_formula, line.layer if not line.has_formula else "")
        if key in merged:
            first = merged[key]
            line = replace(first, saves=f"{first.saves} | {line.saves}", bytes=first.bytes + line.bytes)
        merged[key] = line
    return tuple(merged.values())


@_with_autograd
def activation_table(model: nn.Module, *inputs, precision: str = "fp32", device=None) -> ActivationTable:
    """Per-layer formulas for the bytes autograd saves in one ``model(*inputs)``; nothing allocated.

    The forward runs on fake tensors only to learn each layer's shapes, dtypes and which kernel the
    dispatcher picks (fused attention or not, oneDNN LSTM or not); the bytes come from formulas
    for Linear, Conv, BatchNorm, LayerNorm, GroupNorm, activations, dropout, pooling, embedding,
    MultiheadAttention (fused SDPA and explicit softmax), the oneDNN LSTM and the unfused RNN, GRU
    and LSTM; code outside those modules (functional calls such as ``F.scaled_dot_product_attention``,
    views, custom modules) is covered op by op. Bytes autograd saved that no formula explains are
    not dropped: each gets an *unexplained* line naming the op that saved it, with its exact bytes
    from the same trace. ``precision`` runs
    the trace under autocast (``amp_*``) or with 16-bit weights (``bf16``, ``fp16``, ``mixed_*``).
    ``device`` traces as if the tensors lived there: a meta-device model with ``device="cpu"``
    gets the CPU kernels' choices (fused attention, oneDNN LSTM) without allocating anything.
    Used in ``13_memory``.
    """
    _check_model(model)
    _check_inputs(inputs)
    _check_precision(precision)
    trace = _trace(model, inputs, precision, _optional_device(device))
    lines, counted, covered = _formula_lines(trace)
    lines += _unexplained_lines(trace, counted, covered)
    return ActivationTable(_merge_by_module(lines))


def analytic_activation_bytes(model: nn.Module, *inputs) -> AnalyticBytes:
    """The analytic count of activation bytes for one ``model(*inputs)``: an int, formula-backed
    bytes plus the unexplained ones (``.formula_bytes``, ``.unexplained_bytes``, and
    ``.unexplained`` naming the ops that saved them). See :func:`activation_table` for the lines.
    """
    table = activation_table(model, *inputs)
    return AnalyticBytes(table.total, table.formula_bytes, table.uncovered)




@dataclass(frozen=True)
class AnalyticMemory:
    """The analytic calculator's answer: training state plus per-layer activations.

    The total is the sum of the parts, not the peak of a step (gradients appear while activations
    are being freed); see :func:`estimate_step_peak` for that.
    """

    state: MemoryReport
    activations: ActivationTable

    def report(self) -> MemoryReport:
        table = self.activations
        uncovered = table.uncovered
        source = "per-layer formulas" + (
            f"; {table.unexplained_bytes:,} B unexplained, saved by {', '.join(uncovered)}" if uncovered else "")
        activations = Reading(table.total, "B", "estimated", source=source)
        notes = ["sum of the parts, not the peak of a step: see estimate_step_peak"]
        if uncovered:
            notes.append(f"formula-backed {table.formula_bytes:,} B of {table.total:,} B; no formula covers "
                         f"{', '.join(uncovered)}: their bytes are the exact count from the same fake trace")
        return replace(self.state, title=self.state.title + " + activations",
                       rows=(*self.state.rows, ("activations", activations)), notes=tuple(notes))

    def __int__(self) -> int:
        return int(self.report())

    def __str__(self) -> str:
        return f"{self.report()}\n\n{self.activations}"


def analytic_memory(model: nn.Module, *inputs, optimizer: str = "adamw", precision: str = "fp32",
                    device=None) -> AnalyticMemory:
    """Parameters, gradients, master weights, optimizer state and activations, all from formulas.

    Works without allocating: a model on the meta device is fine (e.g. ViT-Base at batch 64, with
    ``device="cpu"`` or ``"cuda"`` to get that device's kernel choices). Used in ``13_memory``.
    """
    return AnalyticMemory(training_state(model, optimizer, precision),
                          activation_table(model, *inputs, precision=precision, device=device))
