"""Checks for the exercises of 12_batch_size: the global batch (J3) and gradient noise (J2).

12.1 asks for the gradient that data-parallel devices with gradient accumulation apply, simulated
in one process (the planted bug divides by the accumulation steps only, as each real rank does, and
so forgets that the all-reduce averages over devices). 12.2 asks for the expected squared distance
between a batch's mean gradient and the full gradient (the planted bug gives the noise of a summed
gradient, which grows with the batch). Both fixtures are tiny float64 problems with exact answers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "12_batch_size"
FEATURES, CLASSES, ROWS = 6, 3, 24
# (devices, accumulation steps): micro-batches of 4 rows out of 24. Devices and steps differ, so a
# gradient off by either factor is told apart; one split keeps the check fast.
SPLITS = ((3, 2),)
TOLERANCE = 1e-10


@exercise(
    "12.1",
    notebook=NOTEBOOK,
    title="the gradient of a global batch",
    hint=(
        "the global batch is devices × accumulation_steps micro-batches, and the update is their average: "
        "divide each micro-batch's mean loss by devices * accumulation_steps"
    ),
    planted="the micro-batch losses were added where they should be averaged",
)
def check_global_batch_gradient(global_batch_gradient: Callable) -> str:
    """For each split of 24 rows, .grad must equal the 24-row batch gradient, one micro-batch per forward."""
    for devices, steps in SPLITS:
        model, x, y = _split_fixture()
        expected = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        before = [p.detach().clone() for p in model.parameters()]
        rows_per_forward = _count_rows(model)
        global_batch_gradient(model, x, y, devices, steps)
        _require_rows(rows_per_forward, len(x) // (devices * steps), devices, steps)
        if any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)):
            raise NotYet("the weights changed: only leave the gradient in .grad, take no optimizer step")
        _require_gradient(model, expected, devices, steps)
    return (
        f"{' and '.join(f'{d} devices × {s} steps' for d, s in SPLITS)} give the {ROWS}-row batch gradient "
        f"to {TOLERANCE:g}, one micro-batch per forward"
    )


def _split_fixture() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    x = torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    return model, x, y


def _count_rows(model: nn.Module) -> list[int]:
    rows: list[int] = []
    model.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    return rows


def _require_rows(rows: list[int], micro_rows: int, devices: int, steps: int) -> None:
    if not rows:
        raise NotYet("the model was never called: run each micro-batch through model(x_micro)")
    if max(rows) > micro_rows:
        raise NotYet(
            f"a forward took {max(rows)} rows, but with {devices} devices × {steps} accumulation steps a "
            f"micro-batch of {ROWS} rows has {micro_rows}",
            hint="split x into devices * accumulation_steps equal micro-batches, e.g. x.split(micro_rows)",
        )
    if sum(rows) != ROWS:
        raise NotYet(f"the forwards saw {sum(rows)} rows in all, but the global batch has {ROWS}")


def _require_gradient(model: nn.Module, expected: tuple, devices: int, steps: int) -> None:
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise NotYet("a parameter has no .grad: call backward on each micro-batch's loss")
    for label, factor in (("its devices", devices), ("its accumulation steps", steps),
                          ("devices × accumulation steps", devices * steps)):
        if _max_difference(grads, [factor * e for e in expected]) <= TOLERANCE * factor:
            raise NotYet(
                f"with {devices} devices × {steps} steps the gradient is {factor}× the batch gradient, "
                f"the factor of {label}: the micro-batch losses were added where they should be averaged"
            )
    difference = _max_difference(grads, list(expected))
    if difference > TOLERANCE:
        raise NotYet(
            f"with {devices} devices × {steps} steps .grad differs by {difference:.2g} from the gradient of "
            f"F.cross_entropy(model(x), y) over all {ROWS} rows"
        )


def _max_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a.detach() - b).abs().max().item() for a, b in zip(first, second))


@exercise(
    "12.2",
    notebook=NOTEBOOK,
    title="the noise of a batch gradient",
    hint=(
        "with s2 = mean over rows of ||g_i - g||^2, a mean over B rows drawn without replacement from N has "
        "E||g_B - g||^2 = s2 * (N - B) / (B * (N - 1))"
    ),
    planted="B² times too much",
)
def check_expected_gradient_noise(expected_gradient_noise: Callable) -> str:
    """Each batch size's answer must match the average over every possible batch, enumerated exactly."""
    per_sample = _per_sample_fixture()
    rows = len(per_sample)
    full = per_sample.mean(0)
    spread = (per_sample - full).pow(2).sum(1).mean().item()
    for batch in range(1, rows + 1):
        exact = _enumerated_noise(per_sample, batch)
        got = _as_float(expected_gradient_noise(per_sample.clone(), batch), batch)
        if math.isclose(got, exact, rel_tol=1e-9, abs_tol=1e-12):
            continue
        raise NotYet(_diagnose(got, exact, batch, rows, spread))
    return (
        f"for every batch size from 1 to {rows} the answer equals the average of ||g_B - g||^2 over all "
        "possible batches, down to 0 for the whole set"
    )


def _per_sample_fixture() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, generator=generator, dtype=torch.float64) + torch.tensor([1.0, -2.0, 0.5],
                                                                                       dtype=torch.float64)


def _enumerated_noise(per_sample: torch.Tensor, batch: int) -> float:
    full = per_sample.mean(0)
    batches = list(itertools.combinations(range(len(per_sample)), batch))
    total = sum((per_sample[list(rows)].mean(0) - full).pow(2).sum().item() for rows in batches)
    return total / len(batches)


def _as_float(value: object, batch: int) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise NotYet(f"for batch size {batch} you returned a tensor of shape {tuple(value.shape)}, not one number")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise NotYet(f"for batch size {batch} you returned a {type(value).__name__}, not a number")
    return float(value)


def _diagnose(got: float, exact: float, batch: int, rows: int, spread: float) -> str:
    where = f"for batches of {batch} out of {rows} rows you gave {got:.4g}, but the exact average is {exact:.4g}"
    if math.isclose(got, exact * batch**2, rel_tol=1e-6):
        return where + " (B² times too much: that is the noise of a summed gradient, which grows with the batch)"
    if math.isclose(got, spread / batch, rel_tol=1e-6):
        return where + " (s2 / B is the noise of rows drawn with replacement; a batch never repeats a row)"
    return where
