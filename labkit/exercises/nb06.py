"""Checks for the exercises of 06_optimizers_weight_decay.

06.1 asks for one AdamW step on one tensor, by hand (the planted bug folds the decay into the
gradient, which is what `Adam(weight_decay=...)` does: claims E1 and E2). 06.2 asks for parameter
groups with layer-wise weight decay and none on biases and normalisation parameters (the planted bug
decays every parameter of a module: claim E4). Both checks measure behaviour against
`torch.optim.AdamW` itself, in float64 on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from labkit.exercises import Hint, NotYet, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "06_optimizers_weight_decay"
TOLERANCE = 1e-12

# 06.1: a large decay, so decoupled and L2 decay differ clearly within a few steps.
LEARNING_RATE = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.1
STEPS = 5

# 06.2: the article's per-layer decay values, and a learning rate that makes each decay visible.
LAYER_DECAY = {"embedding": 0.005, "encoder": 0.01, "classifier": 0.02}
GROUP_LR = 0.1


@exercise(
    "06.1",
    notebook=NOTEBOOK,
    title="one AdamW step, by hand",
    hint=(
        "compare your step with AdamW's rule in order: decay, moments, bias correction, update",
        "AdamW shrinks the parameter by lr * weight_decay directly; the gradient the moments see never includes the decay",
        (
            "shrink the parameter first, param.mul_(1 - lr * weight_decay), and leave the gradient alone: the moments "
            "see only grad, and the update is lr * m_hat / (sqrt(v_hat) + eps) with both moments bias-corrected"
        ),
    ),
    planted="that is claim E1's legacy Adam, not AdamW",
    answer_apart=True,
)
def check_adamw_update(adamw_update: Callable) -> str:
    """Five steps of the learner's update must match torch.optim.AdamW on the same gradients."""
    start, grads = _adamw_fixture()
    reference = start.clone().requires_grad_()
    optimizer = torch.optim.AdamW([reference], lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    l2_path = _adam_l2_path(start, grads)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for step, grad in enumerate(grads, start=1):
        before = {"param": param.clone(), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
        adamw_update(param, grad.clone(), exp_avg, exp_avg_sq, step, LEARNING_RATE, BETAS, EPS, WEIGHT_DECAY)
        reference.grad = grad.clone()
        optimizer.step()
        if isinstance(param, torch.Tensor) and _difference(param, l2_path[step - 1]) <= TOLERANCE:
            raise NotYet(
                f"after step {step} the parameter follows Adam(weight_decay=...), which adds the decay to the gradient "
                "(L2, divided by sqrt(v_hat) like the rest): that is claim E1's legacy Adam, not AdamW"
            )
        state = optimizer.state[reference]
        _require_updated_in_place({"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, before, step)
        _require_close(exp_avg, state["exp_avg"], f"exp_avg after step {step}", _moment_hint(exp_avg, before, grad))
        _require_close(exp_avg_sq, state["exp_avg_sq"], f"exp_avg_sq after step {step}")
        _require_close(param, reference.detach(), f"the parameter after step {step}", *_step_mistake(param, before, grad, step))
    return (
        f"{STEPS} steps match torch.optim.AdamW to {TOLERANCE:g}, parameter and both moments, including a weight "
        "whose gradient is zero"
    )


def _adamw_fixture() -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(6)
    start = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    grads = [torch.randn(3, 4, generator=generator, dtype=torch.float64) for _ in range(STEPS)]
    for grad in grads:
        grad[0, 0] = 0.0  # a weight the data never pushes: only the decay moves it
    return start, grads


def _adam_l2_path(start: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    weights = start.clone().requires_grad_()
    optimizer = torch.optim.Adam([weights], lr=LEARNING_RATE, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    path = []
    for grad in grads:
        weights.grad = grad.clone()
        optimizer.step()
        path.append(weights.detach().clone())
    return path


def _require_updated_in_place(tensors: dict, before: dict, step: int) -> None:
    """Each tensor the learner was given must have changed: a rebound local name changes nothing outside."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and torch.equal(tensor, before[name]):
            raise NotYet(
                f"after step {step}, the {name} tensor you were given still holds its old values: your function "
                "computed new values but bound them to a local name (x = ...), which the caller never sees",
                hint=(
                    "the optimizer keeps these tensors and passes the same ones to every step, so change them in "
                    "place: x.mul_(...), x.add_(...), x.copy_(new_value)"
                ),
            )


def _moment_hint(exp_avg: object, before: dict, grad: torch.Tensor) -> str | None:
    """The weight-decay hint, only when exp_avg is the moment of grad + weight_decay * param (L2 leaked in)."""
    beta1 = BETAS[0]
    leaked = beta1 * before["exp_avg"] + (1 - beta1) * (grad + WEIGHT_DECAY * before["param"])
    if isinstance(exp_avg, torch.Tensor) and exp_avg.shape == leaked.shape and _difference(exp_avg, leaked) <= TOLERANCE:
        return "the moments see the gradient only; AdamW never adds weight_decay * param to it"
    return "exp_avg is the running mean of the gradients: beta1 * exp_avg + (1 - beta1) * grad"


def _step_mistake(param: object, before: dict, grad: torch.Tensor, step: int) -> tuple[Hint | None, str]:
    """(hint, the mistake in words) when the parameter matches a likely wrong AdamW step, else (None, "")."""
    beta1, beta2 = BETAS
    exp_avg = beta1 * before["exp_avg"] + (1 - beta1) * grad
    exp_avg_sq = beta2 * before["exp_avg_sq"] + (1 - beta2) * grad * grad
    update = LEARNING_RATE * (exp_avg / (1 - beta1**step)) / ((exp_avg_sq / (1 - beta2**step)).sqrt() + EPS)
    start = before["param"]
    mistakes = [
        ("the decay shrank the parameter after the Adam update instead of before it",
         ("which parameter does AdamW's decay shrink: the one before the step, or the one after the update?",
          "AdamW decays the parameter as it was before the step: decay first, then subtract the update"),
         (start - update) * (1 - LEARNING_RATE * WEIGHT_DECAY)),
        ("the update has no bias correction",
         ("the moments start at zero: what does that do to them in the first steps?",
          "early on both moments are biased toward their zero start: divide them by (1 - beta ** step)"),
         start * (1 - LEARNING_RATE * WEIGHT_DECAY) - LEARNING_RATE * exp_avg / (exp_avg_sq.sqrt() + EPS)),
        ("the decay was not multiplied by the learning rate",
         ("how far does one AdamW step shrink a weight whose gradient is zero?",
          "AdamW shrinks the parameter by the factor (1 - lr * weight_decay)"),
         start * (1 - WEIGHT_DECAY) - update),
    ]  # fmt: skip
    for mistake, hint, wrong in mistakes:
        if isinstance(param, torch.Tensor) and param.shape == wrong.shape and _difference(param, wrong) <= TOLERANCE:
            return hint, f": {mistake}"
    return None, ""


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs() / want.abs().clamp_min(1.0)).max().item()


def _require_close(got: object, want: torch.Tensor, what: str, hint: Hint | None = None, mistake: str = "") -> None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise NotYet(f"{what} is not a tensor of shape {tuple(want.shape)}: update the tensors you were given in place")
    became_nan = int((got.isnan() & ~want.isnan()).sum())
    if became_nan:
        raise NotYet(
            f"{what} became NaN at {became_nan} of its {got.numel()} entries, where torch.optim.AdamW's is finite",
            hint=(
                "look for a 0 / 0: the weight whose gradient is always zero has v_hat = 0, so the denominator "
                "must stay positive there (eps is added after the square root)"
            ),
        )
    difference = _difference(got, want)
    if not difference <= TOLERANCE:
        raise NotYet(f"{what} differs from torch.optim.AdamW's by {difference:.2g}{mistake}", hint=hint)


@exercise(
    "06.2",
    notebook=NOTEBOOK,
    title="layer-wise weight decay with parameter groups",
    hint=(
        "look at which parameters get decay: should a bias or a normalisation scale be pulled toward 0?",
        "split each module's parameters by shape: matrices get the module's decay, 1-d parameters get none",
        (
            "for each module name, make two groups: its parameters with p.ndim >= 2 with the module's decay, and its "
            "1-d parameters (biases, normalisation scales and shifts) with weight_decay 0.0"
        ),
    ),
    planted="biases and normalisation parameters should get weight_decay 0.0",
    answer_apart=True,
)
def check_layerwise_param_groups(layerwise_param_groups: Callable) -> str:
    """Under AdamW with zero gradients, each parameter must shrink by exactly its intended decay."""
    model = _groups_fixture()
    groups = layerwise_param_groups(model, dict(LAYER_DECAY))
    _require_each_parameter_once(model, groups)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(groups, lr=GROUP_LR)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        _require_decay(name, parameter, before[name], _intended_decay(name, parameter))
    return (
        "every weight matrix decays at its module's rate (0.005, 0.01, 0.02) and no bias or LayerNorm parameter "
        "decays, each parameter in exactly one group"
    )


def _groups_fixture() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.embedding = nn.Embedding(10, 4)
    model.encoder = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 4))
    model.classifier = nn.Linear(4, 3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # no parameter starts at 0, so every decay factor can be measured
    return model.double()


def _require_each_parameter_once(model: nn.Module, groups: object) -> None:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise NotYet("return a list of dicts, each with a 'params' list (and a 'weight_decay')")
    names = {id(p): name for name, p in model.named_parameters()}
    seen: dict[int, int] = {}
    for group in groups:
        for parameter in group["params"]:
            seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    twice = [names.get(key, "a tensor that is not the model's") for key, count in seen.items() if count > 1]
    missing = [name for key, name in names.items() if key not in seen]
    if twice:
        raise NotYet(f"{', '.join(twice)} appear in more than one group")
    if missing:
        raise NotYet(f"{', '.join(missing)} are in no group, so the optimizer would never update them")


def _intended_decay(name: str, parameter: torch.Tensor) -> float:
    return LAYER_DECAY[name.split(".")[0]] if parameter.ndim >= 2 else 0.0


def _require_decay(name: str, parameter: torch.Tensor, before: torch.Tensor, intended: float) -> None:
    measured = ((1 - parameter.detach() / before) / GROUP_LR).mean().item()
    if abs(measured - intended) <= 1e-9:
        return
    if intended == 0.0:
        raise NotYet(
            f"'{name}' ({parameter.ndim}-d) decays at {measured:.3g}: biases and normalisation parameters should "
            "get weight_decay 0.0"
        )
    raise NotYet(f"'{name}' decays at {measured:.3g}, but its module's decay is {intended:g}")
