"""Lab 10: a float16 autocast training step with a loss scaler and clipping; three defects of the scaled step.

Taught in 10_mixed_precision (cases G2, G4 and G6, exercise 10.1). The model (a 16-64-64-32 tanh
regression network) and the data (a tanh teacher over 16 features, two rows of a faulty sensor reading
1e5, beyond float16's range) appear nowhere in the notebook. The forward runs under CPU float16
autocast (`torch.autocast("cpu", dtype=torch.float16)`), the loss is scaled by
`torch.amp.GradScaler("cpu")`, the gradient is clipped and the scaler steps. A batch holding a faulty row
overflows float16: the scaler must skip that step and halve its scale. Recovery: the final error on
the clean rows, against the twin's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, grad_norm, number, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

EXAMPLES, FEATURES, HIDDEN, OUTPUTS = 1024, 16, 64, 32
STEPS, BATCH, LR, MAX_NORM = 40, 64, 0.5, 1.0
FAULTY_ROWS, FAULTY_READING = 2, 1e5
# A repaired run's final error on the clean rows may differ from the twin's by TOLERANCE (relative): a
# repair written another way rounds the same; every defect leaves it 50% above the twin's or not finite.
TOLERANCE = 0.1

STAGES = {
    "backward": "backward(loss, scaled_loss) -> None: fills the parameters' .grad for the scaler to unscale; "
                "scaled_loss is scaler.scale(loss), loss the batch's float32 loss",
    "clip": "clip(scaler, optimizer, params, max_norm) -> None: clips the step's true gradient norm to max_norm "
            "(torch.nn.utils.clip_grad_norm_)",
    "step": "step(scaler, optimizer) -> None: the parameter update, skipped when the gradient holds inf or NaN, "
            "and the scaler's scale adjusted for the next step",
}


def backward(loss, scaled_loss):
    scaled_loss.backward()


def clip(scaler, optimizer, params, max_norm):
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(params, max_norm)


def step(scaler, optimizer):
    scaler.step(optimizer)
    scaler.update()


def _backward_unscaled(loss, scaled_loss):
    loss.backward()


def _clip_scaled(scaler, optimizer, params, max_norm):
    nn.utils.clip_grad_norm_(params, max_norm)


def _step_unguarded(scaler, optimizer):
    optimizer.step()
    scaler.update()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUTPUTS))


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets, and which rows are clean (the others read FAULTY_READING, as a broken sensor)."""
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES, FEATURES, generator=data)
    y = torch.tanh(x @ torch.randn(FEATURES, OUTPUTS, generator=data) / 4) * 0.1
    faulty = torch.randperm(EXAMPLES, generator=data)[:FAULTY_ROWS]
    x[faulty, 0] = FAULTY_READING
    clean = torch.ones(EXAMPLES, dtype=torch.bool)
    clean[faulty] = False
    return x, y, clean


def train(stages, seed: int) -> Run:
    x, y, clean = dataset(seed)
    model = seeded(_model, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    scaler = torch.amp.GradScaler("cpu")
    trace = {"backward_ratio": [], "norm_at_step": [], "autocast_in_backward": set(), "nonfinite_steps": 0,
             "scales": [scaler.get_scale()]}
    grad_at_step: list[float] = []

    def at_step(opt, args, kwargs) -> None:
        norm = grad_norm(params)
        grad_at_step.append(norm)
        trace["nonfinite_steps"] += not torch.isfinite(torch.tensor(norm))

    optimizer.register_step_pre_hook(at_step)
    order = torch.Generator().manual_seed(seed + 1)
    losses, skipped = [], 0  # steps the scaler skipped (its scale fell): the loop expects no update there
    for _ in range(STEPS):
        rows = torch.randperm(EXAMPLES, generator=order)[:BATCH]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = model(x[rows])
        output.register_hook(lambda grad: trace["autocast_in_backward"].add(torch.is_autocast_enabled("cpu")))
        loss = F.mse_loss(output.float(), y[rows])
        stages["backward"](loss, scaler.scale(loss))
        trace["backward_ratio"].append(grad_norm(params))
        stages["clip"](scaler, optimizer, params, MAX_NORM)
        before = scaler.get_scale()
        stages["step"](scaler, optimizer)
        skipped += scaler.get_scale() < before
        trace["scales"].append(scaler.get_scale())
        losses.append(loss.item())
    with torch.no_grad():
        final = F.mse_loss(model(x[clean]), y[clean]).item()
    trace |= {"norm_at_step": grad_at_step, "one_step": _one_step_effect(x[clean], y[clean], seed),
              "true_norm": _true_norm(x[clean], y[clean], seed)}
    trace["backward_ratio"] = [norm / max(trace["true_norm"], 1e-30) for norm in trace["backward_ratio"]]
    return Run({"final_loss": final}, trace,
               {"model": model, "optimizer": optimizer, "scaler": scaler, "x": x, "y": y, "losses": losses},
               audit.problems(STEPS - skipped + trace["nonfinite_steps"]))


def _true_norm(x, y, seed: int) -> float:
    """The float32 gradient norm of the initial model's loss on a clean batch: what an unscaled gradient measures."""
    probe = seeded(_model, seed)
    F.mse_loss(probe(x[:BATCH]), y[:BATCH]).backward()
    return grad_norm(list(probe.parameters()))


def _one_step_effect(x, y, seed: int) -> tuple[float, float]:
    """The clean rows' error of the initial model before and after one clipped float32 SGD step at the lab's rate."""
    probe = seeded(_model, seed)
    loss = F.mse_loss(probe(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(probe.parameters(), MAX_NORM)
    with torch.no_grad():
        for p in probe.parameters():
            p -= LR * p.grad
        return loss.item(), F.mse_loss(probe(x), y).item()


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}, float16 autocast, GradScaler, clipped "
          f"to norm {MAX_NORM}): {curve_text(run.objects['losses'])}")
    print(f"loss scale by step: {curve_text(run.trace['scales'], 4)}")
    print(f"final mean squared error on the clean rows: {number(run.metrics['final_loss'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics["final_loss"], twin.metrics["final_loss"]
    said = f"final error on the clean rows {number(mine)}, the defect-free run's {number(theirs)}"
    return relative_gap(mine, theirs) <= TOLERANCE, said


def _unscaled_measure(d: Run, t: Run) -> str:
    ratios = d.trace["backward_ratio"]
    return (f"right after backward the gradient norm is {number(min(ratios))}-{number(max(ratios))} times a float32 "
            "gradient's norm of the same loss: the loss reaching backward is scaled")


CAUSES = (
    Cause("gradients are clipped while still scaled",
          lambda d, t: "at optimizer.step the gradient norm reaches "
                       f"{number(max(n for n in d.trace['norm_at_step'] if n == n) if d.trace['norm_at_step'] else 0)}"
                       f" at most, the size max_norm {MAX_NORM} allows: the gradient is clipped after unscaling"),
    Cause("backward runs on the loss instead of the scaled loss", _unscaled_measure),
    Cause("the optimizer steps on gradients holding inf or NaN",
          lambda d, t: f"optimizer.step ran on {d.trace['nonfinite_steps']} gradients holding inf or NaN "
                       "(norm checked in a step pre-hook): every overflowing step was skipped"),
    Cause("backward runs inside autocast",
          lambda d, t: "autocast is enabled during backward: "
                       f"{sorted(d.trace['autocast_in_backward'])} (torch.is_autocast_enabled read in a gradient "
                       "hook); and case G3 showed backward's gradients do not depend on it"),
    Cause("the loss scale collapses to zero",
          lambda d, t: f"the scaler's scale stays at {number(min(d.trace['scales']))} or above "
                       "(scaler.get_scale() after each step)"),
    Cause("the learning rate is too high",
          lambda d, t: "one clipped float32 SGD step at the lab's learning rate lowers the clean rows' error from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
)

LAB = Lab(
    id="10",
    notebook="10_mixed_precision",
    title="a float16 training step with a loss scaler and clipping",
    section="Case G2: GradScaler's four settings",
    stages=STAGES,
    correct={"backward": backward, "clip": clip, "step": step},
    causes=CAUSES,
    variants=(
        Variant("10.a", CAUSES[0].name, "loss barely falls", {"clip": _clip_scaled}),
        Variant("10.b", CAUSES[1].name, "loss barely falls", {"backward": _backward_unscaled}),
        Variant("10.c", CAUSES[2].name, "loss turns NaN", {"step": _step_unguarded}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure each stage's hand-over: .grad right after backward against a float32 gradient of the same loss, "
        "the gradient norm at optimizer.step (optimizer.register_step_pre_hook) against max_norm, and whether it "
        "is finite",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages)",
        "reread the notebook's cases G2 and G4 and exercise 10.1 (what scale, unscale_, step and update do, and "
        "in which order), then measure your run the same way",
    ),
)
