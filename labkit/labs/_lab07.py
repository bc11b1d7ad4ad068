"""Lab 07: norm clipping with a GradScaler on spiking batches; three defects of the clipped step.

Taught in 07_gradient_clipping (case F2 and "A clipping bug that hides: clipping before `unscale_`").
The model (a 20-48-48-5 ReLU classifier) and the data (five Gaussian clusters, every few batches
arriving from a glitching sensor with its readings multiplied) appear nowhere in the notebook.
Recovery is what the notebook measures: the gradient each step applies is the unscaled gradient
clipped by its total norm to max_norm (direction kept), and the run ends as well as the twin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

EXAMPLES, FEATURES, HIDDEN, CLASSES = 1024, 20, 48, 5
STEPS, BATCH, LR, MAX_NORM = 60, 32, 0.2, 1.0
GLITCH_EVERY, GLITCH_SCALE = 6, 25.0
# At every step of a repaired run, the gradient optimizer.step uses may differ from the step's unscaled
# gradient clipped to MAX_NORM by this much (relative): rounding, as a repair written another way adds
# in another order; each defect differs by 0.1 or more on the glitch steps. Its final loss may exceed
# the twin's by TOLERANCE (relative).
GRADIENT_GAP, TOLERANCE = 1e-3, 0.1

STAGES = {
    "clipped": "clipped(model) -> list of tensors: the parameters whose gradients the step clips (all of the "
               "model's)",
    "clip_norm": "clip_norm(parameters, max_norm) -> tensor: scales the parameters' gradients in place so that "
                 "their joint L2 norm is at most max_norm (direction kept); returns the norm before",
    "finish_step": "finish_step(optimizer, scaler, clip) -> None: after backward on the scaled loss: unscales the "
                   "gradients, calls clip() to clip them, then the scaler's step and update",
}


def clipped(model):
    return list(model.parameters())


def clip_norm(parameters, max_norm):
    return nn.utils.clip_grad_norm_(parameters, max_norm)


def finish_step(optimizer, scaler, clip):
    scaler.unscale_(optimizer)
    clip()
    scaler.step(optimizer)
    scaler.update()


def _clipped_head_only(model):
    return list(model[-1].parameters())


def _clip_values(parameters, max_norm):
    parameters = list(parameters)
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    nn.utils.clip_grad_value_(parameters, max_norm)
    return total


def _finish_clipping_scaled(optimizer, scaler, clip):
    clip()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Readings from five Gaussian clusters, and each one's cluster."""
    data = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=data)
    y = torch.randint(0, CLASSES, (EXAMPLES,), generator=data)
    return centres[y] + 2.0 * torch.randn(EXAMPLES, FEATURES, generator=data), y


def is_glitch(step: int) -> bool:
    return step % GLITCH_EVERY == GLITCH_EVERY - 1


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def train(stages, seed: int) -> Run:
    x, y = dataset(seed)
    model = seeded(_model, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    scaler = torch.amp.GradScaler("cpu")
    trace = {"norms": [], "applied": [], "grad_gap": [], "finite": True,
             "handed": len(stages["clipped"](model)), "probe": _probe(stages["clip_norm"], seed),
             "one_step": _one_step_effect(x, y, seed)}
    wanted: list[torch.Tensor] = []

    def at_step(opt, args, kwargs) -> None:
        applied = _flat(_grads(params))
        trace["applied"].append(applied.norm().item())
        trace["grad_gap"].append(((applied - _flat(wanted)).norm() / _flat(wanted).norm().clamp_min(1e-12)).item())

    optimizer.register_step_pre_hook(at_step)
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(STEPS):
        rows = torch.randint(0, EXAMPLES, (BATCH,), generator=order)
        inputs = x[rows] * GLITCH_SCALE if is_glitch(step) else x[rows]
        loss = F.cross_entropy(model(inputs), y[rows])
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        unscaled = [g / scaler.get_scale() for g in _grads(params)]
        norm = torch.nn.utils.get_total_norm(unscaled).item()
        trace["norms"].append(norm)
        trace["finite"] &= math.isfinite(norm)
        wanted[:] = [g * min(1.0, MAX_NORM / (norm + 1e-6)) for g in unscaled]
        stages["finish_step"](optimizer, scaler, lambda: stages["clip_norm"](stages["clipped"](model), MAX_NORM))
        losses.append(loss.item())
    with torch.no_grad():
        final = F.cross_entropy(model(x), y).item()
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return Run({"final_loss": final, "accuracy": accuracy}, trace,
               {"model": model, "optimizer": optimizer, "scaler": scaler, "x": x, "y": y, "losses": losses,
                "grad_norms": trace["norms"]}, audit.problems(STEPS))


def _probe(clip_norm_stage, seed: int) -> tuple[float, float]:
    """A random gradient of norm 10 * MAX_NORM through the run's clip_norm: its norm after, and its cosine to before."""
    generator = torch.Generator().manual_seed(seed + 2)
    holders = [torch.zeros(shape, requires_grad=True) for shape in ((HIDDEN, FEATURES), (HIDDEN,), (CLASSES, HIDDEN))]
    grads = [torch.randn(h.shape, generator=generator) for h in holders]
    scale = 10 * MAX_NORM / _flat(grads).norm()
    for holder, grad in zip(holders, grads):
        holder.grad = grad * scale
    before = _flat([h.grad for h in holders]).clone()
    clip_norm_stage(holders, MAX_NORM)
    after = _flat([h.grad for h in holders])
    return after.norm().item(), (after @ before / (after.norm() * before.norm()).clamp_min(1e-12)).item()


def _one_step_effect(x, y, seed: int) -> tuple[float, float]:
    """The full-data loss of the initial model before and after one clipped SGD step at the lab's rate."""
    probe = seeded(_model, seed)
    loss = F.cross_entropy(probe(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(probe.parameters(), MAX_NORM)
    with torch.no_grad():
        for p in probe.parameters():
            p -= LR * p.grad
        return loss.item(), F.cross_entropy(probe(x), y).item()


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}, GradScaler, clipped to norm {MAX_NORM}; "
          f"every {GLITCH_EVERY}th batch comes from a glitching sensor): {curve_text(run.objects['losses'])}")
    print(f"largest loss after a glitch batch's update: {number(_after_glitch(run))}")
    print(f"final loss on all {EXAMPLES} examples {number(run.metrics['final_loss'])}, accuracy "
          f"{run.metrics['accuracy']:.1%}")


def _after_glitch(run: Run) -> float:
    losses = run.objects["losses"]
    return max(losses[step + 1] for step in range(STEPS - 1) if is_glitch(step))


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    gaps = repaired.trace["grad_gap"]
    if not gaps:
        return False, "no optimizer step was taken"
    worst = max(range(len(gaps)), key=lambda step: gaps[step])
    mine, theirs = repaired.metrics["final_loss"], twin.metrics["final_loss"]
    said = (f"the gradient at optimizer.step differs from the step's unscaled gradient clipped to max_norm by "
            f"{gaps[worst]:.1e} at most (step {worst + 1}); final loss {number(mine)}, the defect-free run's "
            f"{number(theirs)}")
    return gaps[worst] <= GRADIENT_GAP and mine <= theirs * (1 + TOLERANCE), said


def _scaled_measure(defective: Run, twin: Run) -> str:
    ratios = [applied / max(min(norm, MAX_NORM), 1e-12) for applied, norm in zip(defective.trace["applied"], defective.trace["norms"])]
    return (f"at optimizer.step the gradient's norm is {number(min(ratios))} to {number(max(ratios))} times the "
            "unscaled gradient's norm clipped to max_norm: the loss scale does not shrink the steps")


CAUSES = (
    Cause("the gradients are clipped by value where their norm was meant",
          lambda d, t: f"clip_norm, given a gradient of norm {number(10 * MAX_NORM)}, leaves its norm at "
                       f"{number(d.trace['probe'][0])} with cosine {d.trace['probe'][1]:.4f} to the original: it "
                       "scales the whole gradient to max_norm"),
    Cause("the clip covers only some of the model's parameters",
          lambda d, t: f"clipped(model) hands over {d.trace['handed']} parameter tensors; the model has "
                       f"{len(list(d.objects['model'].parameters()))}"),
    Cause("the gradients are clipped before scaler.unscale_", _scaled_measure),
    Cause("the learning rate is too high",
          lambda d, t: "one clipped SGD step at the lab's learning rate lowers the full-data loss from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
    Cause("a NaN or inf gradient reaches the weights",
          lambda d, t: f"every step's unscaled gradient is finite: {d.trace['finite']}; the largest norm is "
                       f"{number(max(d.trace['norms']))}"),
)

LAB = Lab(
    id="07",
    notebook="07_gradient_clipping",
    title="norm clipping with a GradScaler on spiking batches",
    section="Case F2: value clipping versus norm clipping, and 'A clipping bug that hides: clipping before "
            "`unscale_`'",
    stages=STAGES,
    correct={"clipped": clipped, "clip_norm": clip_norm, "finish_step": finish_step},
    causes=CAUSES,
    variants=(
        Variant("07.a", CAUSES[0].name, "loss stays high and jumps after glitch batches", {"clip_norm": _clip_values}),
        Variant("07.b", CAUSES[1].name, "loss stays high and jumps after glitch batches", {"clipped": _clipped_head_only}),
        Variant("07.c", CAUSES[2].name, "loss stays at its start", {"finish_step": _finish_clipping_scaled}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure the gradient at optimizer.step (optimizer.register_step_pre_hook) against the one backward gave, "
        "divided by scaler.get_scale(): its norm, its direction, and which parameters changed",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's case F2 (what value and norm clipping do to a gradient) and 'A clipping bug that "
        "hides: clipping before `unscale_`', then measure your run the way they do",
    ),
)
