"""Op formulas: what the backward of each aten op saves, for code no module formula covers."""

from __future__ import annotations

import torch

from labkit.memory._common import _tensors
from labkit.memory._layer_formulas import _Item, _kept

__all__: list[str] = []

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
