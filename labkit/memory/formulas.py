"""The analytic calculator: per-layer formulas for what backward keeps, plus the training state.

`activation_table` reads a fake-tensor trace of the forward and applies one formula per layer
type; `training_state` counts weights, gradients, master weights and optimizer state from the
parameter counts at a chosen precision; `analytic_memory` is the two together.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import LabkitError
from labkit.memory._common import (
    _check_inputs,
    _check_model,
    _check_optimizer_name,
    _check_precision,
    _optional_device,
    _shape_text,
    _storage_key,
    _storage_nbytes,
    _tensors,
    _with_autograd,
)
from labkit.memory._fake import _Call, _trace
from labkit.memory.report import MemoryReport
from labkit.memory.saved import SavedTensors
from labkit.readings import Reading, format_bytes

__all__ = [
    "ActivationLine",
    "ActivationTable",
    "AnalyticMemory",
    "activation_table",
    "analytic_activation_bytes",
    "analytic_memory",
    "onednn_lstm_workspace_bytes",
    "training_state",
]


@dataclass(frozen=True)
class _Item:
    what: str
    key: Hashable
    nbytes: int


def _kept(what: str, tensor: torch.Tensor) -> _Item:
    """An existing tensor kept alive: its whole storage counts, even for a view."""
    nbytes = _storage_nbytes(tensor)
    text = f"{what} {_shape_text(tensor.shape, tensor.dtype)}"
    if nbytes != tensor.numel() * tensor.element_size():
        text += f" (a view: keeps its whole {format_bytes(nbytes)} storage alive)"
    return _Item(text, ("storage", _storage_key(tensor)), nbytes)


def _fresh(what: str, shape, dtype: torch.dtype) -> _Item:
    """A tensor created for backward; its key is unique, so it is never shared."""
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    return _Item(f"{what} {_shape_text(shape, dtype)}", object(), nbytes)


def _operand(what: str, tensor: torch.Tensor, dtype: torch.dtype, flattened: bool) -> _Item:
    """The input a matmul-like kernel saves: itself, or the copy autocast or a reshape made."""
    if tensor.dtype != dtype:
        return _fresh(f"{what} cast by autocast to", tensor.shape, dtype)
    if flattened and tensor.dim() > 2 and not tensor.is_contiguous():
        return _fresh(f"{what} copied to 2-D (not contiguous)", tensor.shape, dtype)
    return _kept(what, tensor)


def _weight_copy(weight: torch.Tensor, dtype: torch.dtype) -> list[_Item]:
    # autocast caches one low-precision copy per weight for the whole forward
    if weight.dtype == dtype:
        return []
    return [_Item(f"weight copy cast by autocast {_shape_text(weight.shape, dtype)}",
                  ("autocast", id(weight), dtype), weight.numel() * dtype.itemsize)]


def _linear(call: _Call) -> list[_Item]:
    weight, dtype = call.module.weight, call.compute_dtype
    items = [_operand("input", call.input, dtype, flattened=True)] if weight.requires_grad else []
    if call.input.requires_grad:
        items += _weight_copy(weight, dtype)
    return items


def _conv(call: _Call) -> list[_Item]:
    dtype = call.compute_dtype
    return [_operand("input", call.input, dtype, flattened=False), *_weight_copy(call.module.weight, dtype)]


def _stat_dtype(x: torch.Tensor, weight) -> torch.dtype:
    # CPU kernels keep statistics in the parameters' dtype; CUDA ones in fp32 for 16-bit inputs
    if x.device.type == "cpu":
        return weight.dtype if weight is not None else x.dtype
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _batch_norm(call: _Call) -> list[_Item]:
    module, x = call.module, call.input
    items = [_kept("input", x)]
    if module.training or module.running_mean is None:
        dtype = _stat_dtype(x, module.weight)
        items += [_fresh("batch mean", (x.shape[1],), dtype), _fresh("inverse std", (x.shape[1],), dtype)]
    return items


def _layer_norm(call: _Call) -> list[_Item]:
    x = call.input
    rows = x.shape[: x.dim() - len(call.module.normalized_shape)]
    dtype = _stat_dtype(x, call.module.weight)
    return [_kept("input", x), _fresh("mean", rows, dtype), _fresh("1/std", rows, dtype)]


def _group_norm(call: _Call) -> list[_Item]:
    x, groups = call.input, (call.input.shape[0], call.module.num_groups)
    dtype = _stat_dtype(x, call.module.weight)
    return [_kept("input", x), _fresh("mean", groups, dtype), _fresh("1/std", groups, dtype)]


def _saves_output(call: _Call) -> list[_Item]:
    return [_kept("output", call.outputs[0])]


def _saves_input(call: _Call) -> list[_Item]:
    return [_kept("input", call.input)]


def _saves_nothing(call: _Call) -> list[_Item]:
    return []


def _dropout(call: _Call) -> list[_Item]:
    module, x = call.module, call.input
    if not module.training or module.p == 0:
        return []
    if "native_dropout" in call.ops:
        return [_fresh("keep mask", x.shape, torch.bool)]
    feature = isinstance(module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d))
    shape = (*x.shape[:2], *[1] * (x.dim() - 2)) if feature else x.shape
    return [_fresh("scaled random mask", shape, x.dtype)]


def _max_pool(call: _Call) -> list[_Item]:
    indices = (_kept("argmax indices", call.outputs[1]) if len(call.outputs) > 1
               else _fresh("argmax indices", call.outputs[0].shape, torch.int64))
    return [_kept("input", call.input), indices]


def _adaptive_avg_pool(call: _Call) -> list[_Item]:
    # an all-ones output size runs as mean(), which keeps only shapes
    spatial = call.outputs[0].shape[2:] if call.input.dim() > 2 else call.outputs[0].shape[-1:]
    return [] if all(d == 1 for d in spatial) else [_kept("input", call.input)]


def _embedding(call: _Call) -> list[_Item]:
    return [_kept("indices", call.input)] if call.module.weight.requires_grad else []


_FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}


def _attention(call: _Call) -> list[_Item]:
    """nn.MultiheadAttention: the projections, then the fused SDPA kernel or the explicit softmax."""
    module = call.module
    bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    bound.apply_defaults()
    query, key, value = (bound.arguments[n] for n in ("query", "key", "value"))
    dims = _attention_dims(module, query, key)
    dtype = call.compute_dtype
    items = _projection_inputs(module, query, key, value, dtype)
    q, k, v = _projections(query, key, value, dims, dtype)
    fused = bool(call.ops & _FUSED_ATTENTION) and not bound.arguments["need_weights"]
    core = _fused_core(call, q, k, v, dims, dtype) if fused else _explicit_core(call, bound, k, v, dims, dtype)
    return items + core


def _attention_dims(module, query, key) -> dict[str, int]:
    seq_dim, batch_dim = (1, 0) if module.batch_first else (0, 1)
    batched = query.dim() == 3
    return {
        "B": query.shape[batch_dim] if batched else 1,
        "L": query.shape[seq_dim] if batched else query.shape[0],
        "S": key.shape[seq_dim] if batched else key.shape[0],
        "E": module.embed_dim, "H": module.num_heads,
    }


def _projection_inputs(module, query, key, value, dtype) -> list[_Item]:
    if query is key and key is value:
        distinct = [("query", query)]
    elif key is value:
        distinct = [("query", query), ("key", key)]
    else:
        distinct = [("query", query), ("key", key), ("value", value)]
    return [_sequence_first_operand(name, tensor, module.batch_first, dtype) for name, tensor in distinct]


def _sequence_first_operand(name: str, tensor: torch.Tensor, batch_first: bool, dtype) -> _Item:
    # batch_first inputs are transposed to (seq, batch, E); a non-contiguous one is copied for the matmul
    if batch_first and tensor.dim() == 3:
        layout = torch.empty_strided(tensor.shape, tensor.stride(), device="meta").transpose(0, 1)
        if not layout.is_contiguous():
            return _fresh(f"{name} copied to (seq, batch, E) for in_proj", tensor.shape, dtype)
    return _operand(f"{name} (in_proj input)", tensor, dtype, flattened=True)


def _projections(query, key, value, dims, dtype) -> tuple[_Item, _Item, _Item]:
    B, L, S, E = dims["B"], dims["L"], dims["S"], dims["E"]
    if key is value and query is key:
        qkv = _fresh("q, k, v projections (one packed tensor)", (3, L, B, E), dtype)
        return qkv, qkv, qkv
    q = _fresh("q projection", (L, B, E), dtype)
    if key is value:
        kv = _fresh("k, v projections (one packed tensor)", (2, S, B, E), dtype)
        return q, kv, kv
    return q, _fresh("k projection", (S, B, E), dtype), _fresh("v projection", (S, B, E), dtype)


# The memory-efficient attention kernel (CUDA) pads its log-sum-exp rows to a multiple of the
# block size its backward loads them in: `kAlignLSE = 32` in _efficient_attention_forward,
# aten/src/ATen/native/transformers/cuda/attention.cu ("should be aligned (by padding) in case M is
# not a good number for loading during backward"). Flash and cuDNN attention keep exactly L rows.
_EFFICIENT_ATTENTION_LSE_ALIGN = 32


def _fused_core(call, q, k, v, dims, dtype) -> list[_Item]:
    B, L, E, H = dims["B"], dims["L"], dims["E"], dims["H"]
    rows = L
    if "_scaled_dot_product_efficient_attention" in call.ops:
        rows = -(-L // _EFFICIENT_ATTENTION_LSE_ALIGN) * _EFFICIENT_ATTENTION_LSE_ALIGN
    return [q, k, v, _fresh("attention output (also out_proj's input)", (B, H, L, E // H), dtype),
            _fresh("log-sum-exp per row", (B, H, rows), torch.float32)]


def _explicit_core(call, bound, k, v, dims, dtype) -> list[_Item]:
    B, L, S, E, H = dims["B"], dims["L"], dims["S"], dims["E"], dims["H"]
    need_weights = bound.arguments["need_weights"]
    items = [_fresh("q scaled by 1/sqrt(d)", (B * H, L, E // H), dtype)]
    items.append(k if need_weights else _fresh("k scaled, transposed", (B * H, E // H, S), dtype))
    weights = _fresh("softmax weights", (B, H, L, S), dtype)
    items.append(weights)
    if call.module.training and call.module.dropout > 0:
        mask_dtype = torch.bool if "native_dropout" in call.ops else dtype
        items += [_fresh("dropout mask on weights", (B, H, L, S), mask_dtype),
                  _fresh("weights after dropout", (B, H, L, S), dtype)]
    items += [v, _fresh("heads merged for out_proj", (L * B, E), dtype)]
    if need_weights:
        items.append(_fresh("the scale 1/sqrt(d) as a 0-d tensor", (), torch.float64))
    return items


# oneDNN's RNN workspace layout (src/cpu/rnn/rnn_utils.cpp, oneDNN v3.x; torch 2.13's CPU build
# bundles v3.12, `torch.__config__.show()` names it): rnn_utils::get_good_ld pads every leading
# dimension to 64 bytes ("64-byte aligned", 64 / sizeof(float) = 16 floats) and, when the padded
# length is a multiple of 256 elements, by one more 64-byte block, "to avoid 4K aliasing effects";
# set_offsets starts each workspace part on a 4096-byte page (`page_size`).
_ONEDNN_ALIGN_FLOATS = 64 // 4
_ONEDNN_ALIASING_PERIOD = 256
_ONEDNN_PAGE_BYTES = 4096


def _onednn_good_ld(dim: int) -> int:
    ld = -(-dim // _ONEDNN_ALIGN_FLOATS) * _ONEDNN_ALIGN_FLOATS
    return ld + _ONEDNN_ALIGN_FLOATS if ld % _ONEDNN_ALIASING_PERIOD == 0 else ld


def onednn_lstm_workspace_bytes(seq_len: int, batch: int, input_size: int, hidden_size: int) -> int:
    """Bytes of the workspace oneDNN keeps for backward, per LSTM layer and direction (fp32, CPU).

    Seven parts, one per time step each: the gates, the hidden output, and five blocks of hidden
    and cell states (and their gradients) for seq_len + 1 steps; each padded to oneDNN's preferred
    row length and rounded up to 4096-byte pages (oneDNN's rnn_utils: see the constants above).
    Checked against the real kernel of this build in ``tests/test_memory.py``; on CPU it is most
    of what an LSTM saves.
    """
    layer_ld = _onednn_good_ld(max(input_size, hidden_size))
    floats = [
        seq_len * batch * _onednn_good_ld(4 * hidden_size),
        seq_len * batch * _onednn_good_ld(hidden_size),
        *[2 * (seq_len + 1) * batch * layer_ld] * 3,
        *[2 * (seq_len + 1) * batch * hidden_size] * 2,
    ]
    return sum(-(-4 * count // _ONEDNN_PAGE_BYTES) * _ONEDNN_PAGE_BYTES for count in floats)


def _lstm(call: _Call) -> list[_Item] | None:
    module, x = call.module, call.input
    if "mkldnn_rnn_layer" not in call.ops or x.dtype != torch.float32 or module.proj_size:
        return None
    seq_dim = 1 if module.batch_first and x.dim() == 3 else 0
    T, B = x.shape[seq_dim], (x.shape[1 - seq_dim] if x.dim() == 3 else 1)
    D, H = 2 if module.bidirectional else 1, module.hidden_size
    states = [_kept("given initial state", s) for s in _tensors(call.args[1:])] or [
        _fresh(f"zero initial {name}", (module.num_layers * D, B, H), x.dtype) for name in ("h0", "c0")]
    if seq_dim == 1:
        layer_input = _fresh("input transposed to (seq, batch, features)", (T, B, x.shape[-1]), x.dtype)
    else:
        layer_input = _kept("input", x)
    items: list[_Item] = []
    for layer in range(module.num_layers):
        width = x.shape[-1] if layer == 0 else H * D
        for _ in range(D):
            output = _layer_output(call, layer, (T, B, H))
            items += [layer_input, *states, output, _fresh("last h", (B, H), x.dtype),
                      _fresh("last c", (B, H), x.dtype),
                      _workspace(T, B, width, H)]
        layer_input, between = _between_layers(module, layer, (T, B, H * D), x.dtype, output)
        items += between
    return items


def _workspace(seq_len: int, batch: int, width: int, hidden: int) -> _Item:
    nbytes = onednn_lstm_workspace_bytes(seq_len, batch, width, hidden)
    return _Item(f"oneDNN workspace {nbytes:,} B (T={seq_len}, B={batch}, in={width}, H={hidden})", object(), nbytes)


def _layer_output(call: _Call, layer: int, shape) -> _Item:
    module = call.module
    if layer == module.num_layers - 1 and not module.bidirectional:
        # the last layer's output storage is the module's output (transposed back if batch_first)
        return _kept(f"layer {layer} output = the LSTM's output", call.outputs[0])
    return _fresh(f"layer {layer} output", shape, call.input.dtype)


def _between_layers(module, layer, shape, dtype, last_output) -> tuple[_Item, list[_Item]]:
    if layer == module.num_layers - 1:
        return last_output, []
    if module.training and module.dropout > 0:
        return _fresh(f"layer {layer} output after dropout", shape, dtype), [
            _fresh("dropout mask between layers", shape, dtype)]
    if module.bidirectional:
        return _fresh(f"layer {layer} directions concatenated", shape, dtype), []
    return last_output, []


def _transformer_layer(call: _Call) -> list[_Item] | None:
    """The feed-forward activation TransformerEncoder/DecoderLayer applies as a plain function."""
    module = call.module
    if isinstance(module.activation, nn.Module):
        return []
    calls = {child.module: child for child in call.children}
    linear1, dropout = calls.get(module.linear1), calls.get(module.dropout)
    if module.activation is F.relu and dropout is not None:
        return [_kept("ReLU output (F.relu between linear1 and linear2)", dropout.input)]
    if module.activation is F.gelu and linear1 is not None:
        return [_kept("GELU input (F.gelu between linear1 and linear2)", linear1.outputs[0])]
    return None


_FORMULAS: tuple[tuple[tuple[type, ...], Callable[[_Call], list[_Item] | None]], ...] = (
    ((nn.Linear,), _linear),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), _conv),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), _batch_norm),
    ((nn.LayerNorm,), _layer_norm),
    ((nn.GroupNorm,), _group_norm),
    ((nn.ReLU, nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.Softmin), _saves_output),
    ((nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish,
      nn.Softplus, nn.ELU, nn.CELU, nn.SELU, nn.PReLU, nn.Threshold), _saves_input),
    ((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d), _dropout),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
      nn.AdaptiveMaxPool3d), _max_pool),
    ((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), _saves_input),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), _adaptive_avg_pool),
    ((nn.Identity, nn.Flatten, nn.Unflatten), _saves_nothing),
    ((nn.Embedding,), _embedding),
    ((nn.MultiheadAttention,), _attention),
    ((nn.LSTM,), _lstm),
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), _transformer_layer),
)


def _formula_for(module: nn.Module):
    for types, formula in _FORMULAS:
        if isinstance(module, types):
            return formula
    return None


@dataclass(frozen=True)
class ActivationLine:
    """One module's share of the activations: what its backward needs kept, and the bytes."""

    module: str
    layer: str
    saves: str
    bytes: int
    exact: int | None = None
    # False: no formula covers this module, so its bytes are unknown (the 0 is not a count)
    has_formula: bool = True


@dataclass(frozen=True)
class ActivationTable:
    """Per-layer formula for what autograd saves, one line per module, in call order.

    A tensor two layers need (a ReLU's output that the next Linear also saves) is counted on the
    first line only, as autograd stores it once. ``against(saved_tensors(...))`` fills in the exact
    count per module so the two can be read side by side.

    ``total`` sums the lines that have a formula; ``uncovered`` names the modules that have none
    (their bytes are unknown, not 0), and ``int(table)`` refuses to pass such a sum off as the
    model's activations.
    """

    lines: tuple[ActivationLine, ...]
    title: str = "Activations saved for backward, per layer (analytic)"

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def uncovered(self) -> tuple[str, ...]:
        """The modules no formula covers, as ``name (Layer)``: what they save is not counted."""
        return tuple(f"{line.module} ({line.layer})" for line in self.lines if not line.has_formula)

    def __int__(self) -> int:
        if self.uncovered:
            raise LabkitError(
                f"no formula covers {', '.join(self.uncovered)}: what it saves is unknown, not 0, so the "
                f"analytic total ({self.total:,} B for the other layers) is not the model's; print "
                "activation_table(model, x) to see the lines, or use saved_bytes(model, x) for the exact count"
            )
        return self.total

    def against(self, exact: SavedTensors) -> ActivationTable:
        """This table with the exact count of each module beside the formula."""
        remaining = dict(exact.per_module)
        lines = [replace(line, exact=remaining.pop(line.module, 0)) for line in self.lines]
        lines += [ActivationLine(name, "-", "no formula: functional code in this module's forward", 0, nbytes)
                  for name, nbytes in remaining.items()]
        return replace(self, lines=tuple(lines), title=self.title + " vs exact count")

    def __str__(self) -> str:
        compared = any(line.exact is not None for line in self.lines)
        rows = [self.title, _table_row("module", "layer", "analytic", "exact" if compared else "", "what it saves")]
        rows += [_table_row(line.module, line.layer, f"{line.bytes:,}",
                            f"{line.exact:,}" if line.exact is not None else "", line.saves)
                 for line in self.lines]
        rows.append(_table_row("total (bytes)", "", f"{self.total:,}", self._exact_total(), self._difference()))
        if self.uncovered:
            rows.append(f"  not counted (no formula): {', '.join(self.uncovered)}")
        return "\n".join(rows)

    def _exact_total(self) -> str:
        exact = [line.exact for line in self.lines if line.exact is not None]
        return f"{sum(exact):,}" if exact else ""

    def _difference(self) -> str:
        exact = sum(line.exact or 0 for line in self.lines)
        if not exact:
            return ""
        return f"analytic - exact = {self.total - exact:+,} B ({(self.total - exact) / exact:+.2%})"


def _table_row(module, layer, analytic, exact, saves) -> str:
    return f"  {module:<24} {layer:<20} {analytic:>13} {exact:>13}   {saves}"


def _line_for(call: _Call, counted: set, excluded: set) -> ActivationLine | None:
    formula = _formula_for(call.module)
    if formula is None and next(call.module.children(), None) is not None:
        return None  # a container: its children have the lines
    items = formula(call) if formula is not None and call.needs_grad else []
    # a module none of whose outputs needs grad saves nothing, formula or not
    if items is None or (formula is None and call.needs_grad):
        kind = type(call.module).__name__
        return ActivationLine(call.name, kind, f"no formula for {kind} here: compare with the exact count", 0,
                              has_formula=False)
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
    return ActivationLine(call.name, type(call.module).__name__, "; ".join(texts) or "nothing", nbytes)


def _is_model_state(item: _Item, excluded: set) -> bool:
    return isinstance(item.key, tuple) and item.key[0] == "storage" and item.key[1] in excluded


def _merge_by_module(lines: list[ActivationLine]) -> tuple[ActivationLine, ...]:
    # a module called twice (weight sharing) gets one line, as in the exact count
    merged: dict[str, ActivationLine] = {}
    for line in lines:
        if line.module in merged:
            first = merged[line.module]
            line = replace(first, saves=f"{first.saves} | {line.saves}", bytes=first.bytes + line.bytes,
                           has_formula=first.has_formula and line.has_formula)
        merged[line.module] = line
    return tuple(merged.values())


@_with_autograd
def activation_table(model: nn.Module, *inputs, precision: str = "fp32", device=None) -> ActivationTable:
    """Per-layer formulas for the bytes autograd saves in one ``model(*inputs)``; nothing allocated.

    The forward runs on fake tensors only to learn each layer's shapes, dtypes and which kernel the
    dispatcher picks (fused attention or not, oneDNN LSTM or not); the bytes come from formulas
    for Linear, Conv, BatchNorm, LayerNorm, GroupNorm, activations, dropout, pooling, embedding,
    MultiheadAttention (fused SDPA and explicit softmax) and the oneDNN LSTM. ``precision`` runs
    the trace under autocast (``amp_*``) or with 16-bit weights (``bf16``, ``fp16``, ``mixed_*``).
    ``device`` traces as if the tensors lived there: a meta-device model with ``device="cpu"``
    gets the CPU kernels' choices (fused attention, oneDNN LSTM) without allocating anything.
    Taught in ``13_memory``.
    """
    _check_model(model)
    _check_inputs(inputs)
    _check_precision(precision)
    calls, excluded = _trace(model, inputs, precision, _optional_device(device))
    counted: set = set()
    lines = [line for call in calls if (line := _line_for(call, counted, excluded)) is not None]
    return ActivationTable(_merge_by_module(lines))


def analytic_activation_bytes(model: nn.Module, *inputs) -> int:
    """The formula-based count of activation bytes for one ``model(*inputs)``, as an int.

    See :func:`activation_table` for the per-layer lines. A model with a layer no formula covers
    gets a LabkitError naming it, not a sum that silently counts that layer as 0.
    """
    return int(activation_table(model, *inputs))


# bytes per parameter for (weights, gradients, master copy, each optimizer slot)
_STATE_BYTES = {
    "fp32": (4, 4, 0, 4), "amp_bf16": (4, 4, 0, 4), "amp_fp16": (4, 4, 0, 4),
    "bf16": (2, 2, 0, 2), "fp16": (2, 2, 0, 2), "mixed_bf16": (2, 2, 4, 4), "mixed_fp16": (2, 2, 4, 4),
}
_OPTIMIZER_SLOTS = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
_SLOT_NAMES = {0: "no state", 1: "momentum buffer", 2: "exp_avg + exp_avg_sq"}


def training_state(model: nn.Module, optimizer: str = "adamw", precision: str = "fp32") -> MemoryReport:
    """Bytes of weights, gradients, master weights and optimizer state, from parameter counts.

    ``precision``: ``fp32``; ``amp_bf16``/``amp_fp16`` (autocast: fp32 weights, 16-bit activations);
    ``bf16``/``fp16`` (everything 16-bit, no master copy); ``mixed_bf16``/``mixed_fp16`` (16-bit
    weights and gradients, fp32 master weights and optimizer state: 16 B per parameter with Adam).
    Frozen parameters cost their weights only. Taught in ``13_memory`` and ``02_gradients_accumulate``.
    """
    _check_model(model)
    _check_precision(precision)
    _check_optimizer_name(optimizer)
    weight_b, grad_b, master_b, slot_b = _STATE_BYTES[precision]
    slots = _OPTIMIZER_SLOTS[optimizer]
    every = sum(p.numel() for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trained)

    def row(label: str, count: int, each: int, what: str) -> tuple[str, Reading]:
        return label, Reading(count * each, "B", "estimated", source=f"{count:,} × {each} B {what}")

    rows = [row("parameters", every, weight_b, "weights"), row("gradients", n, grad_b, "gradients")]
    if master_b:
        rows.append(row("master weights", n, master_b, "fp32 master copy"))
    rows.append(row("optimizer state", n, slots * slot_b, _SLOT_NAMES[slots]))
    if optimizer in ("adam", "adamw"):
        rows.append(row("step counters", len(trained), 4, "(0-d fp32 per parameter tensor; on the CPU "
                                                            "unless capturable or fused)"))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    rows.append(("buffers", Reading(buffers, "B", "estimated", source="as stored")))
    return MemoryReport(f"Training state: {optimizer} at {precision}", tuple(rows))


@dataclass(frozen=True)
class AnalyticMemory:
    """The analytic calculator's answer: training state plus per-layer activations.

    The total is the sum of the parts, not the peak of a step (gradients appear while activations
    are being freed); see :func:`estimate_step_peak` for that.
    """

    state: MemoryReport
    activations: ActivationTable

    def report(self) -> MemoryReport:
        uncovered = self.activations.uncovered
        source = "per-layer formulas" + (f"; not counted: {', '.join(uncovered)}" if uncovered else "")
        activations = Reading(self.activations.total, "B", "estimated", source=source)
        notes = ["sum of the parts, not the peak of a step: see estimate_step_peak"]
        if uncovered:
            notes.append(f"no formula covers {', '.join(uncovered)}: their activations are not counted, so the "
                         "activations row is too low (saved_bytes gives the exact count)")
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
    ``device="cpu"`` or ``"cuda"`` to get that device's kernel choices). Taught in ``13_memory``.
    """
    return AnalyticMemory(training_state(model, optimizer, precision),
                          activation_table(model, *inputs, precision=precision, device=device))
