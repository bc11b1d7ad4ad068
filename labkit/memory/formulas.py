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
from labkit.memory._fake import _Call, _Trace, _trace
from labkit.memory.report import MemoryReport
from labkit.memory.saved import SavedTensors
from labkit.readings import Reading, format_bytes

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


# The decomposed (unfused) recurrent path, one step at a time in aten ops, as the CPU runs GRU and
# RNN (and LSTM without oneDNN): per layer and time step autograd keeps, in B x H blocks,
# RNN: the step's tanh/relu output (also the next step's hidden input) plus the zero initial state,
# (T + 1) blocks; GRU: the hidden-side projection (3 blocks), reset and update gates, the new
# gate's tanh, h - n, and the previous hidden state, 7 T blocks; LSTM: the four gates, tanh(c),
# the previous h and c, 7 T blocks. A layer's input is kept too when it is not the model's input:
# the previous layer's outputs stacked (T x B x H), or a batch_first input copied to
# (seq, batch, features). Checked against the exact count in tests/test_memory.py.
_STEP_BLOCKS = {nn.GRU: 7, nn.LSTM: 7}
_FUSED_RECURRENT = {"mkldnn_rnn_layer", "_cudnn_rnn", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
                    "miopen_rnn"}


def _unfused_recurrent(call: _Call) -> list[_Item] | None:
    module, x = call.module, call.input
    given_state = len(_tensors(call.args[1:])) > 0 or bool(_tensors(call.kwargs))
    if (call.ops & _FUSED_RECURRENT or module.bidirectional or getattr(module, "proj_size", 0)
            or x.dim() != 3 or given_state or (module.training and module.dropout > 0)):
        return None
    seq_dim = 1 if module.batch_first else 0
    T, B, H = x.shape[seq_dim], x.shape[1 - seq_dim], module.hidden_size
    kind = type(module).__name__
    blocks = _STEP_BLOCKS.get(type(module), None)
    items = []
    for layer in range(module.num_layers):
        count = blocks * T if blocks is not None else T + 1
        items.append(_fresh(f"{kind} layer {layer}: {count} blocks of B x H per the step formula",
                            (count, B, H), x.dtype))
        if layer > 0:
            items.append(_fresh(f"layer {layer - 1} outputs stacked (layer {layer}'s input)", (T, B, H), x.dtype))
        elif module.batch_first:
            items.append(_fresh("input copied to (seq, batch, features)", (T, B, x.shape[-1]), x.dtype))
    return items


def _recurrent(call: _Call) -> list[_Item] | None:
    if isinstance(call.module, nn.LSTM) and "mkldnn_rnn_layer" in call.ops:
        return _lstm(call)
    return _unfused_recurrent(call)


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
    ((nn.LSTM, nn.GRU, nn.RNN), _recurrent),
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), _transformer_layer),
)


# ----------------------------------------------------------------- op-level formulas
# What the backward of each aten op saves (derivatives.yaml's formulas, by the op's own arguments
# and outputs), for code no module formula covers: functional calls in a forward, custom modules.
# Keys are the op names the fake trace records; an op saves a tensor only when the gradient that
# needs it is wanted (``requires_grad`` of the other operand, as autograd's should_compute_output).
def _needs(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad


def _any_needs(op) -> bool:
    return any(_needs(t) for t in _tensors((op.args, op.kwargs)))


def _product(first: int, second: int):
    """A product of two operands saves each one for the other's gradient."""
    def saved(op) -> list:
        a, b = op.args[first], op.args[second]
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return [t for t, other in ((a, b), (b, a)) if both and _needs(other)]
    return saved


def _division(op) -> list:
    numerator, denominator = op.args[0], op.args[1]
    if not isinstance(denominator, torch.Tensor):
        return []
    return ([denominator] if _any_needs(op) else []) + ([numerator] if _needs(denominator) else [])


def _arguments(*positions: int):
    def saved(op) -> list:
        return [op.args[i] for i in positions if i < len(op.args) and isinstance(op.args[i], torch.Tensor)
                ] if _any_needs(op) else []
    return saved


def _results(*positions: int):
    def saved(op) -> list:
        return [op.outputs[i] for i in positions if i < len(op.outputs)] if _any_needs(op) else []
    return saved


def _both(*saving):
    def saved(op) -> list:
        return [t for rule in saving for t in rule(op)]
    return saved


def _scalar_power(op) -> list:
    return [op.args[0]] if _needs(op.args[0]) and not isinstance(op.args[1], torch.Tensor) else []


_OP_FORMULAS = {
    **dict.fromkeys(("mm", "bmm", "mul", "dot", "mv"), _product(0, 1)),
    **dict.fromkeys(("addmm", "baddbmm", "addbmm", "addmv"), _product(1, 2)),
    "div": _division,
    # results: d tanh = 1 - y², d exp = y, softmax's and log-softmax's backward read the output
    **dict.fromkeys(("exp", "tanh", "sigmoid", "relu", "sqrt", "rsqrt", "reciprocal", "_softmax",
                     "_log_softmax"), _results(0)),
    # inputs: the derivative is a function of x
    **dict.fromkeys(("gelu", "silu", "mish", "log", "log1p", "sin", "cos", "abs", "erf", "softplus",
                     "leaky_relu", "hardtanh", "hardswish", "elu", "clamp", "clamp_min", "clamp_max",
                     "threshold", "_adaptive_avg_pool2d", "avg_pool2d", "avg_pool3d"), _arguments(0)),
    "pow": _scalar_power,
    "native_layer_norm": _both(_arguments(0, 2, 3), _results(1, 2)),
    "native_group_norm": _both(_arguments(0, 1), _results(1, 2)),
    **dict.fromkeys(("_native_batch_norm_legit", "native_batch_norm"), _both(_arguments(0, 1, 3, 4), _results(1, 2))),
    "convolution": _arguments(0, 1),
    "native_dropout": _results(1),
    "embedding": lambda op: [op.args[1]] if _needs(op.args[0]) else [],
    **dict.fromkeys(("max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool2d"),
                    _both(_arguments(0), _results(1))),
    "where": lambda op: [op.args[0]] if any(_needs(t) for t in op.args[1:]) else [],
    "masked_fill": lambda op: [op.args[1]] if _needs(op.args[0]) else [],
    # F.scaled_dot_product_attention's fused kernels: q, k, v, the output and the log-sum-exp rows
    "_scaled_dot_product_flash_attention_for_cpu": _both(_arguments(0, 1, 2), _results(0, 1)),
    "_scaled_dot_product_efficient_attention": _both(_arguments(0, 1, 2, 3), _results(0, 1)),
    "_scaled_dot_product_flash_attention": _both(_arguments(0, 1, 2), _results(0, 1)),
    "nll_loss_forward": _both(_arguments(1, 2), _results(1)),
    "mse_loss": _arguments(0, 1),
    # ops whose backward needs only shapes (or nothing): views, copies, sums, concatenation
    **dict.fromkeys(("add", "sub", "neg", "sum", "mean", "view", "_unsafe_view", "reshape", "permute",
                     "transpose", "t", "expand", "unsqueeze", "squeeze", "slice", "select", "clone",
                     "cat", "stack", "split", "split_with_sizes", "unsafe_split", "unbind", "alias",
                     "detach", "_to_copy", "contiguous", "flatten", "narrow", "chunk", "repeat",
                     "rsub", "zeros", "zeros_like", "ones", "ones_like", "empty", "full", "copy_",
                     "fill_", "zero_", "lift_fresh", "as_strided", "_reshape_alias", "new_zeros",
                     "new_ones", "new_empty", "scalar_tensor", "arange"), lambda op: []),
}


def _op_items(op) -> list[_Item] | None:
    """What one op saves, by its formula; None for an op no formula covers."""
    formula = _OP_FORMULAS.get(op.name)
    if formula is None:
        return None
    if not op.grad_enabled:
        return []
    return [_kept(op.name, tensor) for tensor in formula(op) if isinstance(tensor, torch.Tensor)]


def _formula_for(module: nn.Module):
    for types, formula in _FORMULAS:
        if isinstance(module, types):
            return formula
    return None


@dataclass(frozen=True)
class ActivationLine:
    """One module's share of the activations: what its backward needs kept, and the bytes.

    ``has_formula=False`` marks an *unexplained* line: bytes autograd saved (counted exactly, on
    fake tensors, in the same trace) that no module or op formula accounts for; ``layer`` then
    names the op that saved them (``unexplained: MyFunctionBackward``)."""

    module: str
    layer: str
    saves: str
    bytes: int
    exact: int | None = None
    has_formula: bool = True


class AnalyticBytes(int):
    """`analytic_activation_bytes`'s answer: an int (all the bytes), which also says how many of
    them a formula explains (``formula_bytes``) and which ops saved the rest (``unexplained``)."""

    formula_bytes: int
    unexplained: tuple[str, ...]

    def __new__(cls, total: int, formula_bytes: int, unexplained: tuple[str, ...]) -> AnalyticBytes:
        value = super().__new__(cls, total)
        value.formula_bytes, value.unexplained = formula_bytes, unexplained
        return value

    @property
    def unexplained_bytes(self) -> int:
        return int(self) - self.formula_bytes


@dataclass(frozen=True)
class ActivationTable:
    """Per-layer formula for what autograd saves, one line per module, in call order.

    A tensor two layers need (a ReLU's output that the next Linear also saves) is counted on the
    first line only, as autograd stores it once. ``against(saved_tensors(...))`` fills in the exact
    count per module so the two can be read side by side.

    Module formulas cover the standard layers; the code around them (functional calls, custom
    modules) is covered op by op; whatever autograd saved that neither explains gets an
    *unexplained* line naming the op that saved it, with its exact bytes. ``total`` (and
    ``int(table)``) counts every line; ``formula_bytes`` the explained ones, ``unexplained_bytes``
    the rest, and ``uncovered`` names the unexplained lines.
    """

    lines: tuple[ActivationLine, ...]
    title: str = "Activations saved for backward, per layer (analytic)"

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def formula_bytes(self) -> int:
        return sum(line.bytes for line in self.lines if line.has_formula)

    @property
    def unexplained_bytes(self) -> int:
        return self.total - self.formula_bytes

    @property
    def uncovered(self) -> tuple[str, ...]:
        """The unexplained lines, as ``module (op that saved it)``."""
        return tuple(f"{line.module} ({line.layer.removeprefix('unexplained: ')})"
                     for line in self.lines if not line.has_formula)

    def __int__(self) -> int:
        return self.total

    def against(self, exact: SavedTensors) -> ActivationTable:
        """This table with the exact count of each module beside the formula."""
        remaining = dict(exact.per_module)
        lines = [replace(line, exact=remaining.pop(line.module, 0)) for line in self.lines]
        lines += [ActivationLine(name, "-", "no line in the analytic table", 0, nbytes)
                  for name, nbytes in remaining.items()]
        return replace(self, lines=tuple(lines), title=self.title + " vs exact count")

    def __str__(self) -> str:
        compared = any(line.exact is not None for line in self.lines)
        rows = [self.title, _table_row("module", "layer", "analytic", "exact" if compared else "", "what it saves")]
        rows += [_table_row(line.module, line.layer, f"{line.bytes:,}",
                            f"{line.exact:,}" if line.exact is not None else "", line.saves)
                 for line in self.lines]
        rows.append(_table_row("total (bytes)", "", f"{self.total:,}", self._exact_total(), self._difference()))
        rows.append(f"  formula-backed: {self.formula_bytes:,} B of {self.total:,} B"
                    + (f"; unexplained (exact bytes, no formula): {', '.join(self.uncovered)}" if self.uncovered else ""))
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
    Taught in ``13_memory``.
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
    ``device="cpu"`` or ``"cuda"`` to get that device's kernel choices). Taught in ``13_memory``.
    """
    return AnalyticMemory(training_state(model, optimizer, precision),
                          activation_table(model, *inputs, precision=precision, device=device))
