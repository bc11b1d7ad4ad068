"""Checks for the exercises of 11_compile_drift (cases H1 and H2).

11.1 asks for a gradient comparison at a float32 tolerance (the planted bug demands exact equality,
so a sum taken in another order "fails"). 11.2 asks to keep one module out of `torch.compile`
(the planted bug sets `module._compiled = False`, which torch never reads). The 11.2 fixture
compiles with a backend that only records the graphs dynamo captures, so no code is generated.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "11_compile_drift"


@exercise(
    "11.1",
    notebook=NOTEBOOK,
    title="compare gradients at the right tolerance",
    hint=(
        "compare in float64 with torch.allclose(got.double(), ref.double(), rtol=..., atol=...), with atol scaled "
        "to the tensor's largest |entry| (for example 1e-5 * ref.abs().max()), after checking names and shapes"
    ),
    planted="is a match, but grads_match returned False",
)
def check_grads_match(grads_match: Callable) -> str:
    """Rounding-only differences must pass; a wrong subgradient, a 1 % error, a NaN and a wrong shape must not."""
    reference = _float64_gradients()
    rounded = _float32_gradients()
    for label, grads, expected in _comparison_cases(rounded, reference):
        answer = grads_match(grads, reference)
        if not isinstance(answer, bool):
            raise NotYet(f"grads_match returned a {type(answer).__name__}, not True or False",
                         hint="return a Python bool, for example with bool(...)")
        if answer != expected:
            verdict = "a mismatch" if expected is False else "a match"
            raise NotYet(f"{label} is {verdict}, but grads_match returned {answer}")
    return "float32 rounding passes against a float64 reference, and a wrong subgradient, a 1% error, a NaN and a " \
           "wrong shape are all caught"


BATCH, FEATURES, UNITS = 512, 64, 32


def _layer_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, FEATURES, generator=generator, dtype=torch.float64)
    weight = torch.randn(UNITS, FEATURES, generator=generator, dtype=torch.float64) / FEATURES**0.5
    upstream = torch.randn(BATCH, UNITS, generator=generator, dtype=torch.float64)
    # Some pre-activations sit exactly at 0, where relu's subgradient matters.
    x[:8] = 0.0
    return x, weight, upstream


def _relu_layer_gradients(x, weight, upstream, slope_at_zero: float) -> dict[str, torch.Tensor]:
    pre = x @ weight.T
    slope = torch.where(pre > 0, 1.0, torch.where(pre == 0, slope_at_zero, 0.0)).to(x.dtype)
    grad_pre = upstream * slope
    return {"weight": grad_pre.T @ x, "bias": grad_pre.sum(0), "input": grad_pre @ weight}


def _float64_gradients() -> dict[str, torch.Tensor]:
    return _relu_layer_gradients(*_layer_inputs(), slope_at_zero=0.0)


def _float32_gradients(slope_at_zero: float = 0.0) -> dict[str, torch.Tensor]:
    x, weight, upstream = (t.float() for t in _layer_inputs())
    return _relu_layer_gradients(x, weight, upstream, slope_at_zero)


def _comparison_cases(rounded, reference) -> list[tuple[str, dict, bool]]:
    one_percent = dict(rounded, weight=rounded["weight"] * 1.01)
    with_nan = dict(rounded, bias=rounded["bias"].clone())
    with_nan["bias"][3] = float("nan")
    reshaped = dict(rounded, weight=rounded["weight"].T.contiguous())
    missing = {name: grad for name, grad in rounded.items() if name != "bias"}
    return [
        ("the same gradients computed in float32 against their float64 reference", rounded, True),
        ("the float64 reference against itself", reference, True),
        ("gradients whose relu takes slope 1 at exactly 0 (float64 uses 0)", _float32_gradients(1.0), False),
        ("a weight gradient 1% too large", one_percent, False),
        ("a bias gradient holding a NaN", with_nan, False),
        ("a transposed weight gradient", reshaped, False),
        ("gradients missing 'bias'", missing, False),
    ]


@exercise(
    "11.2",
    notebook=NOTEBOOK,
    title="keep one module out of compilation",
    hint=(
        "torch never reads a _compiled attribute; wrap the module's forward with torch.compiler.disable "
        "(module.forward = torch.compiler.disable(module.forward)) and return the module"
    ),
    planted="torch.compile still captured the excluded module's linear",
)
def check_exclude_from_compile(exclude_from_compile: Callable) -> str:
    """The excluded layer's ops must be in no captured graph; the rest must be; results must equal eager."""
    model = _TwoLayers()
    eager = copy.deepcopy(model)
    returned = exclude_from_compile(model.head)
    if not isinstance(returned, nn.Module):
        raise NotYet(f"exclude_from_compile returned a {type(returned).__name__}, not the module",
                     hint="change the module you are given and return it")
    model.head = returned
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    ops, output = _captured(model, x)
    head_ops = [op for path, op in ops if path.startswith("head")]
    if head_ops:
        raise NotYet(f"torch.compile still captured the excluded module's {', '.join(head_ops)}")
    if not any(path.startswith("hidden") for path, _ in ops):
        raise NotYet("torch.compile captured nothing of the rest of the model: exclude only the module you are given")
    eager_output = eager(x)
    eager_output.sum().backward()
    if not torch.equal(output, eager_output):
        raise NotYet("the compiled model's output differs from the eager model's")
    for (name, param), eager_param in zip(model.named_parameters(), eager.parameters()):
        if param.grad is None or not torch.equal(param.grad, eager_param.grad):
            raise NotYet(f"the gradient of {name} differs from eager PyTorch's")
    return "torch.compile captured the rest of the model but none of the excluded module, and results equal eager"


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.hidden(x)))


def _captured(model: nn.Module, x: torch.Tensor) -> tuple[list[tuple[str, str]], torch.Tensor]:
    """Compile with a backend that records dynamo's graphs and runs them as they are; forward and backward."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    # A fresh dynamo cache, so that earlier compilations of this forward cannot hit the recompile limit.
    torch.compiler.reset()
    output = torch.compile(model, backend=recording_backend)(x)
    output.sum().backward()
    ops = []
    for graph_module in graphs:
        for node in graph_module.graph.nodes:
            if node.op.startswith("call_"):
                stack = list((node.meta.get("nn_module_stack") or {}).values())
                path = re.sub(r"^L\['self'\]\.?", "", stack[-1][0]) if stack else ""
                ops.append((path, getattr(node.target, "__name__", str(node.target))))
    return ops, output.detach()
