"""Checks for the exercises of 00_start_here, on claim Z1: `.grad` adds up across backward passes.

00.1 asks for one correct SGD step (the planted bug forgets `optimizer.zero_grad()`); 00.2 asks for
one gradient of tanh(w * x).sum() per call from a single leaf tensor (the planted bug keeps `w.grad`
itself, which every later backward pass adds into). Both fixtures start with a gradient already left in `.grad`, as
after an earlier inspection, because that is when the bug bites.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, by_how_much, exercise, run_beside

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "00_start_here"
LEARNING_RATE = 0.1
STEPS = 3
FEATURES = 4
BATCH = 8
TOLERANCE = 1e-6


@exercise(
    "00.1",
    notebook=NOTEBOOK,
    title="one correct SGD step",
    hint=(
        "the check left an old gradient in .grad before your first step: what does loss.backward() do with what .grad already holds?",
        "backward adds into .grad (claim Z1); something has to empty .grad before each backward pass",
        "call optimizer.zero_grad() before loss.backward(), so each step uses only this batch's gradient",
    ),
    planted="moved as if .grad still held the gradients of earlier backward passes",
    answer_apart=True,
)
def check_one_training_step(one_training_step: Callable) -> str:
    """Three steps of the learner's function must match SGD on fresh gradients, step by step."""
    model, leftover, batches = _step_fixture()
    start = [parameter.detach().clone() for parameter in model.parameters()]
    clean_params, clean_losses = _sgd_reference(start, leftover, batches, keep_old_grads=False)
    piled_params, _ = _sgd_reference(start, leftover, batches, keep_old_grads=True)
    optimizer = _WatchedSGD(model.parameters(), lr=LEARNING_RATE)
    for step, (x, y) in enumerate(batches, start=1):
        optimizer.grads_at_step.clear()
        loss = one_training_step(model, optimizer, x, y)
        _require_loss(loss, clean_losses[step - 1], step)
        params = [parameter.detach() for parameter in model.parameters()]
        _require_step(params, start, clean_params[step - 1], piled_params[step - 1], step, optimizer.grads_at_step)
    return f"{STEPS} steps match SGD on fresh gradients to {TOLERANCE:g}, even with an old gradient left in .grad"


class _WatchedSGD(torch.optim.SGD):
    """SGD that notes, at each step() call, whether any parameter held a gradient then. The note travels in
    its state_dict, so the check reads it also when the answer ran in a process of its own (answer_apart)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.grads_at_step: list[bool] = []

    def step(self, closure=None):
        parameters = [p for group in self.param_groups for p in group["params"]]
        self.grads_at_step.append(any(_holds_gradient(p) for p in parameters))
        return super().step(closure)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "grads_at_step": list(self.grads_at_step)}

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        self.grads_at_step = list(state.pop("grads_at_step", []))
        super().load_state_dict(state)


def _step_fixture() -> tuple[nn.Linear, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    # An earlier backward pass (someone inspecting gradients) leaves this in .grad.
    probe_x, probe_y = torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator)
    F.mse_loss(model(probe_x), probe_y).backward()
    leftover = [parameter.grad.clone() for parameter in model.parameters()]
    batches = [
        (torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator))
        for _ in range(STEPS)
    ]
    return model, leftover, batches


def _sgd_reference(
    start: list[torch.Tensor],
    leftover: list[torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    keep_old_grads: bool,
) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Parameters after each SGD step and the loss before it, from `autograd.grad` (never `.grad`).

    With ``keep_old_grads`` each step's gradient is added to all earlier ones, which is what a
    step without `zero_grad()` does; that second run lets the check name the bug precisely.
    """
    params = [tensor.clone().requires_grad_() for tensor in start]
    carried = [tensor.clone() for tensor in leftover] if keep_old_grads else [torch.zeros_like(t) for t in start]
    after_each_step, losses = [], []
    for x, y in batches:
        loss = F.mse_loss(F.linear(x, *params), y)
        grads = torch.autograd.grad(loss, params)
        used = [old + new for old, new in zip(carried, grads)]
        if keep_old_grads:
            carried = used
        params = [(param - LEARNING_RATE * grad).detach().requires_grad_() for param, grad in zip(params, used)]
        after_each_step.append([param.detach() for param in params])
        losses.append(loss.item())
    return after_each_step, losses


def _require_loss(loss: object, expected: float, step: int) -> None:
    if not isinstance(loss, float):
        raise NotYet(
            f"step {step} returned a {type(loss).__name__}, not the loss as a Python float",
            hint="return loss.item(): a float that does not keep the autograd graph alive",
        )
    if abs(loss - expected) > TOLERANCE * max(1.0, abs(expected)):
        raise NotYet(
            f"step {step} returned {loss:.4g}, but F.mse_loss(model(x), y) on that batch "
            f"before the step is {expected:.4g}",
            hint="compute the loss with F.mse_loss(model(x), y), call backward on it and return loss.item()",
        )


def _require_step(
    params: list[torch.Tensor],
    start: list[torch.Tensor],
    clean: list[torch.Tensor],
    piled: list[torch.Tensor],
    step: int,
    grads_at_step: list[bool],
) -> None:
    if step == 1 and _max_difference(params, start) == 0:
        _require_stepped_with_a_gradient(grads_at_step)
    if _max_difference(params, clean) <= TOLERANCE:
        return
    if _max_difference(params, piled) <= TOLERANCE:
        raise NotYet(
            f"after step {step} the parameters moved as if .grad still held the gradients of earlier "
            "backward passes (.grad adds every backward pass to what it holds: claim Z1)"
        )
    raise NotYet(
        f"after step {step} the parameters differ {by_how_much(_max_difference(params, clean))} from one SGD step "
        f"on F.mse_loss(model(x), y) with the optimizer you were given"
    )


def _holds_gradient(parameter: torch.Tensor) -> bool:
    return parameter.grad is not None and bool(parameter.grad.any())


def _require_stepped_with_a_gradient(grads_at_step: list[bool]) -> None:
    """Why the parameters did not move: no step at all, or a step that found .grad already emptied."""
    if not grads_at_step:
        raise NotYet(
            "the parameters did not change after step 1: optimizer.step() was never called",
            hint="after loss.backward(), call optimizer.step() to apply the gradient",
        )
    raise NotYet(
        "the parameters did not change after step 1: optimizer.step() ran, but .grad was empty by then, so "
        "something cleared the gradient between loss.backward() and optimizer.step()",
        hint=(
            "what does .grad hold at the moment optimizer.step() reads it?",
            "zero_grad() empties .grad: clearing between backward and step throws this batch's gradient away",
            "clear .grad before loss.backward(), never between loss.backward() and optimizer.step()",
        ),
    )


def _max_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second))


@exercise(
    "00.2",
    notebook=NOTEBOOK,
    title="one gradient per call",
    hint=(
        "w.grad is one tensor: what happens to it at the second backward pass, and what did you put in your list?",
        "each backward pass adds into w.grad, so either clear it and keep a copy per call, or ask autograd for a fresh gradient that never touches .grad",
        (
            "each backward pass adds into w.grad (claim Z1), so clear it before each one (w.grad = None) and keep "
            "a copy, or use torch.autograd.grad, which leaves .grad alone"
        ),
    ),
    planted="holds the same tensor more than once",
    answer_apart=True,
)
def check_grad_of_each_call(grad_of_each_call: Callable) -> str:
    """Each returned gradient must be that of `torch.tanh(w * x).sum()` for its own x alone.

    The loss is not linear in w, so its gradient is not x itself: copying the inputs, which passes
    for the linear (w * x).sum(), is caught by name.
    """
    w, inputs = _per_call_fixture()
    w_before = w.detach().clone()
    left_over = w.grad.clone()
    expected = [torch.autograd.grad(_per_call_loss(w, x), w)[0] for x in inputs]
    grads, passes, distinct, by_autograd = run_beside(grad_of_each_call, _differentiated_calls, w, inputs)
    _require_tensor_list(grads, len(inputs))
    if not torch.equal(w.detach(), w_before):
        raise NotYet("your function changed the values of w", hint="only call backward; never update w here")
    if distinct < len(grads):
        raise NotYet(
            "your list holds the same tensor more than once: w.grad is one tensor that each backward pass adds into"
        )
    if grads[0].shape == left_over.shape and torch.allclose(grads[0].detach(), left_over + expected[0], rtol=0, atol=TOLERANCE):
        raise NotYet(
            "gradient 0 also holds the gradient left in w.grad before your call, and each later one the "
            "gradients of earlier backward passes: backward adds into w.grad, and nothing cleared it",
            hint=(
                "what did w.grad hold before your first backward pass?",
                "clear w.grad before each backward pass (w.grad = None), or use torch.autograd.grad, which leaves .grad alone",
            ),
        )
    for index, (got, want) in enumerate(zip(grads, expected)):
        _require_gradient(got, want, inputs[index], index)
    _require_autograd(by_autograd, passes)
    return (
        f"each of the {len(inputs)} gradients matches torch.autograd.grad for its own call, "
        "even with an old gradient in w.grad"
    )


def _per_call_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The loss of one call in exercise 00.2."""
    return torch.tanh(w * x).sum()


def _per_call_fixture() -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(FEATURES, generator=generator).requires_grad_()
    inputs = [torch.randn(FEATURES, generator=generator) for _ in range(STEPS)]
    # An earlier backward pass leaves a gradient in w.grad, as in a notebook that inspected it.
    (w * torch.randn(FEATURES, generator=generator)).sum().backward()
    return w, inputs


def _require_tensor_list(grads: object, count: int) -> None:
    if not isinstance(grads, (list, tuple)) or len(grads) != count:
        size = f"of length {len(grads)}" if isinstance(grads, (list, tuple)) else type(grads).__name__
        raise NotYet(f"expected a list of {count} gradients, one per input, but got a {size}")
    for index, grad in enumerate(grads):
        if not isinstance(grad, torch.Tensor):
            raise NotYet(f"entry {index} of your list is a {type(grad).__name__}, not a tensor")


def _differentiated_calls(grad_of_each_call: Callable, w: torch.Tensor,
                          inputs: list[torch.Tensor]) -> tuple[object, int, int | None, list[bool] | None]:
    """Where the answer runs (a tensor's identity and graph do not cross): its gradients, how many backward
    passes or autograd.grad calls reached w, how many distinct tensors the list holds, and which of them
    carry a double-backward node."""
    differentiated = []  # one entry per backward pass or autograd.grad call that reached w
    handle = w.register_hook(lambda grad: differentiated.append(True))
    try:
        grads = grad_of_each_call(w, inputs)
    finally:
        handle.remove()
    if not isinstance(grads, (list, tuple)):
        return grads, len(differentiated), None, None
    by_autograd = [isinstance(grad, torch.Tensor) and _differentiated_by_autograd(grad) for grad in grads]
    return grads, len(differentiated), len({id(grad) for grad in grads}), by_autograd


def _require_autograd(by_autograd: list[bool], passes: int) -> None:
    """A gradient autograd computed either reached w's hook (backward, autograd.grad) or carries a
    double-backward node (torch.func.grad); a formula written by hand does neither."""
    if passes >= len(by_autograd) or all(by_autograd):
        return
    raise NotYet(
        f"autograd differentiated through w {passes} time(s) for {len(by_autograd)} inputs: your gradients come from a "
        "formula written by hand (such as (1 - tanh(w * x) ** 2) * x), and the exercise asks autograd to do the "
        "calculus, which is what keeps working when the loss changes",
        hint=(
            "which call makes autograd compute a gradient with respect to w?",
            "for each x, build torch.tanh(w * x).sum() and get its gradient from autograd: backward() with a cleared "
            "w.grad, or torch.autograd.grad, which leaves .grad alone",
        ),
    )


def _differentiated_by_autograd(grad: torch.Tensor) -> bool:
    """Whether `grad`'s graph holds a node of a backward pass (named like TanhBackwardBackward0)."""
    seen, stack = set(), [grad.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if "BackwardBackward" in type(node).__name__:
            return True
        seen.add(node)
        stack.extend(parent for parent, _ in node.next_functions)
    return False


def _require_gradient(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, index: int) -> None:
    if got.shape != want.shape:
        raise NotYet(f"gradient {index} has shape {tuple(got.shape)}, but w has shape {tuple(want.shape)}")
    if torch.equal(got.detach(), x):
        raise NotYet(
            f"gradient {index} is inputs[{index}] itself, the gradient of the linear (w * x).sum(), "
            "not of torch.tanh(w * x).sum()",
            hint="do not derive it by hand: let autograd differentiate torch.tanh(w * x).sum() with respect to w",
        )
    difference = (got.detach() - want).abs().max().item()
    if not difference <= TOLERANCE:
        raise NotYet(
            f"gradient {index} differs {by_how_much(difference)} from the gradient of "
            f"torch.tanh(w * inputs[{index}]).sum() alone"
        )
