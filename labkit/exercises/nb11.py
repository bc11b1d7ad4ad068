"""Checks for the exercises of 11_compile_drift (cases H1 and H2).

11.1 asks for a gradient comparison at a float32 tolerance (the planted bug demands exact equality,
so a sum taken in another order "fails"). 11.2 asks to keep one layer of an `nn.Sequential` out
of `torch.compile` while the rest is compiled (the planted bug disables the layer's forward inside
the container, the trap case H2 shows: dynamo then gives up on the whole container). The 11.2
fixture compiles with a backend that only records the graphs dynamo captures, so no code is generated.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import NotYet, exercise, run_beside

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "11_compile_drift"
SMALL = 1e-3


@exercise(
    "11.1",
    notebook=NOTEBOOK,
    title="compare gradients at the right tolerance",
    hint=(
        "which tolerance does your comparison use, and how big are the entries compared against it?",
        "float32 rounding scales with the size of the values; an absolute tolerance must scale with the largest |entry|",
        (
            "compare in float64 with torch.allclose(got.double(), ref.double(), rtol=..., atol=...), with atol scaled "
            "to the tensor's largest |entry| (for example 1e-5 * ref.abs().max()), after checking names and shapes"
        ),
    ),
    planted="is a match, but grads_match returned False",
    answer_apart=True,
)
def check_grads_match(grads_match: Callable) -> str:
    """Rounding-only differences must pass, for large and for small gradients; a wrong subgradient, a 1 % error
    (also among small gradients), a NaN and a wrong shape must not."""
    reference = _float64_gradients()
    rounded = _float32_gradients()
    for label, grads, against, expected in _comparison_cases(rounded, reference):
        answer = grads_match(grads, against)
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


def _comparison_cases(rounded, reference) -> list[tuple[str, dict, dict, bool]]:
    """(what is compared, gradients, reference, whether they match)."""
    one_percent = dict(rounded, weight=rounded["weight"] * 1.01)
    with_nan = dict(rounded, bias=rounded["bias"].clone())
    with_nan["bias"][3] = float("nan")
    reshaped = dict(rounded, weight=rounded["weight"].T.contiguous())
    missing = {name: grad for name, grad in rounded.items() if name != "bias"}
    # The same comparisons on gradients 1000x smaller: no fixed absolute tolerance gets both sizes right.
    small = {name: grad * SMALL for name, grad in rounded.items()}
    small_reference = {name: grad * SMALL for name, grad in reference.items()}
    small_one_percent = dict(small, weight=small["weight"] * 1.01)
    return [
        ("the same gradients computed in float32 against their float64 reference", rounded, reference, True),
        ("the float64 reference against itself", reference, reference, True),
        ("gradients whose relu takes slope 1 at exactly 0 (float64 uses 0)", _float32_gradients(1.0), reference, False),
        ("a weight gradient 1% too large", one_percent, reference, False),
        ("a bias gradient holding a NaN", with_nan, reference, False),
        ("a transposed weight gradient", reshaped, reference, False),
        ("gradients missing 'bias'", missing, reference, False),
        ("float32 gradients 1000x smaller, against their float64 reference", small, small_reference, True),
        ("a weight gradient 1% too large, with every gradient 1000x smaller", small_one_percent, small_reference, False),
    ]


@exercise(
    "11.2",
    notebook=NOTEBOOK,
    title="keep one layer of an nn.Sequential out of compilation",
    hint=(
        "count the graphs compile captured and which layers' weights are in them: is anything captured at all?",
        "a disabled layer inside an nn.Sequential breaks the graph inside the container's loop, and dynamo then "
        "gives up on the whole container: compile the layers around the excluded one as containers of their own",
        (
            "slice the Sequential: return nn.Sequential(compile(model[:index]), model[index], compile(model[index + 1:])) "
            "(leaving out an empty slice), so the excluded layer sits between two compiled parts"
        ),
    ),
    planted="no layer was captured",
    answer_apart=True,
)
def check_compile_around(compile_around: Callable) -> str:
    """The excluded layer's weights must be in no captured graph, every other layer's in one; results equal eager."""
    model = _layers()
    eager = copy.deepcopy(model)
    returned, graphs, in_graph, output, excluded, grads = run_beside(compile_around, _compiled_and_run, model)
    if in_graph is None:
        raise NotYet(f"compile_around returned a {returned}, not a module",
                     hint="return a module (an nn.Sequential of the compiled and eager parts, say)")
    x = _compile_input()
    if not any(in_graph.values()):
        raise NotYet(f"torch.compile captured {graphs} graph(s) and no layer was captured: the whole model "
                     "ran eagerly")
    if in_graph[EXCLUDED]:
        raise NotYet(f"torch.compile still captured the excluded layer {EXCLUDED} ({excluded})")
    missed = [index for index, inside in in_graph.items() if not inside and index != EXCLUDED]
    if missed:
        raise NotYet(f"layers {missed} ran eagerly too: only layer {EXCLUDED} should stay out of compilation")
    eager_output = eager(x)
    eager_output.sum().backward()
    if not torch.equal(output.detach(), eager_output.detach()):
        raise NotYet("the returned module's output differs from the original model's")
    for (name, grad), eager_param in zip(grads, eager.parameters()):
        if grad is None or not torch.equal(grad, eager_param.grad):
            raise NotYet(f"the gradient of layer {name} differs from eager PyTorch's")
    return (f"the captured graphs hold every layer but layer {EXCLUDED}, which ran eagerly, and the "
            "output and gradients equal eager PyTorch's")


EXCLUDED = 2


def _compile_input() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(0))


def _compiled_and_run(compile_around: Callable, model: nn.Sequential) -> tuple:
    """Where the answer runs (compiled graphs and modules do not cross), on a copy of the model (an answer may
    swap its layers for compiled ones): the returned object's type, how many graphs torch.compile captured,
    which layers' weights are in one (None when no module came back), the returned module's output on the
    check's input, the excluded layer's type, and each parameter's gradient after a backward pass."""
    model = copy.deepcopy(model)
    graphs: list[set[int]] = []

    def recording_backend(graph_module, example_inputs):
        graphs.append({id(tensor) for tensor in [*example_inputs, *graph_module.parameters()]})
        return graph_module.forward

    # A fresh dynamo cache, so that earlier compilations of this forward cannot hit the recompile limit.
    torch.compiler.reset()
    returned = compile_around(model, EXCLUDED, lambda module: torch.compile(module, backend=recording_backend))
    if not isinstance(returned, nn.Module):
        return type(returned).__name__, len(graphs), None, None, None, None
    output = returned(_compile_input())
    output.sum().backward()
    captured = set().union(*graphs)
    in_graph = {index: any(id(p) in captured for p in layer.parameters())
                for index, layer in enumerate(model) if any(True for _ in layer.parameters())}
    grads = [(name, param.grad) for name, param in model.named_parameters()]
    return type(returned).__name__, len(graphs), in_graph, output, type(model[EXCLUDED]).__name__, grads


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
