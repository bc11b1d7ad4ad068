"""Lab 00: a small regression network whose loss misbehaves; three defects of the basic training loop.

Taught in 00_start_here: the format of every lab. The model (a 6-16-1 tanh network) and the data
(a noisy linear rule over 6 standardised features) appear nowhere in the notebook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

EXAMPLES, FEATURES, BATCH, EPOCHS, LR = 256, 6, 32, 4, 0.05
STEPS = EPOCHS * EXAMPLES // BATCH
# A repaired run's final error may differ from the twin's by this fraction (a repair written another
# way rounds differently or shuffles with another stream), or by NOISE_SLACK when both are near the noise.
TOLERANCE, NOISE_SLACK = 0.5, 0.02

STAGES = {
    "make_batches": "make_batches(x, y, batch_size, generator) -> list of (inputs, targets) pairs: one epoch "
                    "of shuffled mini-batches drawn with `generator`",
    "loss_of": "loss_of(prediction, target) -> scalar tensor: the batch's mean squared error",
    "update": "update(model, optimizer, loss) -> None: one SGD step on `loss` (gradients of this batch only)",
}


def make_batches(x, y, batch_size, generator):
    order = torch.randperm(len(x), generator=generator)
    return [(x[order[i:i + batch_size]], y[order[i:i + batch_size]]) for i in range(0, len(x), batch_size)]


def loss_of(prediction, target):
    return F.mse_loss(prediction, target)


def update(model, optimizer, loss):
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _summed_loss(prediction, target):
    return ((prediction - target) ** 2).sum()


def _update_keeping_grads(model, optimizer, loss):
    loss.backward()
    optimizer.step()


def _batches_unpaired(x, y, batch_size, generator):
    inputs = torch.randperm(len(x), generator=generator)
    targets = torch.randperm(len(x), generator=generator)
    return [(x[inputs[i:i + batch_size]], y[targets[i:i + batch_size]]) for i in range(0, len(x), batch_size)]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def train(stages, seed: int) -> Run:
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES, FEATURES, generator=data)
    y = x @ torch.randn(FEATURES, 1, generator=data) + 0.1 * torch.randn(EXAMPLES, 1, generator=data)
    model = seeded(_model, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    trace = {"loss_ratio": [], "grad_ratio": [], "paired": [0, 0], "one_step": _one_step_effect(model, x, y)}
    fresh: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: trace["grad_ratio"].append(_ratio(params, fresh)))
    first_feature, order = x[:, 0].sort()
    losses = []
    shuffle = torch.Generator().manual_seed(seed + 1)
    for _ in range(EPOCHS):
        for inputs, targets in stages["make_batches"](x, y, BATCH, shuffle):
            rows = order[torch.searchsorted(first_feature, inputs[:, 0].contiguous()).clamp_max(EXAMPLES - 1)]
            trace["paired"][0] += int((y[rows] == targets).sum())
            trace["paired"][1] += len(inputs)
            prediction = model(inputs)
            loss = stages["loss_of"](prediction, targets)
            trace["loss_ratio"].append(loss.item() / F.mse_loss(prediction, targets).item())
            fresh[:] = torch.autograd.grad(loss, params, retain_graph=True)
            stages["update"](model, optimizer, loss)
            losses.append(loss.item())
    with torch.no_grad():
        final = F.mse_loss(model(x), y).item()
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(EXAMPLES, 1)], 1), y).solution
    best_linear = F.mse_loss(torch.cat([x, torch.ones(EXAMPLES, 1)], 1) @ solution, y).item()
    trace |= {"input_mean": x.mean(0).abs().max().item(), "input_std": (x.std(0) - 1).abs().max().item(),
              "best_linear": best_linear}
    return Run({"final_error": final}, trace, {"model": model, "optimizer": optimizer, "x": x, "y": y,
                                               "losses": losses}, audit.problems(STEPS))


def _one_step_effect(model: nn.Module, x, y) -> tuple[float, float]:
    """The full-data error before and after one SGD step at the lab's rate on the error itself."""
    probe = seeded(_model, 0)
    probe.load_state_dict(model.state_dict())
    loss = F.mse_loss(probe(x), y)
    grads = torch.autograd.grad(loss, list(probe.parameters()))
    with torch.no_grad():
        for p, g in zip(probe.parameters(), grads):
            p -= LR * g
        return loss.item(), F.mse_loss(probe(x), y).item()


def _ratio(params, fresh) -> float:
    applied = torch.cat([p.grad.flatten() for p in params])
    reference = torch.cat([g.flatten() for g in fresh])
    return (applied.norm() / reference.norm().clamp_min(1e-12)).item()


def show(run: Run) -> None:
    losses = run.objects["losses"]
    print(f"training loss by step ({STEPS} SGD steps, lr {LR}): {curve_text(losses)}")
    print(f"final mean squared error on all {EXAMPLES} examples: {number(run.metrics['final_error'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics["final_error"], twin.metrics["final_error"]
    said = f"final mean squared error {number(mine)}, the defect-free run's {number(theirs)}"
    return relative_gap(mine, theirs) <= TOLERANCE or abs(mine - theirs) <= NOISE_SLACK, said


def _grad_measure(defective: Run, twin: Run) -> str:
    ratios = defective.trace["grad_ratio"]
    return (f"at every optimizer.step the gradient applied is that step's own loss gradient (its norm ratio to a "
            f"fresh torch.autograd.grad of the step's loss stays within {number(min(ratios))}-{number(max(ratios))})"
            if max(ratios) < 1.01 else
            f"the gradient applied grows past the step's own loss gradient (norm ratio up to {number(max(ratios))})")


CAUSES = (
    Cause("the loss is summed over the batch instead of averaged",
          lambda d, t: f"loss_of returns {number(max(d.trace['loss_ratio']))} times the batch's mean squared error "
                       "at most (F.mse_loss on the same prediction and target)"),
    Cause("gradients are never cleared between steps", _grad_measure),
    Cause("targets are shuffled apart from their inputs",
          lambda d, t: f"{d.trace['paired'][0]} of the {d.trace['paired'][1]} input rows the batches held came with "
                       "their own target from the dataset"),
    Cause("the learning rate is too high",
          lambda d, t: "one SGD step at the lab's learning rate on the full-data error lowers it from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
    Cause("the inputs are not normalised",
          lambda d, t: f"every input feature has |mean| ≤ {number(d.trace['input_mean'])} and a standard deviation "
                       f"within {number(d.trace['input_std'])} of 1"),
    Cause("the model is too small for the data",
          lambda d, t: f"even a linear least-squares fit (torch.linalg.lstsq) reaches an error of "
                       f"{number(d.trace['best_linear'])} on this data"),
)

LAB = Lab(
    id="00",
    notebook="00_start_here",
    title="a regression network whose loss misbehaves",
    section="Why it matters: a training loop that never clears `.grad`",
    stages=STAGES,
    correct={"make_batches": make_batches, "loss_of": loss_of, "update": update},
    causes=CAUSES,
    variants=(
        Variant("00.a", CAUSES[0].name, "loss explodes", {"loss_of": _summed_loss}),
        Variant("00.b", CAUSES[1].name, "loss stays high", {"update": _update_keeping_grads}),
        Variant("00.c", CAUSES[2].name, "loss stays high", {"make_batches": _batches_unpaired}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure before you choose: compare what each stage hands on (the loss value, .grad at optimizer.step, "
        "the batches) with what it should be",
        "each cause has a measurement that confirms or rules it out; repair only the stage whose measurement is off, "
        "keeping its contract (lab.stages)",
        "reread the notebook's section 'Why it matters: a training loop that never clears `.grad`' and the "
        "exercises above, then measure your run the same way",
    ),
)
