"""Checks for the exercises of 09_residual_design (case M1).

09.1 asks for a pre-activation residual block (the planted bug keeps a ReLU after the addition, so
the skip is no identity); 09.2 asks for the gradient survival rate, the share of non-zero entries
of the input gradient and its norm ratio (the planted bug counts only positive entries).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "09_residual_design"
TOLERANCE = 1e-9
WIDTH = 6


@exercise(
    "09.1",
    notebook=NOTEBOOK,
    title="a pre-activation block",
    hint="return x + lin2(relu(bn2(lin1(relu(bn1(x)))))) and apply nothing to the sum: no ReLU after the addition",
    planted="a ReLU is applied after the addition",
)
def check_preact_block(preact_block: Callable) -> str:
    """The block must match the v2 formula, and with a zeroed last layer pass x and its gradient exactly."""
    x = _inputs()
    parts = _parts(zero_last=False)
    expected = x + parts[3](F.relu(parts[2](parts[1](F.relu(parts[0](x))))))
    got = _call(preact_block, x, parts)
    if (got - expected).abs().max().item() > TOLERANCE:
        negatives_lost = bool((expected < 0).any()) and not bool((got < 0).any())
        if negatives_lost:
            raise NotYet("the block's output has no negative entries: a ReLU is applied after the addition")
        raise NotYet(f"the output differs from x + lin2(relu(bn2(lin1(relu(bn1(x)))))) by up to {(got - expected).abs().max().item():.2g}")
    leaf = x.clone().requires_grad_()
    zeroed = _parts(zero_last=True)
    out = _call(preact_block, leaf, zeroed)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, leaf, upstream)
    if not torch.equal(out.detach(), x) or not torch.equal(grad, upstream):
        raise NotYet("with the branch's last layer zeroed, the block is not an exact identity for x and its gradient")
    return "matches the pre-activation formula, and with a zero branch passes x and its gradient through exactly"


def _inputs() -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def _parts(zero_last: bool) -> list[nn.Module]:
    parts = [nn.BatchNorm1d(WIDTH).double(), _seeded_linear(), nn.BatchNorm1d(WIDTH).double(), _seeded_linear()]
    if zero_last:
        with torch.no_grad():
            parts[3].weight.zero_()
            parts[3].bias.zero_()
    return parts


def _seeded_linear() -> nn.Linear:
    generator = torch.Generator().manual_seed(9)
    linear = nn.Linear(WIDTH, WIDTH).double()
    with torch.no_grad():
        for parameter in linear.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) / WIDTH**0.5)
    return linear


def _call(preact_block: Callable, x: torch.Tensor, parts: list[nn.Module]) -> torch.Tensor:
    out = preact_block(x, *parts)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise NotYet(f"the block must return a tensor shaped like x {tuple(x.shape)}, got {getattr(out, 'shape', type(out).__name__)}")
    return out


@exercise(
    "09.2",
    notebook=NOTEBOOK,
    title="the gradient survival rate",
    hint="count every entry that is not zero, (grad != 0): a negative gradient entry survived just as well",
    planted="of the input gradient's entries are not zero",
)
def check_gradient_survival(gradient_survival: Callable) -> str:
    """Against exact answers: an identity, a ReLU on half-negative inputs, and a linear map."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(32, WIDTH, generator=generator, dtype=torch.float64)
    upstream = torch.randn(32, WIDTH, generator=generator, dtype=torch.float64)
    cases = [("nn.Identity()", nn.Identity()), ("nn.ReLU()", nn.ReLU()), ("a Linear layer", _seeded_linear())]
    for label, stack in cases:
        want_share, want_ratio = _reference(stack, x, upstream)
        got = gradient_survival(stack, x, upstream)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise NotYet(f"for {label}, expected a pair (share, ratio), got {got!r}")
        share, ratio = (float(v) for v in got)
        if abs(share - want_share) > TOLERANCE:
            raise NotYet(f"for {label}, the non-zero share is {share:.4f}, but {want_share:.4f} of the input gradient's entries are not zero")
        if abs(ratio - want_ratio) > TOLERANCE * max(1.0, want_ratio):
            raise NotYet(f"for {label}, the norm ratio is {ratio:.6g}, expected {want_ratio:.6g}")
    return "exact on an identity, a ReLU and a Linear: every non-zero entry counted, and the norm ratio right"


def _reference(stack: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> tuple[float, float]:
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    return (grad != 0).double().mean().item(), (grad.norm() / upstream.norm()).item()
