"""Lab 02: gradient accumulation over micro-batches with clipping; three defects of the accumulated step.

Taught in 02_gradients_accumulate (cases B1, B4 and B7). The model (a 16-32-1 ReLU regression
network) and the data (a noisy tanh rule over 16 features, a few rows scaled up as by a faulty
sensor, which is why the loop clips) appear nowhere in the notebook. Recovery is what case B4
measures: the gradient each step applies equals the whole batch's (here clipped to max_norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, grad_norm, number, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

EXAMPLES, FEATURES, HIDDEN = 512, 16, 32
STEPS, MICRO_BATCHES, MICRO_SIZE, LR, MAX_NORM = 30, 4, 16, 0.2, 3.0
OUTLIER_SHARE, OUTLIER_SCALE = 0.02, 10.0
# At every step of a repaired run, the gradient optimizer.step uses may differ from the step's whole-batch
# gradient clipped to MAX_NORM by this much (relative): rounding, as a repair written another way adds in
# another order; a defect differs by 10% or more. Its final error may exceed the twin's by TOLERANCE + SLACK.
GRADIENT_GAP, TOLERANCE, SLACK = 1e-3, 0.25, 0.02

STAGES = {
    "begin_step": "begin_step(model, optimizer, max_norm) -> None: prepares one optimizer step, before the "
                  "micro-batches' backward passes",
    "micro_loss": "micro_loss(model, inputs, targets, micro_batches) -> scalar tensor: the loss whose backward "
                  "adds this micro-batch's share of the step's gradient",
    "finish_step": "finish_step(model, optimizer, max_norm) -> None: ends the step, after every micro-batch's "
                   "backward: the step's gradient norm clipped to max_norm, then the update",
}


def begin_step(model, optimizer, max_norm):
    optimizer.zero_grad()


def micro_loss(model, inputs, targets, micro_batches):
    return F.mse_loss(model(inputs), targets) / micro_batches


def finish_step(model, optimizer, max_norm):
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


def _begin_without_clearing(model, optimizer, max_norm):
    pass


def _unscaled_micro_loss(model, inputs, targets, micro_batches):
    return F.mse_loss(model(inputs), targets)


def _begin_clipping_early(model, optimizer, max_norm):
    optimizer.zero_grad()
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _finish_unclipped(model, optimizer, max_norm):
    optimizer.step()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets, and which rows are clean (the others' inputs are scaled up, as by a faulty sensor)."""
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES, FEATURES, generator=data)
    y = torch.tanh(x @ torch.randn(FEATURES, 1, generator=data) / 2) + 0.1 * torch.randn(EXAMPLES, 1, generator=data)
    faulty = torch.rand(EXAMPLES, generator=data) < OUTLIER_SHARE
    x[faulty] *= OUTLIER_SCALE
    return x, y, ~faulty


def train(stages, seed: int) -> Run:
    x, y, clean = dataset(seed)
    model = seeded(_model, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    trace = {"left_after_begin": [], "loss_ratio": [], "norm_at_step": [], "grad_gap": []}
    reference: list[torch.Tensor] = []

    def at_step(opt, args, kwargs) -> None:
        trace["norm_at_step"].append(grad_norm(params))
        trace["grad_gap"].append(_gap(params, reference))

    optimizer.register_step_pre_hook(at_step)
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(STEPS):
        rows = torch.randperm(EXAMPLES, generator=order)[:MICRO_BATCHES * MICRO_SIZE].view(MICRO_BATCHES, MICRO_SIZE)
        reference[:] = _clipped_batch_gradient(model, x[rows.flatten()], y[rows.flatten()])
        stages["begin_step"](model, optimizer, MAX_NORM)
        trace["left_after_begin"].append(grad_norm(params))
        step_loss = 0.0
        for micro in rows:
            loss = stages["micro_loss"](model, x[micro], y[micro], MICRO_BATCHES)
            with torch.no_grad():
                plain = F.mse_loss(model(x[micro]), y[micro]).item()
            trace["loss_ratio"].append(loss.item() / max(plain, 1e-12))
            loss.backward()
            step_loss += plain / MICRO_BATCHES
        stages["finish_step"](model, optimizer, MAX_NORM)
        losses.append(step_loss)
    with torch.no_grad():
        final = F.mse_loss(model(x[clean]), y[clean]).item()
    trace |= {"one_step": _one_step_effect(x, y, seed), "explained": _explained(x, y)}
    return Run({"final_loss": final}, trace,
               {"model": model, "optimizer": optimizer, "x": x, "y": y, "losses": losses,
                "grad_norms": trace["norm_at_step"]}, audit.problems(STEPS))


def _clipped_batch_gradient(model, inputs, targets) -> list[torch.Tensor]:
    """The step's whole-batch gradient, clipped to MAX_NORM as clip_grad_norm_ does: what the step should apply."""
    grads = torch.autograd.grad(F.mse_loss(model(inputs), targets), list(model.parameters()))
    scale = min(1.0, MAX_NORM / (torch.nn.utils.get_total_norm(grads).item() + 1e-6))
    return [g * scale for g in grads]


def _gap(params, reference) -> float:
    """The relative distance between the gradient in .grad and ``reference``."""
    applied = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    wanted = torch.cat([g.flatten() for g in reference])
    return ((applied - wanted).norm() / wanted.norm().clamp_min(1e-12)).item()


def _one_step_effect(x, y, seed: int) -> tuple[float, float]:
    """The full-data loss of the initial model before and after one clipped SGD step at the lab's rate."""
    probe = seeded(_model, seed)
    loss = F.mse_loss(probe(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(probe.parameters(), MAX_NORM)
    with torch.no_grad():
        for p in probe.parameters():
            p -= LR * p.grad
        return loss.item(), F.mse_loss(probe(x), y).item()


def _explained(x, y) -> float:
    """The share of the targets' variance a least-squares linear fit explains: how much signal the data holds."""
    features = torch.cat([x, torch.ones(len(x), 1)], 1)
    fit = features @ torch.linalg.lstsq(features, y).solution
    return 1 - ((fit - y) ** 2).mean().item() / y.var().item()


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} steps of {MICRO_BATCHES} micro-batches of {MICRO_SIZE}, SGD lr {LR}, "
          f"clipped to norm {MAX_NORM}): {curve_text(run.objects['losses'])}")
    print(f"gradient norm at optimizer.step, largest: {number(max(run.trace['norm_at_step']))}")
    print(f"final mean squared error on the clean training examples: {number(run.metrics['final_loss'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    gaps = repaired.trace["grad_gap"]
    worst = max(range(len(gaps)), key=lambda step: gaps[step])
    mine, theirs = repaired.metrics["final_loss"], twin.metrics["final_loss"]
    said = (f"the gradient at optimizer.step differs from the step's whole-batch gradient clipped to max_norm by "
            f"{gaps[worst]:.1e} at most (step {worst + 1}); final error {number(mine)}, the defect-free run's "
            f"{number(theirs)}")
    return gaps[worst] <= GRADIENT_GAP and mine <= theirs * (1 + TOLERANCE) + SLACK, said


CAUSES = (
    Cause("gradients are not cleared between steps",
          lambda d, t: "right after begin_step the gradient norm is "
                       f"{number(max(d.trace['left_after_begin']))} at most: each step starts from empty gradients"),
    Cause("micro-batch losses are not divided by the number of micro-batches",
          lambda d, t: f"micro_loss returns {number(min(d.trace['loss_ratio']))}-{number(max(d.trace['loss_ratio']))} "
                       f"times the micro-batch's mean squared error, 1/{MICRO_BATCHES} as accumulation asks"),
    Cause("gradients are clipped before the backward pass",
          lambda d, t: f"at optimizer.step the gradient norm is {number(max(d.trace['norm_at_step']))} at most, "
                       f"within max_norm {MAX_NORM}: the gradient the step uses is clipped"),
    Cause("the learning rate is too high",
          lambda d, t: "one clipped SGD step at the lab's learning rate on the full-data loss lowers it from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
    Cause("the targets are too noisy to learn",
          lambda d, t: "a linear least-squares fit (torch.linalg.lstsq) already explains "
                       f"{d.trace['explained']:.0%} of the targets' variance"),
)

LAB = Lab(
    id="02",
    notebook="02_gradients_accumulate",
    title="an accumulated, clipped training step",
    section="Case B4: does accumulating `loss / k` over k micro-batches equal one batch k times larger?",
    stages=STAGES,
    correct={"begin_step": begin_step, "micro_loss": micro_loss, "finish_step": finish_step},
    causes=CAUSES,
    variants=(
        Variant("02.a", CAUSES[0].name, "loss jumps up and down", {"begin_step": _begin_without_clearing}),
        Variant("02.b", CAUSES[1].name, "loss jumps up and down", {"micro_loss": _unscaled_micro_loss}),
        Variant("02.c", CAUSES[2].name, "gradient norm spikes past max_norm",
                {"begin_step": _begin_clipping_early, "finish_step": _finish_unclipped}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure each stage's hand-over: .grad right after begin_step, micro_loss against F.mse_loss, the "
        "gradient norm at optimizer.step (optimizer.register_step_pre_hook) against max_norm",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's cases B1 (zero_grad), B4 (accumulating loss / k) and B7 (where clipping goes), then "
        "measure your run the way they do",
    ),
)
