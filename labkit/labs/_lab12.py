"""Lab 12: a batch that grows mid-run onto simulated data-parallel devices; three defects of the global batch.

Taught in 12_batch_size (case J3: global batch = per-device batch x devices x accumulation steps).
The model (a 10-32-4 tanh classifier) and the data (four classes of a noisy rule over 10 features)
appear nowhere in the notebook. The run takes SMALL_STEPS steps on one device with batches of
MICRO rows, then its batch grows to DEVICES devices x ACCUMULATION micro-batches of MICRO rows.
Recovery is what case J3 measures: the gradient each step applies equals one batch's gradient over
the step's rows, and the run ends as well as the twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, one_step_effect, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

EXAMPLES, FEATURES, HIDDEN, CLASSES = 1024, 10, 32, 4
MICRO, DEVICES, ACCUMULATION, SMALL_STEPS, LARGE_STEPS, LR = 16, 2, 2, 20, 30, 2.0
STEPS = SMALL_STEPS + LARGE_STEPS
# At every step of a repaired run, the gradient optimizer.step uses may differ from one batch's gradient
# over the step's rows by this much (relative): rounding, as a repair written another way adds in another
# order; each defect differs by 0.3 or more once the batch grows. Its final loss may exceed the twin's by
# TOLERANCE (relative).
GRADIENT_GAP, TOLERANCE = 1e-3, 0.1

STAGES = {
    "shard": "shard(rows, devices, accumulation_steps) -> list (one per device) of lists of row-index tensors: "
             "splits the step's rows into each device's own micro-batches, every row to exactly one device",
    "micro_loss": "micro_loss(model, inputs, targets, accumulation_steps) -> scalar tensor: the loss whose "
                  "gradient is this micro-batch's share of its device's accumulated gradient",
    "all_reduce": "all_reduce(device_grads) -> list of tensors: combines the devices' gradients (one list of "
                  "tensors per device) into the one every device applies, as DistributedDataParallel does",
}


def shard(rows, devices, accumulation_steps):
    per_device = rows.chunk(devices)
    return [list(device_rows.chunk(accumulation_steps)) for device_rows in per_device]


def micro_loss(model, inputs, targets, accumulation_steps):
    return F.cross_entropy(model(inputs), targets) / accumulation_steps


def all_reduce(device_grads):
    return [torch.stack(grads).mean(0) for grads in zip(*device_grads)]


def _shard_same_rows(rows, devices, accumulation_steps):
    first = rows.chunk(devices)[0]
    return [list(first.chunk(accumulation_steps)) for _ in range(devices)]


def _micro_loss_undivided(model, inputs, targets, accumulation_steps):
    return F.cross_entropy(model(inputs), targets)


def _all_reduce_summed(device_grads):
    return [torch.stack(grads).sum(0) for grads in zip(*device_grads)]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(EXAMPLES, FEATURES, generator=data)
    logits = torch.tanh(x @ torch.randn(FEATURES, CLASSES, generator=data)) * 3
    y = (logits + 0.5 * torch.randn(EXAMPLES, CLASSES, generator=data)).argmax(1)
    return x, y


def train(stages, seed: int) -> Run:
    x, y = dataset(seed)
    model = seeded(_model, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    trace = {"loss_ratio": [], "rows": [], "grad_gap": [], "reduced": _probe(stages["all_reduce"]),
             "one_step": one_step_effect(seeded(_model, seed), lambda m: F.cross_entropy(m(x), y), LR), "noise": _noise(x, y, seed)}
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(STEPS):
        devices, accumulation = (1, 1) if step < SMALL_STEPS else (DEVICES, ACCUMULATION)
        rows = torch.randperm(EXAMPLES, generator=order)[:MICRO * devices * accumulation]
        wanted = torch.autograd.grad(F.cross_entropy(model(x[rows]), y[rows]), params)
        device_grads = []
        for device_rows in stages["shard"](rows, devices, accumulation):
            accumulated = [torch.zeros_like(p) for p in params]
            for micro in device_rows:
                loss = stages["micro_loss"](model, x[micro], y[micro], accumulation)
                if step >= SMALL_STEPS:
                    with torch.no_grad():
                        trace["loss_ratio"].append(loss.item() / F.cross_entropy(model(x[micro]), y[micro]).item())
                accumulated = [a + g for a, g in zip(accumulated, torch.autograd.grad(loss, params))]
            device_grads.append(accumulated)
        if step >= SMALL_STEPS:
            seen = torch.cat([micro for device_rows in stages["shard"](rows, devices, accumulation)
                              for micro in device_rows])
            trace["rows"].append(len(torch.unique(seen)))
        for p, g in zip(params, stages["all_reduce"](device_grads)):
            p.grad = g
        trace["grad_gap"].append(_gap(params, wanted))
        optimizer.step()
        with torch.no_grad():
            losses.append(F.cross_entropy(model(x[rows]), y[rows]).item())
    with torch.no_grad():
        final = F.cross_entropy(model(x), y).item()
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return Run({"final_loss": final, "accuracy": accuracy}, trace,
               {"model": model, "optimizer": optimizer, "x": x, "y": y, "losses": losses}, audit.problems(STEPS))


def _gap(params, wanted) -> float:
    applied = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    reference = torch.cat([g.flatten() for g in wanted])
    return ((applied - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def _probe(all_reduce_stage) -> list[float]:
    """What the run's all_reduce makes of two devices' gradients, one holding 1s and the other 3s."""
    return [g.mean().item() for g in all_reduce_stage([[torch.ones(3)], [torch.full((3,), 3.0)]])]


def _noise(x, y, seed: int, draws: int = 8) -> dict[int, float]:
    """The batch gradient's mean squared distance from the full-data gradient at the initial weights, by batch size."""
    probe = seeded(_model, seed)
    params = list(probe.parameters())
    full = torch.cat([g.flatten() for g in torch.autograd.grad(F.cross_entropy(probe(x), y), params)])
    generator = torch.Generator().manual_seed(seed + 3)
    noise = {}
    for size in (MICRO, MICRO * DEVICES * ACCUMULATION):
        spread = 0.0
        for _ in range(draws):
            rows = torch.randint(0, EXAMPLES, (size,), generator=generator)
            batch = torch.cat([g.flatten() for g in torch.autograd.grad(F.cross_entropy(probe(x[rows]), y[rows]), params)])
            spread += (batch - full).pow(2).sum().item() / draws
        noise[size] = spread
    return noise


def show(run: Run) -> None:
    large = MICRO * DEVICES * ACCUMULATION
    print(f"loss of each step's batch after its update ({SMALL_STEPS} SGD steps of {MICRO} rows on one device, "
          f"then {LARGE_STEPS} of {DEVICES} devices x {ACCUMULATION} micro-batches x {MICRO} rows = {large}; lr {LR}): "
          f"{curve_text(run.objects['losses'])}")
    print(f"mean batch loss over the last 5 steps at {MICRO} rows: "
          f"{number(sum(run.objects['losses'][SMALL_STEPS - 5:SMALL_STEPS]) / 5)}, at {large} rows: "
          f"{number(sum(run.objects['losses'][-5:]) / 5)}")
    print(f"final loss on all {EXAMPLES} examples {number(run.metrics['final_loss'])}, accuracy "
          f"{run.metrics['accuracy']:.1%}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    gaps = repaired.trace["grad_gap"]
    worst = max(range(len(gaps)), key=lambda step: gaps[step])
    mine, theirs = repaired.metrics["final_loss"], twin.metrics["final_loss"]
    said = (f"the gradient at optimizer.step differs from one batch's gradient over the step's rows by "
            f"{gaps[worst]:.1e} at most (step {worst + 1}); final loss {number(mine)}, the defect-free run's "
            f"{number(theirs)}")
    return gaps[worst] <= GRADIENT_GAP and mine <= theirs * (1 + TOLERANCE), said


def _rows_measure(defective: Run, twin: Run) -> str:
    large = MICRO * DEVICES * ACCUMULATION
    return (f"once the batch grows, the devices' micro-batches together hold {min(defective.trace['rows'])} to "
            f"{max(defective.trace['rows'])} distinct rows of the {large} each step draws")


CAUSES = (
    Cause("the micro-batch losses are not divided by the accumulation steps",
          lambda d, t: f"with {ACCUMULATION} accumulation steps micro_loss returns {number(min(d.trace['loss_ratio']))}"
                       f"-{number(max(d.trace['loss_ratio']))} times the micro-batch's mean cross-entropy"),
    Cause("the devices' gradients are summed instead of averaged",
          lambda d, t: "all_reduce of two devices' gradients, one all 1s and one all 3s, gives "
                       f"{number(d.trace['reduced'][0])}s"),
    Cause("every device reads the same rows", _rows_measure),
    Cause("the learning rate is too high for the small batch",
          lambda d, t: f"over the {SMALL_STEPS} steps of {MICRO} rows the batch loss goes from "
                       f"{number(d.objects['losses'][0])} to {number(d.objects['losses'][SMALL_STEPS - 1])}, and one "
                       f"full-data step at the lab's rate lowers the loss from {number(d.trace['one_step'][0])} to "
                       f"{number(d.trace['one_step'][1])}"),
    Cause("the larger batch's gradient is noisier",
          lambda d, t: "at the initial weights the batch gradient's squared distance from the full-data gradient is "
                       + " and ".join(f"{number(v)} at {k} rows" for k, v in d.trace["noise"].items())),
)

LAB = Lab(
    id="12",
    notebook="12_batch_size",
    title="a batch that grows onto simulated data-parallel devices",
    section="Case J3: global batch = per-device batch × devices × accumulation steps",
    stages=STAGES,
    correct={"shard": shard, "micro_loss": micro_loss, "all_reduce": all_reduce},
    causes=CAUSES,
    variants=(
        Variant("12.a", CAUSES[0].name, "loss rises when the batch grows", {"micro_loss": _micro_loss_undivided}),
        Variant("12.b", CAUSES[1].name, "loss rises when the batch grows", {"all_reduce": _all_reduce_summed}),
        Variant("12.c", CAUSES[2].name, "loss noisier after the batch grows", {"shard": _shard_same_rows}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure each stage's hand-over once the batch grows: the rows in each device's micro-batches, micro_loss "
        "against F.cross_entropy, and the gradient all_reduce returns against one batch's gradient over the step's rows",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and leaves the others as they are",
        "reread the notebook's case J3 (the global batch, averaging over devices, dividing by the accumulation "
        "steps), then measure your run the way it does",
    ),
)
