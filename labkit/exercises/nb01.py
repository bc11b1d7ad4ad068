"""Checks for the exercises of 01_computation_graph: routing gradients through the autograd graph.

01.1 asks for `p * log(p)` with a finite gradient at `p == 0` (claim A9: `torch.where` sends the
unselected branch a zero gradient, but `0 * inf` is still NaN). 01.2 asks for the parameters a
tensor's graph cannot reach, found by walking `next_functions` as the DAG it is (claim A1; the
planted bug follows only the first link, as if the graph were a linked list). 01.3 asks for a copy
outside the graph that can be edited in place (claim A6: `detach()` shares storage and the version
counter with the original).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, call_and_differentiate, exercise, run_beside, torch_error_clause
from labkit.tracers import autograd_graph

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "01_computation_graph"
TOLERANCE = 1e-12


# --------------------------------------------------------------------- 01.1


@exercise(
    "01.1",
    notebook=NOTEBOOK,
    title="an entropy term with a finite gradient",
    hint=(
        "look at the gradient where p == 0: which branch of torch.where still gets differentiated there?",
        "torch.where passes a zero gradient to the unselected branch, but 0 * (the derivative of log at 0) is 0 * inf = NaN; the log must never see a 0",
        (
            "torch.where sends 0 to the unselected branch, but that branch's own backward still multiplies it "
            "by log(0) = -inf; feed the log a safe value where p == 0 (torch.where(p > 0, p, 1)) and select again"
        ),
    ),
    planted="the gradient is not finite",
    answer_apart=True,
)
def check_entropy_term(entropy_term: Callable) -> str:
    """Values and gradients must match p*log(p) (0 at p == 0) on probabilities with exact zeros."""
    p = torch.tensor([0.0, 1e-3, 0.25, 0.0, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    expected_values = torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).detach()
    expected_grads = torch.where(p > 0, torch.log(p) + 1, torch.zeros_like(p)).detach()
    differentiated = call_and_differentiate(entropy_term, (p,), wrt=(0,))
    values = differentiated.result
    _require_tensor(values, p.shape, "entropy_term(p)")
    if not values.requires_grad:
        raise NotYet("the result carries no gradient: it was computed outside the graph (detach or no_grad?)")
    not_finite = (~torch.isfinite(values.detach())).nonzero().flatten().tolist()
    if not_finite:
        raise NotYet(
            f"the values are not finite at p = {[p[i].item() for i in not_finite]}: log(0) is -inf, and 0 * -inf "
            "is NaN, so multiplying by 0 or by a mask afterwards cannot make it 0",
            hint=(
                "what is 0 * log(0) in floating point, and can anything done afterwards turn it back into 0?",
                "choose the value at p == 0 with torch.where rather than computing p * log(p) there",
            ),
        )
    _require_close(values.detach(), expected_values, "the values", "p * log(p), and 0 where p == 0")
    (grads,) = differentiated.gradients()
    bad = (~torch.isfinite(grads)).nonzero().flatten().tolist()
    if bad:
        raise NotYet(f"the gradient is not finite at p = {[p[i].item() for i in bad]}")
    at_zero = p.detach() == 0
    if torch.allclose(grads[~at_zero], expected_grads[~at_zero], rtol=0, atol=1e-9) and grads[at_zero].any():
        raise NotYet(
            f"the gradient at p == 0 is {grads[at_zero][0].item():.3g}, not 0: a clamp or an epsilon keeps the log "
            "finite, but the log's branch is still differentiated there",
            hint=(
                "at p == 0, does your result still depend on p?",
                "at p == 0 the result must not depend on p at all: select the constant 0 with torch.where",
            ),
        )
    _require_close(grads, expected_grads, "the gradient", "log(p) + 1 where p > 0, and 0 where p == 0")
    return f"values and gradients match p*log(p) on {p.numel()} probabilities, finite at p == 0"


def _scalar_output(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    output = model(inputs)
    return F.mse_loss(output, torch.zeros_like(output)) if output.dim() > 0 else output


def _walked_graph(unreachable_parameters: Callable, model: nn.Module, inputs: torch.Tensor) -> tuple[object, bool]:
    """Where the answer runs (a graph does not cross): what it reports for the model's loss, and whether a
    backward pass reached the loss meanwhile (backward or autograd.grad)."""
    output = _scalar_output(model, inputs)
    backward_ran = []
    output.register_hook(lambda grad: backward_ran.append(True))
    return unreachable_parameters(output, model), bool(backward_ran)


_EDITED_SOURCE = [0.5, -1.0, 2.0]


def _edit_the_copy(editable_copy: Callable) -> tuple[object, bool, torch.Tensor | None, torch.Tensor | str | None]:
    """Where the answer runs (storage and graphs do not cross): the copy as returned, whether it is in the
    graph, the original after the copy was zeroed in place, and the original's gradient then (or the
    clause of the error its backward raised)."""
    source = torch.tensor(_EDITED_SOURCE, dtype=torch.float64, requires_grad=True)
    original = torch.sigmoid(source)  # SigmoidBackward0 saves this output for backward
    copy = editable_copy(original)
    if not (isinstance(copy, torch.Tensor) and copy.shape == original.shape):
        return copy, False, None, None
    in_graph = copy.requires_grad or copy.grad_fn is not None
    returned = copy.detach().clone()
    if in_graph:
        return returned, True, None, None
    copy.mul_(0)
    try:
        (grad,) = torch.autograd.grad(original.sum(), source)
    except RuntimeError as error:
        return returned, False, original.detach().clone(), torch_error_clause(error)
    return returned, False, original.detach().clone(), grad


def _require_tensor(result: object, shape: torch.Size, what: str) -> None:
    if not isinstance(result, torch.Tensor):
        raise NotYet(f"{what} returned a {type(result).__name__}, not a tensor")
    if result.shape != shape:
        raise NotYet(f"{what} has shape {tuple(result.shape)}, expected {tuple(shape)}")


def _require_close(got: torch.Tensor, want: torch.Tensor, what: str, should_be: str) -> None:
    difference = (got.to(torch.float64) - want).abs().nan_to_num(nan=float("inf")).max().item()
    if not difference <= 1e-9:
        raise NotYet(f"{what} {'differ' if what.endswith('s') else 'differs'} by up to {difference:.3g} from {should_be}")


# --------------------------------------------------------------------- 01.2


class _DetachedMiddle(nn.Module):
    """Three layers; the first block's output is detached, so `first` is unreachable."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 5)
        self.second = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.second(torch.relu(self.first(inputs)).detach())))


class _TwoHeads(nn.Module):
    """Two heads added together and one shared weight used twice: every parameter is reachable."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(4, 3)
        self.right = nn.Linear(4, 3)
        self.shared = nn.Parameter(torch.ones(3))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return (self.left(inputs) * self.shared).sum() + (self.right(inputs) * self.shared).sum()


class _FrozenAndUnused(nn.Module):
    """A frozen layer (not reported: it does not require grad) and a layer forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.used(self.frozen(inputs))


@exercise(
    "01.2",
    notebook=NOTEBOOK,
    title="find the parameters a loss cannot reach",
    hint=(
        "a node can have several inputs: how many entries does node.next_functions hold, and does your walk visit them all?",
        "the graph is a DAG: keep a list of nodes still to visit and a set of nodes already seen",
        (
            "the graph is a DAG, not a list: visit every (node, index) pair in node.next_functions, skip None, "
            "remember the nodes you have seen, and collect node.variable from the AccumulateGrad nodes"
        ),
    ),
    planted="but the unreachable parameters are",
    answer_apart=True,
)
def check_unreachable_parameters(unreachable_parameters: Callable) -> str:
    """Three models with known answers (from labkit's autograd_graph); backward must not run."""
    torch.manual_seed(0)
    inputs = torch.randn(6, 4)
    for model in (_DetachedMiddle(), _TwoHeads(), _FrozenAndUnused()):
        expected = list(autograd_graph(_scalar_output(model, inputs), model).unreachable_params)
        got, backward_ran = run_beside(unreachable_parameters, _walked_graph, model, inputs)
        name = type(model).__name__.lstrip("_")
        if backward_ran or any(p.grad is not None for p in model.parameters()):
            raise NotYet(f"on the {name} model your function ran backward (autograd computed gradients)",
                         hint="walk output.grad_fn and next_functions; never call backward")  # fmt: skip
        if not isinstance(got, list) or not all(isinstance(item, str) for item in got):
            raise NotYet(f"return a list of parameter names (str), not {type(got).__name__}")
        frozen = [n for n, p in model.named_parameters() if n in got and not p.requires_grad]
        if frozen:
            raise NotYet(
                f"on the {name} model you report {frozen}, which do not require grad: a frozen parameter gets no "
                "gradient by choice, and the question is which trainable ones the loss cannot reach",
                hint="leave out the parameters whose requires_grad is False",
            )
        if got != expected:
            raise NotYet(f"on the {name} model you report {got}, but the unreachable parameters are {expected}")
    return "the right parameters on a detached model, a two-head model with a shared weight and a frozen/unused one"


# --------------------------------------------------------------------- 01.3


@exercise(
    "01.3",
    notebook=NOTEBOOK,
    title="a copy you can safely edit",
    hint=(
        "after your copy is zeroed in place, look at t: do the two tensors share memory?",
        "detach() only cuts the graph; the storage and the version counter are still t's",
        "detach() shares storage and the version counter with the original; copy the values too (detach().clone())",
    ),
    planted="zeroing the copy in place changed the original: they share storage",
    answer_apart=True,
)
def check_editable_copy(editable_copy: Callable) -> str:
    """The copy is outside the graph; editing it leaves the original and its backward intact."""
    values = torch.sigmoid(torch.tensor(_EDITED_SOURCE, dtype=torch.float64))
    copy, in_graph, original_after, backward = run_beside(editable_copy, _edit_the_copy)
    _require_tensor(copy, values.shape, "editable_copy(t)")
    if in_graph:
        raise NotYet("the copy is still part of the autograd graph (it requires grad)")
    if not torch.equal(copy, values):
        raise NotYet("the copy does not hold t's values")
    if not torch.equal(original_after, values):
        raise NotYet("zeroing the copy in place changed the original: they share storage")
    if isinstance(backward, str):
        raise NotYet(f"after editing the copy, the original's backward fails ({backward})")
    if not torch.allclose(backward, values * (1 - values), rtol=0, atol=TOLERANCE):
        raise NotYet("after editing the copy, the original's gradient is wrong")
    return "the copy holds t's values outside the graph, and editing it leaves t and its backward intact"
