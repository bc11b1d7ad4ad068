"""Lab 08: a deep ReLU regression network whose loss will not come down; three ways a gradient stops short.

Taught in 08_gradient_health ("The instrument: `GradTracer` on a network that goes wrong"). The
model (a 16-32-32-32-32-32-2 ReLU network) and the data (two smooth targets of a random tanh teacher
over 16 features) appear nowhere in the notebook. The run trains under a `GradTracer` with
``activations=True``, handed to the learner as ``lab.tracer``. Recovery is gradient health as the
notebook measures it: the first layer's gradient (root mean square, median over the run) at least a
tenth of the defect-free run's, and the held-out loss near the defect-free run's.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant
from labkit.tracers.grad_tracer import GradTracer

__all__: list[str] = []

FEATURES, WIDTH, HIDDEN_LAYERS, OUTPUTS = 16, 32, 5, 2
EXAMPLES, STEPS, BATCH, LR = 512, 150, 128, 0.05
FIRST = "0.weight"  # the first layer's weight, as GradTracer names it
# A repaired run's first-layer gradient (median RMS) must reach GRADIENT_SHARE of the twin's (each
# defect leaves it below 1e-5 of it, or at 0); its held-out loss may exceed the twin's by TOLERANCE
# (relative) + SLACK (another correct initialisation draws other weights: held-out losses of 0.23 to 0.53
# where the twin's are 0.33 to 0.49, seeds 0-11). An untrained network's loss is
# about the targets' mean square (1) or more: a first step below UNTRAINED_SHARE of it started from
# trained weights.
GRADIENT_SHARE, TOLERANCE, SLACK, UNTRAINED_SHARE = 0.1, 0.5, 0.02, 0.5

STAGES = {
    "init_weight": "init_weight(weight) -> None: once per Linear layer, before training (under torch.no_grad, "
                   "torch's random stream seeded): fills the layer's weight, of shape (out, in), in place",
    "init_bias": "init_bias(bias) -> None: once per Linear layer, before training: fills the layer's bias in place",
    "forward": "forward(model, inputs) -> tensor of shape (batch, 2): the model's layers (model, an nn.Sequential "
               "of Linear and ReLU) applied to inputs in order",
}


def init_weight(weight):
    nn.init.kaiming_normal_(weight, nonlinearity="relu")


def init_bias(bias):
    nn.init.zeros_(bias)


def forward(model, inputs):
    return model(inputs)


def _init_weight_small(weight):
    nn.init.normal_(weight, std=0.1 / math.sqrt(weight.shape[1]))


def _init_bias_negative(bias):
    nn.init.constant_(bias, -1.0)


def _forward_detached(model, inputs):
    h = inputs
    for index, layer in enumerate(model):
        h = layer(h)
        if index == 5:  # after the third ReLU
            h = h.detach()
    return h


def _model() -> nn.Sequential:
    sizes = [FEATURES] + [WIDTH] * HIDDEN_LAYERS
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, OUTPUTS))


def dataset(seed: int) -> tuple[torch.Tensor, ...]:
    """Standard normal inputs and two targets read out of a random 16-8 tanh teacher, each of unit variance."""
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * EXAMPLES, FEATURES, generator=data)
    hidden = torch.tanh(2 * x @ torch.randn(FEATURES, 8, generator=data) / FEATURES**0.5)
    y = hidden @ torch.randn(8, OUTPUTS, generator=data)
    y = y / y.std(0)
    return x[:EXAMPLES], y[:EXAMPLES], x[EXAMPLES:], y[EXAMPLES:]


def _initialised(stages, seed: int) -> nn.Sequential:
    def build():
        model = _model()
        with torch.no_grad():
            for layer in model:
                if isinstance(layer, nn.Linear):
                    stages["init_weight"](layer.weight)
                    stages["init_bias"](layer.bias)
        return model

    return seeded(build, seed)


def train(stages, seed: int) -> Run:
    x, y, x_test, y_test = dataset(seed)
    model = _initialised(stages, seed)
    linears = [layer for layer in model if isinstance(layer, nn.Linear)]
    he_scale = [(layer.weight.std() * math.sqrt(layer.in_features / 2)).item() for layer in linears]
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    with GradTracer(model, optimizer, activations=True) as tracer:
        for _ in range(STEPS):
            rows = torch.randperm(EXAMPLES, generator=order)[:BATCH]
            loss = F.mse_loss(stages["forward"](model, x[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    with torch.no_grad():
        test_loss = F.mse_loss(model(x_test), y_test).item()
    history = tracer.history()
    first_rms = [0.0 if row["missing"] else row["norm"] / math.sqrt(row["numel"])
                 for row in history if row["param"] == FIRST]
    first_dead = [row["dead"] for row in tracer.activation_history() if row["step"] == 0 and row["dead"] is not None]
    trace = {"first_rms": statistics.median(first_rms), "he_scale": he_scale, "dead_at_start": first_dead,
             "missing": sum(row["missing"] for row in history),
             "nonfinite": sum(bool(row["nonfinite"]) for row in history),
             "loss_ratio": losses[-1] / losses[0],
             "input_mean": x.mean(0).abs().max().item(), "input_std": (x.std(0) - 1).abs().max().item()}
    untrained = y.pow(2).mean().item()
    written = ([f"the first step's loss, {number(losses[0])}, is below half an untrained network's "
                f"({number(untrained)}): the weights were trained before training began (written in, not initialised)"]
               if losses[0] < UNTRAINED_SHARE * untrained else [])
    return Run({"test_loss": test_loss, "first_rms": trace["first_rms"]}, trace,
               {"model": model, "optimizer": optimizer, "tracer": tracer, "x": x, "y": y, "x_test": x_test,
                "y_test": y_test, "losses": losses}, written + audit.problems(STEPS))


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}): {curve_text(run.objects['losses'])}")
    print(f"held-out loss (mean squared error, targets of variance 1): {number(run.metrics['test_loss'])}")
    print("the run trained under a GradTracer(model, optimizer, activations=True): it is lab.tracer")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics, twin.metrics
    said = (f"the first layer's gradient (RMS, median over the run) is {number(mine['first_rms'])}, the defect-free "
            f"run's {number(theirs['first_rms'])}; held-out loss {number(mine['test_loss'])}, the defect-free run's "
            f"{number(theirs['test_loss'])}")
    recovered = (mine["first_rms"] >= GRADIENT_SHARE * theirs["first_rms"]
                 and mine["test_loss"] <= theirs["test_loss"] * (1 + TOLERANCE) + SLACK)
    return recovered, said


CAUSES = (
    Cause("the initial weights are too small: the gradient vanishes on its way down",
          lambda d, t: "every layer's initial weight has a standard deviation of "
                       f"{min(d.trace['he_scale']):.2f} to {max(d.trace['he_scale']):.2f} times He's sqrt(2 / fan_in), "
                       "the scale that keeps a ReLU layer's signal and gradient the same size"),
    Cause("the biases start negative: the ReLU units are dead",
          lambda d, t: "at the first step the ReLU layers' shares of units that never fired are "
                       + ", ".join(f"{share:.0%}" for share in d.trace["dead_at_start"])
                       + " (lab.tracer.activation_history())"),
    Cause("the forward detaches the hidden state: no gradient reaches the early layers",
          lambda d, t: f"GradTracer records {d.trace['missing']} missing gradients over the run: every layer's "
                       "weight receives a gradient at every step (a layer behind a detach receives none)"),
    Cause("the initial weights are too large: the gradient explodes",
          lambda d, t: f"the loss ends at {d.trace['loss_ratio']:.2g} times its first value and {d.trace['nonfinite']} "
                       "gradients are non-finite (GradTracer): nothing explodes"),
    Cause("the inputs are not normalised",
          lambda d, t: f"every input feature has |mean| ≤ {number(d.trace['input_mean'])} and a standard deviation "
                       f"within {number(d.trace['input_std'])} of 1"),
)

LAB = Lab(
    id="08",
    notebook="08_gradient_health",
    title="a deep ReLU network whose loss will not come down",
    section="The instrument: `GradTracer` on a network that goes wrong",
    stages=STAGES,
    correct={"init_weight": init_weight, "init_bias": init_bias, "forward": forward},
    causes=CAUSES,
    variants=(
        Variant("08.a", CAUSES[0].name, "loss stays at the targets' variance", {"init_weight": _init_weight_small}),
        Variant("08.b", CAUSES[1].name, "loss stays at the targets' variance", {"init_bias": _init_bias_negative}),
        Variant("08.c", CAUSES[2].name, "loss plateaus above where it should", {"forward": _forward_detached}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "read the run's GradTracer (lab.tracer): each layer's gradient against the head's, which gradients are "
        "missing, which ReLU units never fire (activation_history), and the scale of the initial weights",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's section 'The instrument: GradTracer on a network that goes wrong' (vanishing, "
        "dead and missing, and their activation histograms), then read your run's tracer the same way",
    ),
)
