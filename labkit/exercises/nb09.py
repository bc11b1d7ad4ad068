"""Checks for the exercises of 09_residual_design (case M1).

09.1 carries the pre-activation lesson to a Transformer: a pre-norm sublayer, x + sublayer(norm(x))
(the planted bug normalises the sum, as the original post-norm Transformer does, so the skip is no
identity); 09.2 asks for the gradient survival rate, the share of non-zero entries
of the input gradient and its norm ratio (the planted bug counts only positive entries).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import NotYet, call_and_differentiate, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "09_residual_design"
TOLERANCE = 1e-9
WIDTH = 6


@exercise(
    "09.1",
    notebook=NOTEBOOK,
    title="a pre-norm Transformer sublayer",
    hint=(
        "zero the sublayer's last layer, so the branch adds nothing: is the block then the identity?",
        "the lesson of the pre-activation block carries over: the skip path must carry x itself, with the "
        "normalisation inside the branch only",
        "return x + sublayer(norm(x)): normalise the branch's input, never the sum and never the skip",
    ),
    planted="the normalisation is applied to the sum",
    answer_apart=True,
)
def check_prenorm_sublayer(prenorm_sublayer: Callable) -> str:
    """The block must be x + sublayer(norm(x)), and with a zeroed last layer pass x and its gradient exactly."""
    x = _inputs()
    norm, sublayer = _sublayer_parts(zero_last=False)
    got = _call(prenorm_sublayer, x, norm, sublayer)
    expected = x + sublayer(norm(x))
    if (got - expected).abs().max().item() > TOLERANCE:
        raise NotYet(_which_block(got, x, norm, sublayer))
    leaf = x.clone().requires_grad_()
    norm, sublayer = _sublayer_parts(zero_last=True)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    differentiated = call_and_differentiate(prenorm_sublayer, (leaf, norm, sublayer), wrt=(0,), upstream=upstream)
    out = _shaped_like_x(differentiated.result, x)
    if differentiated.gradients() is None:
        raise NotYet("with the sublayer's last layer zeroed, no gradient reaches x: the block's output is cut off "
                     "from the graph (detach or no_grad?)")
    (grad,) = differentiated.gradients()
    if grad is None:
        raise NotYet("with the sublayer's last layer zeroed, no gradient reaches x: the skip path must carry x")
    if not torch.equal(out.detach(), x) or not torch.equal(grad, upstream):
        raise NotYet("with the sublayer's last layer zeroed, the block is not an exact identity for x and its gradient")
    return "matches x + sublayer(norm(x)), and with a zeroed sublayer passes x and its gradient through exactly"


def _which_block(got: torch.Tensor, x: torch.Tensor, norm: nn.Module, sublayer: nn.Module) -> str:
    """Name the usual wrong placements of the normalisation, else say how far off the output is."""
    candidates = {
        "the normalisation is applied to the sum, norm(x + sublayer(x)) (the original post-norm Transformer), "
        "so even a zero sublayer changes x": norm(x + sublayer(x)),
        "the skip path carries norm(x), not x: norm(x) + sublayer(norm(x)) renormalises the input of every "
        "block, so a zero sublayer still changes x": norm(x) + sublayer(norm(x)),
        "the sublayer sees x itself: x + sublayer(x) has no normalisation at all": x + sublayer(x),
        "the normalisation is applied to the sublayer's output, x + norm(sublayer(x)): the sublayer's input is "
        "still unnormalised, and a zero sublayer's branch adds norm(0) (its bias) instead of nothing":
            x + norm(sublayer(x)),
        "there is no skip path: sublayer(norm(x)) alone, so the block cannot pass x (or its gradient) through":
            sublayer(norm(x)),
        "the normalisation is applied twice, in the branch and to the sum, norm(x + sublayer(norm(x))), so even a "
        "zero sublayer changes x": norm(x + sublayer(norm(x))),
    }  # fmt: skip
    for problem, wrong in candidates.items():
        if (got - wrong).abs().max().item() <= TOLERANCE:
            return problem
    return f"the output differs from x + sublayer(norm(x)) by up to {(got - x - sublayer(norm(x))).abs().max().item():.2g}"


def _inputs() -> torch.Tensor:
    return 2.0 + torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def _sublayer_parts(zero_last: bool) -> tuple[nn.Module, nn.Module]:
    """A LayerNorm with a non-trivial affine, and a two-layer MLP sublayer."""
    generator = torch.Generator().manual_seed(9)
    norm = nn.LayerNorm(WIDTH).double()
    sublayer = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)).double()
    with torch.no_grad():
        for parameter in [*norm.parameters(), *sublayer.parameters()]:
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
        if zero_last:
            sublayer[2].weight.zero_()
            sublayer[2].bias.zero_()
    return norm, sublayer


def _seeded_linear() -> nn.Linear:
    generator = torch.Generator().manual_seed(9)
    linear = nn.Linear(WIDTH, WIDTH).double()
    with torch.no_grad():
        for parameter in linear.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) / WIDTH**0.5)
    return linear


def _call(prenorm_sublayer: Callable, x: torch.Tensor, norm: nn.Module, sublayer: nn.Module) -> torch.Tensor:
    return _shaped_like_x(prenorm_sublayer(x, norm, sublayer), x)


def _shaped_like_x(out, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise NotYet(f"the block must return a tensor shaped like x {tuple(x.shape)}, got {getattr(out, 'shape', type(out).__name__)}")
    return out


@exercise(
    "09.2",
    notebook=NOTEBOOK,
    title="the gradient survival rate",
    hint=(
        "which gradient entries does your count leave out: are negative entries lost?",
        "an entry survived when it is not zero, whatever its sign",
        "count every entry that is not zero, (grad != 0): a negative gradient entry survived just as well",
    ),
    planted="of the input gradient's entries are not zero",
    answer_apart=True,
)
def check_gradient_survival(gradient_survival: Callable) -> str:
    """Against exact answers: an identity, a ReLU on half-negative inputs, and a linear map."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(32, WIDTH, generator=generator, dtype=torch.float64)
    upstream = torch.randn(32, WIDTH, generator=generator, dtype=torch.float64)
    # The last case is a vanishing gradient: every entry tiny but not zero, so every entry survived.
    cases = [("nn.Identity()", nn.Identity(), upstream), ("nn.ReLU()", nn.ReLU(), upstream),
             ("a Linear layer", _seeded_linear(), upstream),
             ("nn.Identity() with an upstream gradient of size 1e-8", nn.Identity(), 1e-8 * upstream)]
    for label, stack, upstream in cases:
        want_share, want_ratio = _reference(stack, x, upstream)
        got = gradient_survival(stack, x, upstream)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise NotYet(f"for {label}, expected a pair (share, ratio), got {got!r}")
        share, ratio = (float(v) for v in got)
        if abs(share - want_share) > TOLERANCE:
            raise NotYet(f"for {label}, the non-zero share is {share:.4f}, but {want_share:.4f} of the input gradient's entries are not zero")
        if abs(ratio - want_ratio) > TOLERANCE * max(1.0, want_ratio):
            raise NotYet(f"for {label}, the norm ratio is {ratio:.6g}, expected {want_ratio:.6g}")
    return (
        "exact on an identity, a ReLU, a Linear and a vanishing gradient: every non-zero entry counted, however "
        "small, and the norm ratio right"
    )


def _reference(stack: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> tuple[float, float]:
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    return (grad != 0).double().mean().item(), (grad.norm() / upstream.norm()).item()
