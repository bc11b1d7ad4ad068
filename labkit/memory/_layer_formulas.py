"""Module formulas: what the backward of each standard layer keeps, as items of bytes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.memory._common import _shape_text, _storage_key, _storage_nbytes, _tensors
from labkit.memory._fake import _Call
from labkit.readings import format_bytes

__all__ = ["onednn_lstm_workspace_bytes"]


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


def _formula_for(module: nn.Module):
    for types, formula in _FORMULAS:
        if isinstance(module, types):
            return formula
    return None

