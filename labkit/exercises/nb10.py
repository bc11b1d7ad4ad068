"""Checks for the exercises of 10_mixed_precision (cases G2 and G4).

10.1 asks for one fp16 autocast step with a `GradScaler` (the planted bug calls `optimizer.step()`
on gradients still multiplied by the loss scale). 10.2 asks for a scaler step whose scale can never
be left below a floor (the planted bug lets a long NaN burst drive the scale to 0, after which a
clean step writes NaN into the parameters). Both fixtures run on the CPU: `GradScaler("cpu")` and
CPU autocast, which supports fp16.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.amp import GradScaler

from labkit.exercises import NotYet, by_how_much, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "10_mixed_precision"
LEARNING_RATE = 0.1
FEATURES, CLASSES, BATCH = 8, 4, 16
TOLERANCE = 1e-6


@exercise(
    "10.1",
    notebook=NOTEBOOK,
    title="one fp16 step with a loss scaler",
    hint=(
        "the gradients in .grad after scaler.scale(loss).backward() are multiplied by the scale: who divides it out?",
        "the scaler's own step unscales, skips non-finite steps, and its update adjusts the scale",
        (
            "after scaler.scale(loss).backward(), call scaler.step(optimizer) (it unscales the gradients and skips a "
            "step whose gradients are not finite) and then scaler.update()"
        ),
    ),
    planted="the optimizer stepped with gradients still multiplied by the loss scale",
    answer_apart=True,
)
def check_amp_step(amp_step: Callable) -> str:
    """Three clean steps and one overflowing step must match the documented AMP recipe."""
    batches = _amp_batches()
    model, optimizer, scaler = _amp_fixture()
    reference, ref_optimizer, ref_scaler = _amp_fixture()
    for step, (x, y) in enumerate(batches, start=1):
        before = [p.detach().clone() for p in model.parameters()]
        loss = amp_step(model, optimizer, scaler, x, y)
        expected_loss = _reference_amp_step(reference, ref_optimizer, ref_scaler, x, y)
        _require_float_loss(loss, expected_loss, step)
        _require_same_step(model, reference, before, ref_scaler.get_scale(), step)
        _require_updated(scaler.calls, step)
        _require_same_scale(scaler, ref_scaler, step)
    return (
        f"{len(batches)} steps match autocast + scaler.step + scaler.update, including a skipped step "
        "whose gradients overflowed"
    )


def _amp_fixture() -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    scaler = _CountingScaler()
    # A scaler makes its scale at its first scale() call; making it now lets an answer that never scales
    # the loss run its scaler.step, so the check can say what that step did instead of quoting torch's assertion.
    scaler.scale(torch.ones(()))
    return model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), scaler


def _amp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(BATCH, FEATURES, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator))
        for _ in range(4)
    ]
    # The third batch holds one huge input: its scaled gradient overflows fp16, so the step must be skipped.
    overflowing = batches[2][0].clone()
    overflowing[0, 0] = 3e4
    batches[2] = (overflowing, batches[2][1])
    return batches


def _reference_amp_step(model, optimizer, scaler, x, y) -> float:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def _require_float_loss(loss: object, expected: float, step: int) -> None:
    if not isinstance(loss, float):
        raise NotYet(f"step {step} returned a {type(loss).__name__}, not the loss as a Python float",
                     hint="return loss.item()")
    if math.isfinite(expected):
        matches = abs(loss - expected) <= 1e-3 * max(1.0, abs(expected))
    else:
        matches = not math.isfinite(loss)
    if not matches:
        raise NotYet(f"step {step} returned {loss:.4g}, but the fp16 autocast loss on that batch is {expected:.4g}")


def _require_same_step(model, reference, before, scale: float, step: int) -> None:
    after = [p.detach() for p in model.parameters()]
    target = [p.detach() for p in reference.parameters()]
    if _max_difference(after, target) <= TOLERANCE:
        return
    if not all(torch.isfinite(p).all() for p in after):
        raise NotYet(f"after step {step} the parameters hold inf or NaN: an overflowing step must be skipped")
    moved = _max_difference(after, before)
    expected_move = _max_difference(target, before)
    if expected_move == 0:
        raise NotYet(f"step {step} overflowed in fp16 and must be skipped, but your step changed the parameters",
                     hint="scaler.step(optimizer) skips the optimizer step when the scaled gradients are not finite")
    if moved == 0:
        raise NotYet(f"step {step} did not move the parameters, although its gradients were finite",
                     hint="scaler.step(optimizer) takes the optimizer step (and skips only a non-finite one)")
    if moved < expected_move / 100:
        raise NotYet(
            f"step {step} moved the parameters about {expected_move / moved:.3g} times too little: "
            "scaler.step divided the gradients by the loss scale, but the loss they came from was never multiplied by it",
            hint=(
                "which loss did your backward pass start from, and what does scaler.step assume about it?",
                "scaler.step unscales: it divides .grad by the scale, so backward must run on the scaled loss, "
                "scaler.scale(loss)",
            ),
        )
    if moved > 100 * expected_move:
        raise NotYet(
            f"step {step} moved the parameters about {moved / expected_move:.3g} times too far: the optimizer stepped "
            f"with gradients still multiplied by the loss scale ({scale:g})"
        )
    raise NotYet(
        f"after step {step} the parameters differ {by_how_much(_max_difference(after, target))} from one SGD step with "
        "the forward under torch.autocast(x.device.type, dtype=torch.float16) and a GradScaler",
        hint="zero the gradients, run the forward and the loss under autocast, then scale, backward, step, update",
    )


class _CountingScaler(GradScaler):
    """A CPU GradScaler that counts the answer's calls of its step and update in its state_dict, so the
    counts come back also from an answer that runs in a process of its own (``answer_apart``)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls = {"step": 0, "update": 0}

    def step(self, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(*args, **kwargs)

    def update(self, *args, **kwargs):
        self.calls["update"] += 1
        return super().update(*args, **kwargs)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "calls": dict(self.calls)}

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        self.calls.update(state.pop("calls"))
        super().load_state_dict(state)


def _require_updated(calls: dict[str, int], step: int) -> None:
    """Without an update after scaler.step, the next scaler.step raises torch's "step() has already been
    called since the last update()", which names the symptom; this names what was left out, before it raises."""
    if calls["step"] > calls["update"]:
        raise NotYet(
            f"after step {step} the scaler had not finished its step: scaler.step ran {calls['step']} time(s) but "
            f"the scaler was updated {calls['update']} time(s), so the next scaler.step would raise "
            "'step() has already been called since the last update()'",
            hint=(
                "the scaler keeps per-step state that must be closed before the next scaler.step: which call closes it?",
                "scaler.update() ends every step: it resets the scaler for the next step and adjusts the scale",
            ),
        )


def _require_same_scale(scaler, reference, step: int) -> None:
    if scaler.get_scale() != reference.get_scale():
        raise NotYet(
            f"after step {step} the loss scale is {scaler.get_scale():g}, but it should be {reference.get_scale():g}",
            hint="call scaler.update() once at the end of every step: it backs off after an overflow and grows later",
        )


def _max_difference(first, second) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second))


FLOOR = 1.0
PARAMETERS = 6


@exercise(
    "10.2",
    notebook=NOTEBOOK,
    title="a loss scale that cannot collapse",
    hint=(
        "feed NaN gradients for a while: where does the scale end up?",
        "each skipped step halves the scale; after the scaler's update, read the scale and lift it when it falls under the floor",
        (
            "after scaler.step(optimizer) and scaler.update(), read scaler.get_scale(); when it is below floor, call "
            "scaler.update(float(floor)), which sets the scale to that value"
        ),
    ),
    planted="the scale was allowed to reach 0",
    answer_apart=True,
)
def check_step_and_update(step_and_update: Callable) -> str:
    """Clean steps must match a plain scaler; a NaN burst must leave the scale >= floor and the parameters finite."""
    clean = _stream(nan_steps=0)
    plain_scales, plain_param = _drive(_plain_step_and_update, clean)
    floored_scales, floored_param = _drive(step_and_update, clean)
    if floored_scales != plain_scales or not torch.equal(floored_param, plain_param):
        raise NotYet(
            "on a stream without NaN (one overflow, then clean steps) your function changed the scale or the "
            "parameters compared with plain scaler.step + scaler.update; the floor must only act below it"
        )
    burst = _stream(nan_steps=200)
    scales, param = _drive(step_and_update, burst, check_skips=True)
    if not torch.isfinite(param).all():
        raise NotYet("after a 200-step NaN burst the parameters hold NaN: the scale was allowed to reach 0, and "
                     "unscaling a zero-scaled gradient divides 0 by 0")
    lowest = min(scales)
    if lowest < FLOOR:
        raise NotYet(f"the scale was left at {lowest:g} after a step, below the floor {FLOOR:g}")
    if torch.equal(param, _drive(step_and_update, burst[:-len(_CLEAN_TAIL)])[1]):
        raise NotYet("after the burst the clean steps did not move the parameters: they must be taken again")
    return (
        "clean steps match a plain scaler exactly, and after a 200-step NaN burst the scale stayed at or above "
        f"{FLOOR:g} and training resumed with finite parameters"
    )


_CLEAN_HEAD = [1e-3, 2e-3, 1e3, 1e-3, 2e-3, 1e-3]  # 1e3 overflows fp16 at the default scale: one backoff
_CLEAN_TAIL = [1e-3, 2e-3, 1e-3]


def _stream(nan_steps: int) -> list[torch.Tensor]:
    values = _CLEAN_HEAD + [math.nan] * nan_steps + _CLEAN_TAIL
    return [torch.full((PARAMETERS,), value) * torch.linspace(0.5, 1.5, PARAMETERS) for value in values]


def _plain_step_and_update(scaler, optimizer, floor) -> None:
    scaler.step(optimizer)
    scaler.update()


def _drive(step_and_update: Callable, stream, check_skips: bool = False) -> tuple[list[float], torch.Tensor]:
    """Each gradient is scaled and stored in fp16, as an fp16 backward would leave it, then handed over."""
    param = torch.zeros(PARAMETERS, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=LEARNING_RATE)
    scaler = GradScaler("cpu")
    scales = []
    for gradient in stream:
        before = param.detach().clone()
        param.grad = scaler.scale(gradient).half().float()
        step_and_update(scaler, optimizer, FLOOR)
        if check_skips and gradient.isnan().any() and not torch.equal(param.detach(), before):
            raise NotYet("a step whose gradient was NaN changed the parameters: it must be skipped",
                         hint="keep scaler.step(optimizer): it skips steps whose gradients are not finite")
        scales.append(scaler.get_scale())
    return scales, param.detach().clone()
