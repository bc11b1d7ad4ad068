"""Lab 01: a two-target regression network whose loss stays high; three ways a part of it drops out of the graph.

Taught in 01_computation_graph (cases A6 and A7, and exercise 01.2). The model (a tanh encoder of 12
features and a linear head predicting two targets at once) and the data (two smooth rules of the same
inputs) appear nowhere in the notebook. Recovery is what case A7 measures: every parameter reached by
the loss moves, and the held-out error matches the defect-free run's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, one_step_effect, reference_copy, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

FEATURES, WIDTH, TARGETS = 12, 32, 2
EXAMPLES, TEST, BATCH, EPOCHS, LR = 512, 512, 64, 20, 0.2
STEPS = EPOCHS * EXAMPLES // BATCH
# A repaired run's held-out error may differ from the twin's by this fraction (a repair written another
# way rounds differently); every defect leaves it higher by far more.
TOLERANCE = 0.1

STAGES = {
    "prepare": "prepare(model) -> None: once, before training: every parameter of model.encoder and model.head "
               "trains",
    "forward": "forward(model, inputs) -> tensor of shape (batch, 2): model.head applied to model.encoder's "
               "features of inputs",
    "loss_of": "loss_of(prediction, targets) -> scalar tensor: the sum of the two targets' mean squared errors",
}


def prepare(model):
    model.requires_grad_(True)


def forward(model, inputs):
    return model.head(model.encoder(inputs))


def loss_of(prediction, targets):
    return F.mse_loss(prediction[:, 0], targets[:, 0]) + F.mse_loss(prediction[:, 1], targets[:, 1])


_reference_loss = reference_copy(loss_of)  # for the one-step measurement: see `reference_copy`


def _prepare_frozen_encoder(model):
    model.encoder.requires_grad_(False)


def _forward_detached(model, inputs):
    return model.head(model.encoder(inputs).detach())


def _loss_of_second_as_number(prediction, targets):
    return F.mse_loss(prediction[:, 0], targets[:, 0]) + F.mse_loss(prediction[:, 1], targets[:, 1]).item()


class TwoTargets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, TARGETS)

    def forward(self, x):
        return self.head(self.encoder(x))


def dataset(seed: int) -> tuple[torch.Tensor, ...]:
    """Training and held-out inputs and their two targets: a sine and a product of two projections."""
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES + TEST, FEATURES, generator=data)
    u, v, w = (x @ torch.randn(FEATURES, generator=data) / FEATURES**0.5 for _ in range(3))
    y = torch.stack([torch.sin(1.5 * u), u * v + 0.5 * w], 1) + 0.05 * torch.randn(EXAMPLES + TEST, TARGETS,
                                                                                   generator=data)
    return x[:EXAMPLES], y[:EXAMPLES], x[EXAMPLES:], y[EXAMPLES:]


def train(stages, seed: int) -> Run:
    x, y, x_test, y_test = dataset(seed)
    model = seeded(TwoTargets, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    initial = [p.detach().clone() for p in params]
    stages["prepare"](model)
    trace = {"requires_grad": [name for name, p in model.named_parameters() if not p.requires_grad],
             "first_step": _first_step(stages, model, x[:BATCH], y[:BATCH])}
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(EPOCHS):
        for rows in torch.randperm(EXAMPLES, generator=order).split(BATCH):
            optimizer.zero_grad()
            loss = stages["loss_of"](stages["forward"](model, x[rows]), y[rows])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    with torch.no_grad():
        errors = ((model(x_test) - y_test) ** 2).mean(0)
    moved = {name: (p.detach() - before).norm().item() for (name, p), before in zip(model.named_parameters(), initial)}
    trace |= {"moved": moved, "one_step": one_step_effect(seeded(TwoTargets, seed), lambda m: _reference_loss(m(x), y), LR),
              "input_mean": x.mean(0).abs().max().item(), "input_std": (x.std(0) - 1).abs().max().item()}
    return Run({"test_error": errors.sum().item()}, trace,
               {"model": model, "optimizer": optimizer, "x": x, "y": y, "x_test": x_test, "y_test": y_test,
                "losses": losses}, audit.problems(STEPS))


def _first_step(stages, model, inputs, targets) -> dict[str, object]:
    """What the first batch's loss reaches: the parameters that require grad yet get none, and the
    loss's gradient per output column."""
    prediction = stages["forward"](model, inputs)
    loss = stages["loss_of"](prediction, targets)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [prediction] + [p for _, p in named], allow_unused=True)
    return {"unreached": [name for (name, _), grad in zip(named, grads[1:]) if grad is None],
            "column_norms": [grads[0][:, column].norm().item() for column in range(TARGETS)]}


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}): {curve_text(run.objects['losses'])}")
    print(f"held-out error (both targets' mean squared errors summed): {number(run.metrics['test_error'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    still = [name for name, change in repaired.trace["moved"].items() if change == 0]
    mine, theirs = repaired.metrics["test_error"], twin.metrics["test_error"]
    said = (f"held-out error {number(mine)}, the defect-free run's {number(theirs)}; "
            + (f"parameters that never moved: {', '.join(still)}" if still else "every parameter moved"))
    return not still and relative_gap(mine, theirs) <= TOLERANCE, said


CAUSES = (
    Cause("a tensor is detached in the forward pass",
          lambda d, t: "every parameter that requires grad is reached from the first batch's loss "
                       f"(torch.autograd.grad with allow_unused=True gives None for {len(d.trace['first_step']['unreached'])} "
                       "of them; autograd_graph lists no unreachable parameter)"),
    Cause("a layer's parameters have requires_grad switched off",
          lambda d, t: "after prepare every parameter has requires_grad=True "
                       f"({len(d.trace['requires_grad'])} with False)"),
    Cause("a loss term is turned into a Python number",
          lambda d, t: "the first batch's loss has a gradient with respect to both prediction columns (norms "
                       + ", ".join(number(n) for n in d.trace["first_step"]["column_norms"]) + ")"),
    Cause("the learning rate is too high",
          lambda d, t: "one full-batch SGD step at the lab's learning rate lowers the training loss from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
    Cause("the inputs are not normalised",
          lambda d, t: f"every input feature has |mean| ≤ {number(d.trace['input_mean'])} and a standard deviation "
                       f"within {number(d.trace['input_std'])} of 1"),
)

LAB = Lab(
    id="01",
    notebook="01_computation_graph",
    title="a two-target network whose loss stays high",
    section="Case A7: seeing where `detach` cuts a parameter off",
    stages=STAGES,
    correct={"prepare": prepare, "forward": forward, "loss_of": loss_of},
    causes=CAUSES,
    variants=(
        Variant("01.a", CAUSES[0].name, "loss plateaus high", {"forward": _forward_detached}),
        Variant("01.b", CAUSES[1].name, "loss plateaus high", {"prepare": _prepare_frozen_encoder}),
        Variant("01.c", CAUSES[2].name, "loss plateaus high", {"loss_of": _loss_of_second_as_number}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure what the loss reaches: which parameters get a gradient (torch.autograd.grad with allow_unused, "
        "autograd_graph), which require one, and which parts of the prediction the loss depends on",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's cases A6 and A7 (what detach, requires_grad and a Python number cut from the "
        "graph) and exercise 01.2, then measure your run the same way",
    ),
)
