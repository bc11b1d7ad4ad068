"""Checks for the exercises of 08_gradient_health (cases L2 and L1).

08.1 asks for hooks that record each parameter's *accumulated* gradient norm (the planted bug uses
`Tensor.register_hook`, which sees only the gradient of the current backward pass, so it is wrong
as soon as gradients accumulate over micro-batches). 08.2 asks for a spike alert that fires on a
non-finite reading and ignores non-finite readings in its baseline (the planted bug is the NumPy
monitor's rule, blind to NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import NotYet, exercise, run_beside

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "08_gradient_health"
MICRO_BATCHES = 3
TOLERANCE = 1e-9


@exercise(
    "08.1",
    notebook=NOTEBOOK,
    title="read the accumulated gradient",
    hint=(
        "the check runs two backward passes before it reads: does your hook see their sum, or only one pass's gradient?",
        "a tensor hook sees each pass's gradient before it is added into .grad; another hook runs after accumulation",
        (
            "register param.register_post_accumulate_grad_hook(hook): PyTorch calls hook(param) after the "
            "backward pass has added into param.grad, so read param.grad.norm() there"
        ),
    ),
    planted="the hook saw only one backward pass's gradient",
    answer_apart=True,
)
def check_record_grad_norms(record_grad_norms: Callable) -> str:
    """After k micro-batch backward passes the dict must hold every parameter's .grad norm; removing
    the handles must stop the recording."""
    model, batches = _accumulation_fixture()
    parameter_norms = {name: p.detach().norm().item() for name, p in model.named_parameters()}
    expected, last_pass_norms, before_last_norms = _pass_gradient_norms(model, batches)
    # The passes run where the answer's hooks are: in its own process when it runs apart (answer_apart)
    recorded, after_removal = run_beside(record_grad_norms, _drive_passes, model, batches)
    _require_norms(recorded, expected, parameter_norms, last_pass_norms, before_last_norms)
    if after_removal != recorded:
        raise NotYet("after every handle was removed, another backward pass still changed the recorded norms")
    return (
        f"after {MICRO_BATCHES} accumulated backward passes every recorded norm equals the norm of .grad, "
        "and removing the handles stops the recording"
    )


def _accumulation_fixture() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(8)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    batches = [
        (torch.randn(6, 5, generator=generator, dtype=torch.float64), torch.randn(6, 2, generator=generator, dtype=torch.float64))
        for _ in range(MICRO_BATCHES)
    ]  # fmt: skip
    return model, batches


def _drive_passes(record_grad_norms: Callable, model: nn.Module,
                  batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, dict]:
    """The answer registers its hooks; then the micro-batch backward passes, the norms it recorded, the
    handles removed and one more pass, and the norms again."""
    norms, handles = _unpack(record_grad_norms(model))
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
    recorded = dict(norms)
    for handle in handles:
        handle.remove()
    nn.functional.mse_loss(model(batches[0][0]), batches[0][1]).backward()
    return recorded, dict(norms)


def _unpack(result: object) -> tuple[dict, list]:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], dict)):
        raise NotYet(f"expected (norms, handles): a dict and a list of hook handles, got {type(result).__name__}")
    norms, handles = result
    if not all(hasattr(handle, "remove") for handle in handles):
        raise NotYet("the second item must be the handles the register_* calls returned (each has .remove())")
    return norms, list(handles)


def _pass_gradient_norms(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per parameter, the norm of .grad after every pass (the sum, added in pass order as backward adds),
    of the last pass's gradient alone and of the sum of the passes before it: what a hook sees that reads
    the pass's gradient, or .grad before the last pass is added in."""
    names, params = zip(*model.named_parameters())
    per_pass = [torch.autograd.grad(nn.functional.mse_loss(model(x), y), params) for x, y in batches]
    accumulated = {name: sum(grads[i] for grads in per_pass).norm().item() for i, name in enumerate(names)}
    last = {name: grad.norm().item() for name, grad in zip(names, per_pass[-1])}
    before_last = {name: sum(grads[i] for grads in per_pass[:-1]).norm().item() for i, name in enumerate(names)}
    return accumulated, last, before_last


def _require_norms(
    norms: dict,
    expected: dict[str, float],
    parameter_norms: dict[str, float],
    last_pass_norms: dict[str, float],
    before_last_norms: dict[str, float],
) -> None:
    missing = sorted(set(expected) - set(norms))
    if missing and len(norms) == 1 and set(norms) <= set(expected):
        raise NotYet(
            f"every hook stored its norm under one key, {next(iter(norms))!r}: the hooks' function reads the loop "
            "variable when it runs, after the loop has ended, so each one sees the last name",
            hint=(
                "when does your hook look up the name it stores under: when it is defined, or when it runs?",
                "a function defined in a loop sees the loop variable's last value; bind the current name when you "
                "define the hook (a default argument, functools.partial or a function that returns the hook)",
            ),
        )
    if missing:
        raise NotYet(f"no norm was recorded for {missing}; key the dict by the names from model.named_parameters()")
    for name, want in expected.items():
        got = norms[name]
        if not isinstance(got, float):
            raise NotYet(f"the value stored for '{name}' is a {type(got).__name__}; store a float (use .item())")
        if _close(got, want):
            continue
        if _close(got, parameter_norms[name]):
            raise NotYet(
                f"'{name}' was recorded as {got:.6g}, the norm of the parameter itself, not of its gradient "
                f"({want:.6g})",
                hint="the hook receives the parameter; its gradient, accumulated, is in parameter.grad",
            )
        if _close(got, last_pass_norms[name]):
            raise NotYet(
                f"after {MICRO_BATCHES} micro-batches '{name}' was recorded as {got:.6g}, the norm of the last "
                f"pass's gradient alone, but its accumulated .grad has norm {want:.6g}: the hook saw only one "
                "backward pass's gradient"
            )
        if _close(got, before_last_norms[name]):
            raise NotYet(
                f"after {MICRO_BATCHES} micro-batches '{name}' was recorded as {got:.6g}, the norm of .grad before "
                f"the last pass was added into it ({want:.6g} after): the hook ran before accumulation, so it read "
                ".grad one backward pass too early",
            )
        raise NotYet(
            f"after {MICRO_BATCHES} micro-batches '{name}' was recorded as {got:.6g}, but its accumulated .grad "
            f"has norm {want:.6g}"
        )


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOLERANCE * max(1.0, want)


@exercise(
    "08.2",
    notebook=NOTEBOOK,
    title="a spike alert that sees NaN",
    hint=(
        "what is NaN > anything? and what does one NaN in the history do to its mean?",
        "test the current reading for finiteness first, and leave non-finite readings out of the baseline",
        (
            "test math.isfinite(current) first (NaN > x is always False), and build the baseline from the finite "
            "readings only, so one NaN in the history does not make the mean NaN"
        ),
    ),
    planted="for a NaN reading, your function returned",
    answer_apart=True,
)
def check_spike_alert(spike_alert: Callable) -> str:
    """Table-driven: finite spikes, NaN and inf readings, NaN in the history, short histories."""
    calm = [1.0, 1.1, 0.9, 1.0, 1.0]
    cases = [
        ("a reading 3.5x the baseline", calm, 3.5, True),
        ("a reading 2x the baseline", calm, 2.0, False),
        ("a NaN reading", calm, math.nan, True),
        ("an infinite reading", calm, math.inf, True),
        ("a 10x reading after a NaN entered the history", calm + [math.nan], 10.0, True),
        ("a 2x reading after a NaN entered the history", calm + [math.nan], 2.0, False),
        ("a 10x reading with only 4 finite readings so far", [1.0, math.nan, 1.0, 1.0, 1.0], 10.0, False),
        ("a NaN reading with an empty history", [], math.nan, True),
        ("a 10x reading over the last 5 of a longer history", [50.0, 50.0] + calm, 10.0, True),
    ]
    for label, history, current, expected in cases:
        given = list(history)
        answer = spike_alert(given, current)
        if not _same_with_nan(given, history):
            raise NotYet(f"for {label}, your function changed the history list it was given")
        if answer not in (True, False) or bool(answer) is not expected:
            raise NotYet(f"for {label}, your function returned {answer!r}; expected {expected}")
    return f"all {len(cases)} cases right: NaN and inf readings alert, and a NaN in the history no longer blinds the baseline"


def _same_with_nan(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))
