"""Lab 03: a residual regression network with a normalised, rectified hidden layer; three in-place writes.

Taught in 03_inplace_ops (cases C1 and C2). The model (a tanh layer, a residual tanh block, a row
normalisation and a rectifier before a linear output) and its data (a smooth rule over 10 features)
appear nowhere in the notebook. Two defects write in place into a tensor backward saved, and backward
raises; one writes through ``.data``, which the version counter never sees, and the gradients are
silently wrong. Recovery is what case C1 measures: at every step the gradient equals the one the
same forward written out of place gives (`compare_grads`), and the training ends where the twin's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, reference_copy, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant
from labkit.messages import describe_error

__all__: list[str] = []

FEATURES, WIDTH, EXAMPLES, BATCH, STEPS, LR = 10, 32, 512, 64, 80, 0.1
# At every step of a repaired run the gradient may differ from the out-of-place forward's by this much
# (relative: rounding, as a repair written another way computes in another order); the .data write differs
# by 20% or more. Its final loss may differ from the twin's by TOLERANCE (relative).
GRADIENT_GAP, TOLERANCE = 1e-4, 0.05

STAGES = {
    "residual": "residual(h, block) -> tensor: h plus block(h), the residual block's output",
    "normalise": "normalise(h) -> tensor: each row of h shifted to mean 0 and divided by its standard deviation",
    "rectify": "rectify(h) -> tensor: max(h, 0) elementwise, with the gradient of max(h, 0)",
}


def residual(h, block):
    return h + block(h)


def normalise(h):
    return (h - h.mean(1, keepdim=True)) / h.std(1, keepdim=True)


def rectify(h):
    return torch.relu(h)


def _residual_in_place(h, block):
    h += block(h)
    return h


def _normalise_in_place(h):
    h.sub_(h.mean(1, keepdim=True))
    return h.div_(h.std(1, keepdim=True))


def _rectify_through_data(h):
    h.data.relu_()
    return h


class ResidualRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.out = nn.Linear(WIDTH, 1)


def predict(stages, model, x, watch: dict | None = None):
    """The model's output with the given stages; ``watch`` records the stages' inputs' version counters."""
    h = torch.tanh(model.inp(x))
    for name, run_stage in (("residual", lambda t: stages["residual"](t, model.block)),
                            ("normalise", stages["normalise"]), ("rectify", stages["rectify"])):
        before = h._version
        result = run_stage(h)
        if watch is not None:
            watch[name] = max(watch.get(name, 0), h._version - before)
        h = result
    return model.out(h)


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES, FEATURES, generator=data)
    u, v = (x @ torch.randn(FEATURES, generator=data) / FEATURES**0.5 for _ in range(2))
    y = (torch.relu(u) - 0.5 * torch.abs(v)).unsqueeze(1) + 0.05 * torch.randn(EXAMPLES, 1, generator=data)
    return x, y


def train(stages, seed: int) -> Run:
    x, y = dataset(seed)
    model = seeded(ResidualRegressor, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    writes: dict[str, int] = {}
    trace = {"grad_gap": [], "error": None, "writes": writes, "rectified": _rectified_gradient(stages["rectify"]),
             "smallest_std": _smallest_std(model, x)}
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(STEPS):
        rows = torch.randperm(EXAMPLES, generator=order)[:BATCH]
        reference = torch.autograd.grad(F.mse_loss(predict(_REFERENCE, model, x[rows]), y[rows]), params)
        optimizer.zero_grad()
        loss = F.mse_loss(predict(stages, model, x[rows], writes), y[rows])
        losses.append(loss.item())
        try:
            loss.backward()
        except RuntimeError as error:
            trace["error"] = (len(losses), describe_error(error, 400))
            break
        trace["grad_gap"].append(_gap(params, reference))
        optimizer.step()
    with torch.no_grad():
        final = F.mse_loss(predict(_REFERENCE, model, x), y).item()
    trace["one_step"] = _one_step_effect(x, y, seed)
    # a run that backward stopped took the steps before the error: the recovery says so, not the audit
    taken = STEPS if trace["error"] is None else len(trace["grad_gap"])
    return Run({"final_loss": final}, trace, {"model": model, "optimizer": optimizer, "x": x, "y": y,
                                              "losses": losses}, audit.problems(taken))


def _gap(params, reference) -> float:
    applied = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    wanted = torch.cat([g.flatten() for g in reference])
    return ((applied - wanted).norm() / wanted.norm().clamp_min(1e-12)).item()


def _rectified_gradient(rectify_stage) -> tuple[int, int]:
    """(entries the stage set to 0, of those the ones whose gradient is not 0) on a fixed probe tensor."""
    probe = torch.linspace(-2, 2, 40).view(4, 10) * 1.0
    probe.requires_grad_(True)
    inside = probe * 1.0  # a non-leaf, as in the model: a stage may write into it
    out = rectify_stage(inside)
    (grad,) = torch.autograd.grad(out.sum(), probe)
    zeroed = out.detach() == 0
    return int(zeroed.sum()), int((grad[zeroed] != 0).sum())


def _smallest_std(model, x) -> float:
    """The smallest row standard deviation the normalisation divides by, at the start, on the training inputs."""
    with torch.no_grad():
        h = torch.tanh(model.inp(x))
        return (h + model.block(h)).std(1).min().item()


def _one_step_effect(x, y, seed: int) -> tuple[float, float]:
    """The full-data loss of the initial model (out-of-place forward) before and after one SGD step at LR."""
    probe = seeded(ResidualRegressor, seed)
    loss = F.mse_loss(predict(_REFERENCE, probe, x), y)
    loss.backward()
    with torch.no_grad():
        for p in probe.parameters():
            p -= LR * p.grad
        return loss.item(), F.mse_loss(predict(_REFERENCE, probe, x), y).item()


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}): {curve_text(run.objects['losses'])}")
    if run.trace["error"] is not None:
        step, message = run.trace["error"]
        print(f"step {step}: loss.backward() raised {message}")
    print(f"final mean squared error on all {EXAMPLES} examples: {number(run.metrics['final_loss'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics["final_loss"], twin.metrics["final_loss"]
    if repaired.trace["error"] is not None:
        step, message = repaired.trace["error"]
        return False, f"at step {step} loss.backward() still raises {message}"
    gaps = repaired.trace["grad_gap"]
    worst = max(range(len(gaps)), key=lambda step: gaps[step])
    said = (f"the gradient differs from the out-of-place forward's by {gaps[worst]:.1e} at most (relative, step "
            f"{worst + 1}); final error {number(mine)}, the defect-free run's {number(theirs)}")
    return gaps[worst] <= GRADIENT_GAP and relative_gap(mine, theirs) <= TOLERANCE, said


def _writes(stage: str):
    return lambda d, t: (f"the {stage} stage leaves its input as it was: its version counter (h._version) does not move "
                         "during the stage" if not d.trace["writes"].get(stage) else
                         f"the {stage} stage writes into its input")


def _data_measure(defective: Run, twin: Run) -> str:
    zeroed, passing = defective.trace["rectified"]
    return (f"rectify's gradient is 0 at all {zeroed} entries it sets to 0 (torch.autograd.grad on a probe tensor), "
            "as max(h, 0)'s gradient is" if passing == 0 else
            f"rectify passes a gradient through {passing} of the {zeroed} entries it sets to 0")


CAUSES = (
    Cause("the residual sum writes in place into a tensor backward saved", _writes("residual")),
    Cause("the normalisation writes in place into a tensor backward saved", _writes("normalise")),
    Cause("an in-place write through .data hides a change from autograd", _data_measure),
    Cause("the normalisation divides by a zero standard deviation",
          lambda d, t: "the smallest row standard deviation the normalisation divides by is "
                       f"{number(d.trace['smallest_std'])}, far from 0"),
    Cause("the learning rate is too high",
          lambda d, t: "one full-batch SGD step at the lab's learning rate lowers the loss of the same network "
                       f"written out of place from {number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
)

_CORRECT = {"residual": residual, "normalise": normalise, "rectify": rectify}
# The run's own measurements (the reference gradient, the final loss) use copies: see `reference_copy`.
_REFERENCE = {name: reference_copy(stage) for name, stage in _CORRECT.items()}

LAB = Lab(
    id="03",
    notebook="03_inplace_ops",
    title="a residual network with in-place writes",
    section="Case C1: does `x = x.relu_()` corrupt gradients through memory reuse?",
    stages=STAGES,
    correct=_CORRECT,
    causes=CAUSES,
    variants=(
        Variant("03.a", CAUSES[0].name, "backward raises: modified by an inplace operation",
                {"residual": _residual_in_place}),
        Variant("03.b", CAUSES[1].name, "backward raises: modified by an inplace operation",
                {"normalise": _normalise_in_place}),
        Variant("03.c", CAUSES[2].name, "loss falls less than it should", {"rectify": _rectify_through_data}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "read the error: which backward node's saved tensor was modified; then watch each stage's input version "
        "counter (h._version) and compare gradients with the same forward written out of place (compare_grads)",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's case C1 (which tensors a node saves, the version counter, and what .data hides) "
        "and case C2, then measure your run the same way",
    ),
)
