"""Lab 04: a classifier reading a noisy latent, validated after every epoch; three places the gradient stops.

Taught in 04_autograd_modes (cases N1, N2 and N3). The model (an encoder with BatchNorm and Dropout
giving a 4-dimensional Gaussian latent, and a linear head) and its data (three classes of a linear
rule over scaled features) appear nowhere in the notebook. The gradient stops under a `no_grad` in
the forward pass, at a `sample()`, or everywhere after a `set_grad_enabled(False)` that validation
leaks. Recovery: every parameter trains and the held-out accuracy reaches the twin's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant
from labkit.messages import describe_error

__all__: list[str] = []

FEATURES, WIDTH, LATENT, CLASSES, DROPOUT = 16, 48, 4, 3, 0.2
EXAMPLES, HELD_OUT, BATCH, EPOCHS, LR = 512, 512, 32, 4, 0.1
STEPS = EPOCHS * EXAMPLES // BATCH
# A repaired run's held-out accuracy may differ from the twin's by this much (a repair written another way
# draws its noise with another call, so the runs differ by the noise only); every defect is further below.
ACCURACY_GAP = 0.05

STAGES = {
    "encode": "encode(model, inputs) -> (mu, log_std): model.encoder's output split into the latent's mean and log "
              "standard deviation, recorded for backward",
    "draw_latent": "draw_latent(mu, log_std) -> tensor: one draw from Normal(mu, exp(log_std)) that the gradient "
                   "flows through to mu and log_std",
    "validate": "validate(model, inputs) -> logits: after each epoch, model.predict(inputs) in eval mode, recording "
                "no graph, leaving the grad mode as it found it",
}


def encode(model, inputs):
    return model.encoder(inputs).chunk(2, 1)


def draw_latent(mu, log_std):
    return torch.distributions.Normal(mu, log_std.exp()).rsample()


def validate(model, inputs):
    model.eval()
    with torch.no_grad():
        return model.predict(inputs)


def _encode_without_grad(model, inputs):
    with torch.no_grad():
        out = model.encoder(inputs)
    return out.chunk(2, 1)


def _draw_latent_sampled(mu, log_std):
    return torch.distributions.Normal(mu, log_std.exp()).sample()


def _validate_leaving_grad_off(model, inputs):
    model.eval()
    torch.set_grad_enabled(False)
    return model.predict(inputs)


class NoisyLatent(nn.Module):
    """A classifier that reads a noisy latent in training and the latent's mean in prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, WIDTH, bias=False), nn.BatchNorm1d(WIDTH), nn.ReLU(),
                                     nn.Dropout(DROPOUT), nn.Linear(WIDTH, 2 * LATENT))
        self.head = nn.Linear(LATENT, CLASSES)

    def predict(self, x):
        return self.head(self.encoder(x)[:, :LATENT])


def dataset(seed: int) -> tuple[torch.Tensor, ...]:
    """Training, validation and held-out inputs with their classes (a linear rule over scaled features)."""
    data = torch.Generator().manual_seed(seed)
    total = 2 * EXAMPLES + HELD_OUT
    z = torch.randn(total, FEATURES, generator=data)
    y = (z @ torch.randn(FEATURES, CLASSES, generator=data)).argmax(1)
    x = z * (1 + 2 * torch.rand(FEATURES, generator=data)) + torch.randn(FEATURES, generator=data)
    cut = (EXAMPLES, 2 * EXAMPLES)
    return x[:cut[0]], y[:cut[0]], x[cut[0]:cut[1]], y[cut[0]:cut[1]], x[cut[1]:], y[cut[1]:]


def train(stages, seed: int) -> Run:
    """The run, with torch's global stream (Dropout's and the latent's noise) at ``seed`` and given back after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        grad_mode = torch.is_grad_enabled()
        try:
            return _train(stages, seed)
        finally:
            torch.set_grad_enabled(grad_mode)  # a leaked set_grad_enabled(False) stays in the lab


def _train(stages, seed: int) -> Run:
    x, y, x_val, y_val, x_test, y_test = dataset(seed)
    model = seeded(NoisyLatent, seed)
    params = list(model.parameters())
    initial = [p.detach().clone() for p in params]
    optimizer, audit = audited_sgd(params, LR)
    modal = [m for m in model.modules() if isinstance(m, nn.Dropout | nn.BatchNorm1d)]
    trace = {"modes": set(), "grad_enabled": set(), "error": None, "steps": 0,
             "encode_grad_off": _grad_off_inside(stages["encode"], seed),
             "draw_grads": _draw_reaches(stages["draw_latent"]), "one_step": _one_step_effect(x, y, seed)}
    order = torch.Generator().manual_seed(seed + 1)
    losses, accuracies = [], []
    for _ in range(EPOCHS):
        model.train()
        for rows in torch.randperm(EXAMPLES, generator=order).split(BATCH):
            trace["modes"] |= {m.training for m in modal}
            trace["grad_enabled"].add(torch.is_grad_enabled())
            optimizer.zero_grad()
            mu, log_std = stages["encode"](model, x[rows])
            loss = F.cross_entropy(model.head(stages["draw_latent"](mu, log_std)), y[rows])
            losses.append(loss.item())
            try:
                loss.backward()
            except RuntimeError as error:
                trace["error"] = (len(losses), describe_error(error, 300))
                break
            optimizer.step()
            trace["steps"] += 1
        if trace["error"] is not None:
            break
        accuracies.append((stages["validate"](model, x_val).argmax(1) == y_val).float().mean().item())
    torch.set_grad_enabled(True)
    model.eval()
    with torch.no_grad():
        accuracy = (model.predict(x_test).argmax(1) == y_test).float().mean().item()
    trace["moved"] = {name: (p.detach() - before).norm().item()
                      for (name, p), before in zip(model.named_parameters(), initial)}
    # a run that backward stopped took the steps before the error: the recovery says so, not the audit
    taken = STEPS if trace["error"] is None else trace["steps"]
    return Run({"accuracy": accuracy}, trace,
               {"model": model, "optimizer": optimizer, "x": x, "y": y, "x_val": x_val, "y_val": y_val,
                "x_test": x_test, "y_test": y_test, "losses": losses, "val_accuracies": accuracies},
               audit.problems(taken))


def _grad_off_inside(encode_stage, seed: int) -> list[str]:
    """The encoder's modules that run with grad mode off when the encode stage is called with it on."""
    with torch.random.fork_rng(devices=[]):
        probe = seeded(NoisyLatent, seed)
        off: list[str] = []
        handles = [module.register_forward_pre_hook(
            lambda module, args, name=name: None if torch.is_grad_enabled() else off.append(name))
            for name, module in probe.encoder.named_children()]
        with torch.enable_grad():
            encode_stage(probe, torch.zeros(BATCH, FEATURES))
        for handle in handles:
            handle.remove()
    return off


def _draw_reaches(draw_stage) -> tuple[bool, bool]:
    """Whether a draw of the stage has a gradient with respect to mu, and to log_std, on a probe."""
    with torch.random.fork_rng(devices=[]):
        mu, log_std = torch.zeros(4, LATENT, requires_grad=True), torch.zeros(4, LATENT, requires_grad=True)
        drawn = draw_stage(mu, log_std)
        if not drawn.requires_grad:
            return False, False
        grads = torch.autograd.grad(drawn.sum(), [mu, log_std], allow_unused=True)
    return grads[0] is not None, grads[1] is not None


def _one_step_effect(x, y, seed: int) -> tuple[float, float]:
    """The full training set's loss (the latent's mean, eval mode) of the initial model before and after one
    SGD step at LR on it."""
    with torch.random.fork_rng(devices=[]):
        probe = seeded(NoisyLatent, seed)
        probe.eval()
        loss = F.cross_entropy(probe.predict(x), y)
        loss.backward()
        with torch.no_grad():
            for p in probe.parameters():
                p -= LR * p.grad
            return loss.item(), F.cross_entropy(probe.predict(x), y).item()


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}): {curve_text(run.objects['losses'])}")
    if run.trace["error"] is not None:
        step, message = run.trace["error"]
        print(f"step {step}: loss.backward() raised {message}")
    print("validation accuracy after each epoch: "
          + ("  ".join(f"{a:.1%}" for a in run.objects["val_accuracies"]) or "(no epoch finished)"))
    print(f"held-out accuracy in eval mode: {run.metrics['accuracy']:.1%}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    if repaired.trace["error"] is not None:
        step, message = repaired.trace["error"]
        return False, f"at step {step} loss.backward() still raises {message}"
    still = [name for name, change in repaired.trace["moved"].items() if change == 0]
    mine, theirs = repaired.metrics["accuracy"], twin.metrics["accuracy"]
    said = (f"held-out accuracy {mine:.1%}, the defect-free run's {theirs:.1%}; "
            + (f"parameters that never moved: {', '.join(still)}" if still else "every parameter moved"))
    return not still and mine >= theirs - ACCURACY_GAP, said


def _draw_measure(defective: Run, twin: Run) -> str:
    to_mu, to_log_std = defective.trace["draw_grads"]
    return ("a draw of draw_latent has a gradient with respect to both mu and log_std (torch.autograd.grad on "
            "a probe)" if to_mu and to_log_std else "a draw of draw_latent has no gradient with respect to mu or log_std")


CAUSES = (
    Cause("part of the training forward runs under torch.no_grad()",
          lambda d, t: "called with grad mode on, encode keeps it on in every module of the encoder (a forward "
                       f"pre-hook reading torch.is_grad_enabled() finds it off in {len(d.trace['encode_grad_off'])})"),
    Cause("the latent is drawn with sample() instead of rsample()", _draw_measure),
    Cause("validation switches the grad mode off and leaves it off",
          lambda d, t: "torch.is_grad_enabled() is True at every training step"
                       if d.trace["grad_enabled"] == {True} else "some training step runs with grad mode off"),
    Cause("the model trains in eval mode",
          lambda d, t: "at every training step each Dropout and BatchNorm module has training=True"
                       if d.trace["modes"] == {True} else "some Dropout or BatchNorm module trains in eval mode"),
    Cause("the learning rate is too high",
          lambda d, t: "one full-batch SGD step at the lab's learning rate lowers the training loss from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
)

LAB = Lab(
    id="04",
    notebook="04_autograd_modes",
    title="a noisy-latent classifier validated after every epoch",
    section="Case N1: does `model.train()` inside `torch.no_grad()` turn gradients back on?",
    stages=STAGES,
    correct={"encode": encode, "draw_latent": draw_latent, "validate": validate},
    causes=CAUSES,
    variants=(
        Variant("04.a", CAUSES[0].name, "accuracy stays low", {"encode": _encode_without_grad}),
        Variant("04.b", CAUSES[1].name, "accuracy stays low", {"draw_latent": _draw_latent_sampled}),
        Variant("04.c", CAUSES[2].name, "backward raises: does not require grad", {"validate": _validate_leaving_grad_off}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "watch the switches at every stage: torch.is_grad_enabled() and each module's .training, which "
        "parameters the training loss reaches, and what each stage's output has a gradient with respect to",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's cases N1 (train() and no_grad are independent switches), N2 (sample() and rsample()) "
        "and N3 (an op under no_grad cuts the parameters behind it), then measure your run the same way",
    ),
)
