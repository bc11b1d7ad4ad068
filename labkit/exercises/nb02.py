"""Checks for the exercises of 02_gradients_accumulate.

02.1 asks for a clipped optimizer step (the planted bug calls `zero_grad()` between `backward()` and
`clip_grad_norm_`, so it clips nothing and steps with nothing: claim B7). 02.2 asks for gradient
accumulation over micro-batches that equals the full-batch gradient even when the last micro-batch
is short (the planted bug divides each micro-batch's mean loss by the number of micro-batches: B4)
and some labels are -100, cross_entropy's ignore_index, so that the mean counts labelled rows, not
rows: weighting each micro-batch by its rows, as the notebook's own helper does, is not enough.
Every fixture is float64 on the CPU, so the references are exact to rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, Recorder, by_how_much, exercise, run_beside

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "02_gradients_accumulate"
TOLERANCE = 1e-9

# 02.1: a linear model whose gradient norm is well above MAX_NORM, so clipping always acts.
LEARNING_RATE = 0.1
MAX_NORM = 0.05
STEPS = 3
FEATURES, OUTPUTS, ROWS = 4, 2, 16
# clip_grad_norm_ divides by (total_norm + 1e-6); the reference does the same.
CLIP_EPSILON = 1e-6
# A norm taken after clipping is max_norm * norm / (norm + CLIP_EPSILON): max_norm to about 1e-5.
CLIPPED_NORM_TOLERANCE = 1e-4

# 02.2: (rows, micro_batch) splits: ragged, ragged with a short tail, equal, and one piece.
SPLITS = ((30, 8), (10, 4), (32, 8), (7, 16))
IN_FEATURES, HIDDEN, CLASSES = 6, 5, 3
UNLABELLED = -100  # F.cross_entropy's default ignore_index: these rows do not count in its mean


@exercise(
    "02.1",
    notebook=NOTEBOOK,
    title="clip the gradient you are about to use",
    hint=(
        "print the norm your function measures: what does .grad hold at the moment you clip?",
        "zero_grad() empties .grad, so it must come before backward, never between backward and the clip",
        (
            "the order is optimizer.zero_grad(), loss.backward(), clip_grad_norm_, optimizer.step(): after "
            "zero_grad() there is no gradient left to clip (claim B7)"
        ),
    ),
    planted="clip_grad_norm_ ran when .grad held no gradient",
    answer_apart=True,
)
def check_clipped_step(clipped_step: Callable) -> str:
    """Three clipped steps must match SGD on this batch's clipped gradient, and report its norm."""
    model, batches = _clip_fixture()
    start = [p.detach().clone() for p in model.parameters()]
    stale = [p.grad.clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    params = start
    for step, (x, y) in enumerate(batches, start=1):
        expected_norm, clipped_params, unclipped_params, stale_norm = _clip_reference(params, x, y, stale)
        before = [p.detach().clone() for p in model.parameters()]
        reported = run_beside(clipped_step, _step_on_the_loss, model, optimizer, x, y)
        _require_norm(reported, expected_norm, stale_norm, step)
        after = [p.detach() for p in model.parameters()]
        _require_clipped_update(after, before, clipped_params, unclipped_params, step)
        params, stale = [p.clone() for p in after], [torch.zeros_like(p) for p in after]
    return (
        f"{STEPS} steps report the gradient norm before clipping and move the weights by the clipped "
        f"gradient, even with a stale gradient left in .grad"
    )


def _step_on_the_loss(clipped_step: Callable, model: nn.Module, optimizer: torch.optim.Optimizer,
                      x: torch.Tensor, y: torch.Tensor) -> object:
    """The answer's step on this batch's loss, made where the answer runs: a loss's graph does not cross."""
    return clipped_step(model, optimizer, F.mse_loss(model(x), y), MAX_NORM)


def _clip_fixture() -> tuple[nn.Linear, list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(2)
    model = nn.Linear(FEATURES, OUTPUTS).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64)
        return x, torch.randn(ROWS, OUTPUTS, generator=generator, dtype=torch.float64)

    # An earlier backward pass (an inspection, a logging step) leaves a gradient in .grad.
    stale_x, stale_y = batch()
    F.mse_loss(model(stale_x), stale_y).backward()
    return model, [batch() for _ in range(STEPS)]


def _clip_reference(
    params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, stale: list[torch.Tensor]
) -> tuple[float, list[torch.Tensor], list[torch.Tensor], float]:
    """This batch's gradient norm, the params after a clipped and after an unclipped step, and the norm
    the gradient would have with the stale one added."""
    leaves = [p.clone().requires_grad_() for p in params]
    grads = torch.autograd.grad(F.mse_loss(F.linear(x, *leaves), y), leaves)
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    scale = min(1.0, MAX_NORM / (norm + CLIP_EPSILON))
    clipped = [p - LEARNING_RATE * scale * g for p, g in zip(params, grads)]
    unclipped = [p - LEARNING_RATE * g for p, g in zip(params, grads)]
    stale_norm = torch.linalg.vector_norm(torch.cat([(g + s).flatten() for g, s in zip(grads, stale)])).item()
    return norm, clipped, unclipped, stale_norm


def _require_norm(reported: object, expected: float, stale_norm: float, step: int) -> None:
    if isinstance(reported, torch.Tensor) or not isinstance(reported, (int, float)) or isinstance(reported, bool):
        raise NotYet(
            f"step {step} returned a {type(reported).__name__}, not the norm as a Python float",
            hint="return float(total_norm), where total_norm is what clip_grad_norm_ returns",
        )
    if reported == 0:
        raise NotYet(
            f"step {step} reported a gradient norm of 0: clip_grad_norm_ ran when .grad held no gradient "
            "(zero_grad() had already cleared it), so it clipped nothing"
        )
    if abs(reported - expected) <= TOLERANCE * expected:
        return
    if abs(reported - MAX_NORM) <= CLIPPED_NORM_TOLERANCE * MAX_NORM:
        raise NotYet(
            f"step {step} reported {reported:.4g}, which is max_norm itself: the norm of the gradient after "
            f"clipping, not the norm of this batch's gradient ({expected:.4g}) that clipping scaled down",
            hint=(
                "which norm tells you how far the gradient was from the limit: the one before or after clipping?",
                "clip_grad_norm_ measures the total norm, scales .grad down and returns what it measured; a norm "
                "taken afterwards is max_norm every time",
            ),
        )
    if abs(reported - stale_norm) <= TOLERANCE * stale_norm:
        raise NotYet(
            f"step {step} reported the norm of this batch's gradient plus an old one left in .grad",
            hint="call optimizer.zero_grad() before loss.backward(), so .grad holds only this batch's gradient",
        )
    raise NotYet(
        f"step {step} reported a norm of {reported:.4g}, but this batch's gradient norm is {expected:.4g}",
        hint="report the total norm of all the parameters' gradients together, before clipping, as clip_grad_norm_ returns it",
    )


def _require_clipped_update(
    after: list[torch.Tensor],
    before: list[torch.Tensor],
    clipped: list[torch.Tensor],
    unclipped: list[torch.Tensor],
    step: int,
) -> None:
    if _max_difference(after, clipped) <= TOLERANCE:
        return
    if _max_difference(after, before) == 0:
        raise NotYet(
            f"the weights did not move in step {step}",
            hint="call optimizer.step() after clipping, while .grad still holds the clipped gradient",
        )
    if _max_difference(after, unclipped) <= TOLERANCE:
        raise NotYet(
            f"step {step} moved the weights by the unclipped gradient",
            hint="clip between loss.backward() and optimizer.step(): clipping after the step changes nothing",
        )
    raise NotYet(
        f"after step {step} the weights differ {by_how_much(_max_difference(after, clipped))} from one SGD step "
        f"on this batch's gradient clipped to max_norm",
        hint="max_norm limits the norm of all the gradients together: scale every parameter's gradient by one factor",
    )


@exercise(
    "02.2",
    notebook=NOTEBOOK,
    title="accumulate micro-batches into the full-batch gradient",
    hint=(
        (
            "the check splits 30 rows into 8 + 8 + 8 + 6, and some labels are -100, which F.cross_entropy ignores: "
            "how many rows does the full-batch mean count, and how much does each of your micro-batches count?"
        ),
        "the full-batch mean weighs every labelled row by 1 / (the number of labelled rows in y), whichever "
        "micro-batch it is in; a row labelled -100 weighs nothing",
        (
            "sum each micro-batch's per-row losses (reduction='sum', which skips the labels -100) and divide by "
            "(y != -100).sum(), the labelled rows of the whole batch, so each micro-batch counts as much as its "
            "labelled rows (claim B4)"
        ),
    ),
    planted="gives the short last micro-batch the weight of a full one",
    answer_apart=True,
)
def check_accumulate_gradients(accumulate_gradients: Callable) -> str:
    """.grad must equal the full-batch mean-loss gradient, with no forward pass over micro_batch rows."""
    for rows, micro_batch in SPLITS:
        model, x, y = _accumulation_fixture(rows)
        expected = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        start = [p.detach().clone() for p in model.parameters()]
        forwards = Recorder(_rows_in)  # a Recorder, not a closure: it also counts in an answer's own process
        handle = model.register_forward_pre_hook(forwards)
        try:
            accumulate_gradients(model, x, y, micro_batch)
        finally:
            handle.remove()
        _require_micro_batches(forwards.notes, micro_batch, rows)
        if _max_difference([p.detach() for p in model.parameters()], start) != 0:
            raise NotYet("your function changed the weights", hint="only call backward here; the step comes later")
        _require_full_batch_gradient(model, x, y, expected, micro_batch)
    splits = ", ".join(f"{rows} rows in micro-batches of {micro}" for rows, micro in SPLITS)
    return f".grad equals the full-batch gradient for {splits}"


def _accumulation_fixture(rows: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    model = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    x = torch.randn(rows, IN_FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    y[: rows // 2 : 2] = UNLABELLED  # the first micro-batches hold the unlabelled rows, the last ones none
    return model, x, y


def _rows_in(module: nn.Module, args: tuple) -> int:
    return len(args[0])


def _require_micro_batches(widest: list[int], micro_batch: int, rows: int) -> None:
    if not widest:
        raise NotYet("your function never ran the model", hint="run model(x_piece) on each micro-batch")
    if max(widest) > micro_batch:
        raise NotYet(
            f"with micro_batch={micro_batch} your function ran the model on {max(widest)} rows at once",
            hint="split x and y with x.split(micro_batch) and run one forward and backward per piece",
        )


def _require_full_batch_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, expected: tuple[torch.Tensor, ...], micro_batch: int
) -> None:
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise NotYet(
            "some parameters have no .grad after your function", hint="call backward on each micro-batch's loss"
        )
    if _max_difference(grads, list(expected)) <= TOLERANCE:
        return
    pieces = len(x.split(micro_batch))
    labelled = int((y != UNLABELLED).sum())
    mean_of_means = _weighted_gradient(model, x, y, micro_batch, lambda piece: 1 / pieces)
    unscaled = _weighted_gradient(model, x, y, micro_batch, lambda piece: 1.0)
    by_rows = _weighted_gradient(model, x, y, micro_batch, lambda piece: len(piece) / len(y))
    if _max_difference(grads, by_rows) <= TOLERANCE:
        first = y.split(micro_batch)[0]
        raise NotYet(
            f"you weighed each micro-batch by its rows, but F.cross_entropy's mean leaves out the rows labelled "
            f"{UNLABELLED} (its ignore_index): it divides by the {labelled} labelled rows of {len(y)}, and your first "
            f"micro-batch has {int((first != UNLABELLED).sum())} labelled rows of {len(first)}"
        )
    if _max_difference(grads, mean_of_means) <= TOLERANCE:
        raise NotYet(
            f"with {len(y)} rows in micro-batches of {micro_batch}, dividing each micro-batch's mean loss by the "
            "number of micro-batches gives the short last micro-batch the weight of a full one"
        )
    if _max_difference(grads, unscaled) <= TOLERANCE:
        raise NotYet(f"the gradient is the sum of the {pieces} micro-batch means, not the mean over the "
                     f"{labelled} labelled rows of all {len(y)}")
    last_rows = len(y.split(micro_batch)[-1])
    last_labelled = int((y.split(micro_batch)[-1] != UNLABELLED).sum())
    last_only = _last_piece_gradient(model, x, y, micro_batch)
    for weight in (last_rows / len(y), 1.0, 1 / pieces, last_rows / micro_batch, last_labelled / labelled):
        if _max_difference(grads, [weight * g for g in last_only]) <= TOLERANCE:
            raise NotYet(
                f"only the last micro-batch's gradient is left in .grad: something cleared .grad between the "
                f"{pieces} backward passes",
                hint=(
                    "what happens to .grad between one micro-batch's backward and the next?",
                    "accumulation needs .grad to keep every micro-batch's gradient: never clear it inside the loop",
                ),
            )
    ratio = _ratio_to(grads, list(expected))
    if ratio is not None and abs(ratio - labelled / len(y)) <= TOLERANCE:
        raise NotYet(
            f".grad is {ratio:.4g} times the full-batch gradient: you divided the summed losses by len(y) = "
            f"{len(y)}, every row, but the mean divides by the {labelled} labelled rows (label {UNLABELLED} is "
            "ignored)",
            hint=(
                "which rows does F.cross_entropy(model(x), y) count when some labels are -100?",
                "divide the summed per-row losses by (y != -100).sum(), the labelled rows of the whole batch",
            ),
        )
    if ratio is not None:
        raise NotYet(
            f"with {len(y)} rows in micro-batches of {micro_batch}, .grad is {ratio:.4g} times the full-batch "
            "gradient: every row counts, but divided by the wrong number",
            hint=(
                "which number does the full-batch mean divide the summed per-row losses by?",
                "the full-batch mean divides the summed per-row losses by (y != -100).sum(), the labelled rows of the "
                "whole batch",
            ),
        )
    raise NotYet(
        f"with {len(y)} rows in micro-batches of {micro_batch}, .grad differs by "
        f"{_max_difference(grads, list(expected)):.2g} from the gradient of F.cross_entropy(model(x), y)"
    )


def _weighted_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int, weight: Callable[[torch.Tensor], float]
) -> list[torch.Tensor]:
    """The gradient of sum over micro-batches of weight(labels of the piece) * mean loss: names a wrong weighting."""
    params = list(model.parameters())
    total = sum(
        weight(y_piece) * F.cross_entropy(model(x_piece), y_piece)
        for x_piece, y_piece in zip(x.split(micro_batch), y.split(micro_batch))
    )
    return list(torch.autograd.grad(total, params))


def _last_piece_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int) -> list[torch.Tensor]:
    """The gradient of the last micro-batch's mean loss alone: what is left when .grad is cleared in the loop."""
    loss = F.cross_entropy(model(x.split(micro_batch)[-1]), y.split(micro_batch)[-1])
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _ratio_to(grads: list[torch.Tensor], expected: list[torch.Tensor]) -> float | None:
    """The factor c with grads == c * expected, if there is one (a sum divided by the wrong count)."""
    flat_got, flat_want = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in expected])
    ratio = (flat_got @ flat_want / (flat_want @ flat_want)).item()
    return ratio if torch.allclose(flat_got, ratio * flat_want, rtol=0, atol=TOLERANCE) else None


def _max_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second))
