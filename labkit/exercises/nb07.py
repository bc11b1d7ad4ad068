"""Checks for the exercises of 07_gradient_clipping (cases F2 and F4).

07.1 asks for clipping by the joint L2 norm of a list of gradients, as `clip_grad_norm_` does (the
planted bug clips each tensor on its own, which turns the gradient). 07.2 asks for a step that is
skipped when the total gradient norm is not finite (the planted bug only catches an infinite norm,
so a NaN walks into the weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import NotYet, by_how_much, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "07_gradient_clipping"
TOLERANCE = 1e-9
LEARNING_RATE = 0.1


@exercise(
    "07.1",
    notebook=NOTEBOOK,
    title="clip by the total norm",
    hint=(
        "does every tensor get the same scale factor? the total norm is one number for all tensors together",
        "measure the joint L2 norm over all gradients, then multiply all of them by one factor, and only when that norm is above max_norm",
        (
            "measure one norm over all tensors together, sqrt(sum of every g*g), and multiply every tensor by the "
            "same factor min(1, max_norm / (total + 1e-6))"
        ),
    ),
    planted="each tensor was scaled by its own factor",
    answer_apart=True,
)
def check_clip_total_norm(clip_total_norm_: Callable) -> str:
    """Against torch's clip_grad_norm_ on three fixtures: one clipped, one left alone, one single tensor."""
    for label, grads, max_norm in _clip_fixtures():
        expected, expected_total = _reference_clip(grads, max_norm)
        given = [g.clone() for g in grads]
        total = clip_total_norm_(given, max_norm)
        _require_total(total, expected_total, label)
        _require_clipped(given, expected, grads, max_norm, label)
    return "matches clip_grad_norm_ on every fixture: one scale factor for all tensors, direction kept, norm returned"


def _clip_fixtures() -> list[tuple[str, list[torch.Tensor], float]]:
    generator = torch.Generator().manual_seed(7)

    def tensor(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    return [
        ("three tensors of different sizes, joint norm above max_norm", [tensor(6, 4, scale=0.05), tensor(4, scale=0.6), tensor(10, scale=2.0)], 1.0),
        ("three tensors whose joint norm is below max_norm", [tensor(5, scale=0.01), tensor(3, 3, scale=0.02), tensor(2, scale=0.03)], 1.0),
        ("one tensor with norm above max_norm", [tensor(20, scale=1.0)], 0.5),
    ]  # fmt: skip


def _reference_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], float]:
    holders = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for holder, grad in zip(holders, grads):
        holder.grad = grad.clone()
    total = torch.nn.utils.clip_grad_norm_(holders, max_norm).item()
    return [h.grad for h in holders], total


def _require_total(total: object, expected: float, label: str) -> None:
    try:
        value = float(total)
    except (TypeError, ValueError):
        raise NotYet(f"on {label}, your function returned {type(total).__name__}, not the total norm") from None
    if not abs(value - expected) <= TOLERANCE * max(1.0, expected):
        raise NotYet(
            f"on {label}, your function returned {value:.6g}, but the joint L2 norm of all the gradients "
            f"before clipping is {expected:.6g}"
        )


def _require_clipped(
    given: list[torch.Tensor], expected: list[torch.Tensor], original: list[torch.Tensor], max_norm: float, label: str
) -> None:
    worst = max((g - e).abs().max().item() for g, e in zip(given, expected))
    if worst <= TOLERANCE:
        return
    joint = torch.sqrt(sum((g * g).sum() for g in given)).item()
    flat_given = torch.cat([g.reshape(-1) for g in given])
    flat_original = torch.cat([g.reshape(-1) for g in original])
    turn = (flat_given @ flat_original / (flat_given.norm() * flat_original.norm())).item()
    if all(torch.equal(g, o) for g, o in zip(given, original)) and joint > max_norm:
        raise NotYet(f"on {label}, the tensors were not changed in place (joint norm still {joint:.3g})")
    if turn < 1 - 1e-9:
        raise NotYet(
            f"on {label}, the clipped gradient points in another direction (cosine {turn:.4f} to the original): "
            "each tensor was scaled by its own factor"
        )
    raise NotYet(f"on {label}, the clipped values differ from clip_grad_norm_'s by up to {worst:.2g} (joint norm {joint:.4g})")


@exercise(
    "07.2",
    notebook=NOTEBOOK,
    title="skip a step whose gradient is not finite",
    hint=(
        "is a NaN bigger than any threshold, or equal to inf? try it: float('nan') > 1e9",
        "every comparison with NaN is False, so the test must ask whether the norm is finite",
        "a NaN norm is not equal to inf; test with torch.isfinite(total) (or math.isfinite), which is False for both",
    ),
    planted="with a NaN value in one gradient, your function changed the weights",
    answer_apart=True,
)
def check_guarded_step(guarded_step: Callable) -> str:
    """A NaN and an inf gradient must leave the weights alone; a finite one must clip and step."""
    for label, bad_value in (("a NaN", math.nan), ("an infinite", math.inf)):
        model, optimizer = _guard_fixture(bad_value)
        before = [p.detach().clone() for p in model.parameters()]
        stepped = guarded_step(model, optimizer, 1.0)
        if any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)):
            raise NotYet(f"with {label} value in one gradient, your function changed the weights")
        if stepped is not False:
            raise NotYet(f"with {label} value in one gradient, your function returned {stepped!r} instead of False")
    model, optimizer = _guard_fixture(None)
    expected = _clipped_sgd_reference(model, 1.0)
    stepped = guarded_step(model, optimizer, 1.0)
    if stepped is not True:
        raise NotYet(f"with a finite gradient, your function returned {stepped!r} instead of True")
    worst = max((p.detach() - e).abs().max().item() for p, e in zip(model.parameters(), expected))
    if worst > TOLERANCE:
        raise NotYet(
            f"with a finite gradient, the weights differ {by_how_much(worst)} from one SGD step on the gradient "
            "clipped to max_norm",
            hint="clip with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before optimizer.step()",
        )
    return "NaN and inf gradients are skipped with the weights untouched; a finite gradient is clipped and applied"


def _guard_fixture(bad_value: float | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(7)
    model = nn.Linear(4, 2).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
            parameter.grad = torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 3.0
        if bad_value is not None:
            model.weight.grad[1, 2] = bad_value
    return model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def _clipped_sgd_reference(model: nn.Module, max_norm: float) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = min(1.0, max_norm / (total.item() + 1e-6))
    return [p.detach() - LEARNING_RATE * scale * g for p, g in zip(model.parameters(), grads)]
