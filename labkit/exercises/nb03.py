"""Checks for the exercises of 03_inplace_ops: in-place ops, a LayerNorm's eps, and gradcheck.

03.1 asks for a LayerNorm that trains (the planted bug divides in place a tensor autograd saved,
so backward raises, and has no eps, so a constant row is 0/0). 03.2 asks for the backward of a
custom row-wise Euclidean distance Function (the planted bug reuses the squared distance's
derivative); the check runs `torch.autograd.gradcheck` in float64, as case C4 of the notebook does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.exercises import Hint, NotYet, call_and_differentiate, exercise, torch_error_clause

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "03_inplace_ops"
TOLERANCE = 1e-9


@exercise(
    "03.1",
    notebook=NOTEBOOK,
    title="a LayerNorm that trains",
    hint=(
        "two symptoms: backward raises (read its message: 'modified by an inplace operation'), and a constant row gives NaN",
        "the division writes into a tensor autograd saved for backward, and a constant row has variance 0",
        (
            "divide out of place (centred / std, not centred.div_(std)): the variance saved `centred` for backward; "
            "and put eps under the square root, torch.sqrt(variance + eps), so a constant row is not 0/0"
        ),
    ),
    planted=(
        "backward through your output raised RuntimeError: one of the variables needed for "
        "gradient computation has been modified by an inplace operation"
    ),
    answer_apart=True,
)
def check_layer_norm_rows(layer_norm_rows: Callable) -> str:
    """Values and gradients must match F.layer_norm on random and constant rows, for two eps values."""
    generator = torch.Generator().manual_seed(0)
    random_rows = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    upstream = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    constant_rows = torch.full((2, 8), 3.0, dtype=torch.float64)
    for eps in (1e-5, 0.5):
        for label, rows in (("random rows", random_rows), ("constant rows", constant_rows)):
            _require_matches_layer_norm(layer_norm_rows, rows, upstream[: len(rows)], eps, label)
    return "values and gradients match F.layer_norm for random and constant rows, for eps 1e-5 and 0.5"


def _require_matches_layer_norm(layer_norm_rows: Callable, rows: torch.Tensor, upstream: torch.Tensor,
                                eps: float, label: str) -> None:
    out, grad = _output_and_gradient(layer_norm_rows, rows, upstream, eps, label)
    reference_x = rows.clone().requires_grad_()
    reference = F.layer_norm(reference_x, (rows.shape[-1],), eps=eps)
    (expected,) = torch.autograd.grad((reference * upstream).sum(), reference_x)
    if not torch.isfinite(out).all():
        raise NotYet(f"on {label} with eps={eps:g} the output holds NaN or inf (a constant row has variance 0)")
    if not torch.allclose(out, reference, rtol=0, atol=TOLERANCE):
        gap = (out - reference).abs().max().item()
        mistake, hint = _which_normalisation(out.detach(), rows, eps)
        raise NotYet(f"on {label} with eps={eps:g} the output differs from F.layer_norm by up to {gap:.2g}{mistake}",
                     hint=hint)
    if not torch.allclose(grad, expected, rtol=0, atol=1e-6):
        gap = (grad - expected).abs().max().item()
        raise NotYet(f"on {label} with eps={eps:g} the gradient differs from F.layer_norm's by up to {gap:.2g}")


def _which_normalisation(out: torch.Tensor, rows: torch.Tensor, eps: float) -> tuple[str, Hint | None]:
    """(the mistake, its hint) when the output matches a likely wrong normalisation, else ("", None)."""
    centred = rows - rows.mean(-1, keepdim=True)
    candidates = [
        (": it matches the normalisation without eps, so eps never reached the variance",
         ("where in the normalisation does eps belong, and does your division see it?",
          "LayerNorm divides by sqrt(variance + eps): eps goes inside the square root"),
         centred / centred.pow(2).mean(-1, keepdim=True).sqrt()),
        (": it divides by the unbiased variance (n - 1 in the denominator), where LayerNorm uses the mean of the "
         "squared deviations",
         ("which variance does LayerNorm use: divided by n, or by n - 1?",
          "LayerNorm's variance is the plain mean of the squared deviations (unbiased=False)"),
         centred / (rows.var(-1, keepdim=True) + eps).sqrt()),
    ]  # fmt: skip
    for mistake, hint, wrong in candidates:
        if torch.isfinite(wrong).all() and torch.allclose(out, wrong, rtol=0, atol=TOLERANCE):
            return mistake, hint
    return "", None


def _output_and_gradient(layer_norm_rows: Callable, rows: torch.Tensor, upstream: torch.Tensor,
                         eps: float, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's output and the gradient backward sends into x, after the structural checks."""
    x = rows.clone().requires_grad_()
    differentiated = call_and_differentiate(layer_norm_rows, (x, eps), wrt=(0,), upstream=upstream, watch=True)
    out = differentiated.result
    built_in = sorted(differentiated.called & _BUILT_IN_NORMS)
    if built_in:
        raise NotYet(
            f"your function calls torch's own {built_in[0]}, so it shows nothing about the in-place division and "
            "the missing eps that break the planted version",
            hint="write the normalisation yourself: centre each row, divide by the square root of its variance plus eps",
        )
    if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
        raise NotYet(f"on {label} it returned {_describe(out)}, not a tensor shaped like x {tuple(rows.shape)}")
    if not torch.equal(x.detach(), rows):
        raise NotYet("it changed the values of its input x", hint="compute new tensors; never write into x")
    if not out.requires_grad:
        raise NotYet("the output does not require grad, so no gradient can reach x",
                     hint="avoid torch.no_grad() and .detach() inside the function")
    try:
        (grad,) = differentiated.gradients()
    except RuntimeError as error:
        raise NotYet(f"backward through your output raised RuntimeError: {torch_error_clause(error)}") from error
    return out, grad


# By name, as a call watched in the answer's own process reports them.
_BUILT_IN_NORMS = {f.__name__ for f in (F.layer_norm, torch.layer_norm, torch.native_layer_norm, F.group_norm,
                                        F.instance_norm, F.rms_norm, torch.rms_norm)}


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


@exercise(
    "03.2",
    notebook=NOTEBOOK,
    title="a custom backward that gradcheck accepts",
    hint=(
        "the distance is not squared here: differentiate ||a_i - b_i|| itself, not ||a_i - b_i||^2",
        "the derivative of a norm is the unit vector along a_i - b_i, and each row is scaled by its own grad_output[i]",
        (
            "the derivative of ||a_i - b_i|| with respect to a_i is (a_i - b_i) / ||a_i - b_i||, and minus that for "
            "b_i; scale each row by its grad_output[i] (grad_output[:, None] broadcasts over the columns)"
        ),
    ),
    planted="gradcheck in float64 rejects your backward",
    answer_apart=True,
)
def check_distance_backward(distance_backward: Callable) -> str:
    """gradcheck in float64, with a tight rtol, on three shapes; then a direct comparison for the message."""
    function = _custom_function(distance_backward)
    generator = torch.Generator().manual_seed(0)
    shapes = ((4, 3), (1, 5), (6, 2))
    for shape in shapes:
        a, b = (torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_() for _ in range(2))
        _require_gradient_shapes(distance_backward, a, b)
        if not torch.autograd.gradcheck(function, (a, b), rtol=1e-7, raise_exception=False):
            raise NotYet(f"gradcheck in float64 rejects your backward on inputs of shape {shape}: "
                         + _which_side_is_wrong(distance_backward, a, b))
    return f"gradcheck in float64 (rtol=1e-7) accepts your backward on {len(shapes)} input shapes"


def _custom_function(backward: Callable) -> Callable:
    class Distance(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return (a - b).norm(dim=1)

        @staticmethod
        def backward(ctx, grad_output):
            grad_a, grad_b = backward(grad_output, *ctx.saved_tensors)
            return grad_a, grad_b

    return Distance.apply


def _require_gradient_shapes(backward: Callable, a: torch.Tensor, b: torch.Tensor) -> None:
    # Called as autograd calls a backward: grad mode off. A graph built in here is autograd doing the calculus.
    with torch.no_grad():
        watched = call_and_differentiate(backward, (torch.ones(len(a), dtype=a.dtype), a.detach(), b.detach()),
                                         wrt=(), watch=True)
    result = watched.result
    if watched.built_graph:
        raise NotYet(
            "your backward builds an autograd graph of its own and lets autograd differentiate the distance, "
            "so the derivative is never written down",
            hint="derive d||a_i - b_i|| / d a_i by hand (the derivative of a norm) and compute it with plain tensor ops",
        )
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise NotYet(f"it returned {type(result).__name__}, not the pair (grad_a, grad_b)")
    for name, grad in zip(("grad_a", "grad_b"), result):
        if not isinstance(grad, torch.Tensor) or grad.shape != a.shape:
            shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise NotYet(f"{name} has shape {shape}, but it must be shaped like a {tuple(a.shape)}")


def _same(got: object, want: torch.Tensor) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def _which_side_is_wrong(backward: Callable, a: torch.Tensor, b: torch.Tensor) -> str:
    grad_output = torch.linspace(0.5, 1.5, len(a), dtype=a.dtype)
    difference = (a - b).detach()
    expected_a = grad_output[:, None] * difference / difference.norm(dim=1, keepdim=True)
    grad_a, grad_b = backward(grad_output, a.detach(), b.detach())
    wrong = [name for name, got, want in (("dL/da", grad_a, expected_a), ("dL/db", grad_b, -expected_a))
             if not torch.allclose(got, want, rtol=1e-9, atol=1e-12)]
    unweighted = difference / difference.norm(dim=1, keepdim=True)
    if "dL/da" in wrong and _same(grad_a, unweighted):
        return "dL/da is dd/da alone: the chain rule multiplies it by grad_output, row by row"
    if "dL/da" in wrong and _same(grad_a, grad_output[:, None] * difference / difference.pow(2).sum(1, keepdim=True)):
        return "dL/da divides by the squared distance; the derivative of ||a - b|| divides by the distance itself"
    if not wrong:
        return "the gradients disagree with finite differences"
    return f"{' and '.join(wrong)} {'differ' if len(wrong) > 1 else 'differs'} from the true derivative"
