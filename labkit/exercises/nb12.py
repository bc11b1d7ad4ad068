"""Checks for the exercises of 12_batch_size: the global batch (J3) and gradient noise (J2).

12.1 asks for the gradient that data-parallel devices with gradient accumulation apply, simulated
in one process (the planted bug divides by the accumulation steps only, as each real rank does, and
so forgets that the all-reduce averages over devices). 12.2 turns J2's noise formula around: the
smallest batch whose expected squared noise E||g_B - g||^2 reaches a target (the planted bug uses
s2 / B, the noise of rows drawn with replacement, and asks for too large a batch). Both fixtures are tiny float64 problems with exact answers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, Recorder, by_how_much, exercise

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
        "count the micro-batches that make one global batch: how many losses are averaged?",
        "the update is the mean over devices * accumulation_steps micro-batches",
        (
            "the global batch is devices × accumulation_steps micro-batches, and the update is their average: "
            "divide each micro-batch's mean loss by devices * accumulation_steps"
        ),
    ),
    planted="the micro-batch losses were added where they should be averaged",
    answer_apart=True,
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
    """The rows of each forward of ``model`` from now on (a `Recorder`, so it counts in the answer's process too)."""
    recorder = Recorder(_rows_in)
    model.register_forward_pre_hook(recorder)
    return recorder.notes


def _rows_in(module: nn.Module, args: tuple) -> int:
    return len(args[0])


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
            f"with {devices} devices × {steps} steps .grad differs {by_how_much(difference)} from the gradient of "
            f"F.cross_entropy(model(x), y) over all {ROWS} rows"
        )


def _max_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a.detach() - b).abs().max().item() for a, b in zip(first, second))


@exercise(
    "12.2",
    notebook=NOTEBOOK,
    title="the batch size that reaches a noise target",
    hint=(
        "try your answer at the largest batch, B = N: how much noise does the mean over all N rows have?",
        "the noise of a batch mean is s2 / B only when rows may repeat; a batch drawn without replacement has "
        "the finite-population factor (N - B) / (N - 1), and the target compares squared quantities",
        (
            "with s2 = mean over rows of ||g_i - g||^2, E||g_B - g||^2 = s2 * (N - B) / (B * (N - 1)); return the "
            "smallest B in 1..N for which that is at most ratio * ||g||^2"
        ),
    ),
    planted="the answer for rows drawn with replacement",
    answer_apart=True,
)
def check_batch_for_noise(batch_for_noise: Callable) -> str:
    """For targets just above each batch size's exact noise, the answer must be that batch size."""
    per_sample = _per_sample_fixture()
    rows = len(per_sample)
    full = per_sample.mean(0)
    signal = full.pow(2).sum().item()
    spread = (per_sample - full).pow(2).sum(1).mean().item()
    exact = {batch: _enumerated_noise(per_sample, batch) for batch in range(1, rows + 1)}
    # Noise falls with B; a target just above B's noise (and below B - 1's) has the answer B.
    targets = [(exact[batch] / signal + MARGIN, batch) for batch in range(1, rows + 1)]
    # A target just below B's noise has the answer B + 1: it catches a formula that underestimates the noise
    # by a factor (N instead of N - 1), which every target just above a batch size's noise lets through.
    just_below = [(exact[batch] / signal * (1 - BELOW), batch + 1) for batch in range(1, rows)]
    for ratio, expected in [*reversed(targets), *just_below]:
        got = _as_batch(batch_for_noise(per_sample.clone(), ratio), ratio)
        if got != expected:
            raise NotYet(_diagnose(got, expected, ratio, rows, spread, signal, exact))
    return (
        f"for targets between {targets[-1][0]:.2g} and {targets[0][0]:.2g} x ||g||^2 your batch sizes match the "
        f"exact noise of every batch of {rows} rows drawn without replacement, down to B = {rows} for a target just above 0"
    )


# Targets sit this far (in units of ||g||^2) above a batch size's exact noise, so rounding cannot flip an answer.
MARGIN = 1e-9
# ... and this fraction below one, for the targets that must not be met by it.
BELOW = 1e-6


def _as_batch(value: object, ratio: float) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise NotYet(f"for ratio {ratio:.3g} you returned a {type(value).__name__}, not a whole batch size")
    return value


def _diagnose(got: int | None, expected: int, ratio: float, rows: int, spread: float, signal: float,
              exact: dict[int, float]) -> str:
    where = (f"for a target of {ratio:.3g} x ||g||^2 you answered {got}, but B = {expected} is the smallest batch "
             f"whose expected noise ({exact[expected]:.3g}) is at most {ratio * signal:.3g}")
    with_replacement = next((b for b in range(1, rows + 1) if spread / b <= ratio * signal), None)
    if got == with_replacement:
        return where + (" (that is the answer for rows drawn with replacement, s2 / B: a batch never repeats a row, "
                        f"so its noise falls faster, to 0 at B = {rows})")
    unsquared = next((b for b in range(1, rows + 1) if exact[b] <= ratio**2 * signal), None)
    if got == unsquared:
        return where + (" (that answers the target for the unsquared noise, ||g_B - g|| <= ratio * ||g||: the "
                        "target here compares the squared noise with ratio * ||g||^2)")
    over_n = next((b for b in range(1, rows + 1) if exact[b] * (rows - 1) / rows <= ratio * signal), None)
    if got == over_n:
        return where + (f" (that is the noise with the finite-population factor (N - B) / N; drawing B of {rows} rows "
                        "without replacement gives (N - B) / (N - 1))")
    return where


def _per_sample_fixture() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, generator=generator, dtype=torch.float64) + torch.tensor([1.0, -2.0, 0.5],
                                                                                       dtype=torch.float64)


def _enumerated_noise(per_sample: torch.Tensor, batch: int) -> float:
    full = per_sample.mean(0)
    batches = list(itertools.combinations(range(len(per_sample)), batch))
    total = sum((per_sample[list(rows)].mean(0) - full).pow(2).sum().item() for rows in batches)
    return total / len(batches)
