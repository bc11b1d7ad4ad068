"""Lab 15: a BatchNorm classifier trained with DistributedDataParallel on two gloo ranks; three DDP defects.

Taught in 15_distributed (case O3, case O1 and exercise 15.2). The model (a 10-24-3 network with a
BatchNorm1d) and its data (three classes of a random quadratic rule over 10 features) appear nowhere
in the notebook. The ranks are real processes joined by `labkit.distributed.run_ranks`, as in the
notebook: every wait is bounded, and a rank that raises, dies or hangs stops every rank.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit._torch_compat import import_dynamo_before_forking
from labkit.distributed import run_ranks
from labkit.labs._audit import StepAudit
from labkit.labs._common import curve_text, number, one_step_effect, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

# What the isolated grader (labkit.labs._isolated) lets this lab do: fork its gloo ranks and stop them.
PROCESS_EVENTS = ("os.fork", "os.kill")

FEATURES, HIDDEN, CLASSES, ROWS, HELD_OUT = 10, 24, 3, 384, 1024
WORLD_SIZE, PER_RANK_BATCH, EPOCHS, LR = 2, 16, 2, 0.2
STEPS = EPOCHS * ROWS // (WORLD_SIZE * PER_RANK_BATCH)
TIMEOUT_S = 20.0  # every wait on the ranks, the collectives included: a run that hangs fails after this long
# A repaired run's held-out loss may differ from the twin's by LOSS_TOLERANCE (relative): a repair that shuffles
# the rows another way trains on other batches. The ranks must agree as the twin's do: the same weights and
# running statistics, to AGREEMENT (float32 rounding; the defects differ by 1e-3 or more).
LOSS_TOLERANCE, AGREEMENT = 0.35, 1e-6
# The installed torch names DDP's buffer broadcast forward_sync_buffers; older releases know only broadcast_buffers.
BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
               else "broadcast_buffers")

STAGES = {
    "rank_rows": "rank_rows(rows, rank, world_size, epoch, seed) -> tensor of row indices: the rows this rank "
                 "trains on in epoch, in order: the ranks together take each of range(rows) once per epoch, as many "
                 "each, shuffled anew every epoch, reproducible from seed (what DistributedSampler with set_epoch "
                 "hands out)",
    "wrap": "wrap(model) -> module: model wrapped for data-parallel training (DistributedDataParallel); the loop "
            "calls its forward, the optimizer already holds model's parameters",
    "forward_backward": "forward_backward(ddp, inputs, targets) -> loss: the cross-entropy of ddp on this rank's "
                        "batch, after filling every parameter's .grad with the loss's gradient averaged over the ranks",
}


def rank_rows(rows, rank, world_size, epoch, seed):
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch))
    return order[rank::world_size]


def wrap(model):
    return DDP(model)


def forward_backward(ddp, inputs, targets):
    loss = F.cross_entropy(ddp(inputs), targets)
    loss.backward()
    return loss


def _rank_rows_same(rows, rank, world_size, epoch, seed):
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch))
    return order[:rows // world_size]


def _wrap_local_buffers(model):
    return DDP(model, **{BUFFER_SYNC: False})


def _forward_backward_no_sync(ddp, inputs, targets):
    with ddp.no_sync():  # left from gradient accumulation, where every micro-batch but the last skips the all-reduce
        loss = F.cross_entropy(ddp(inputs), targets)
        loss.backward()
    return loss


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def dataset(seed: int) -> tuple[torch.Tensor, ...]:
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS + HELD_OUT, FEATURES, generator=data) * (0.5 + torch.rand(FEATURES, generator=data)) + 1.0
    centred = x - 1.0
    scores = centred @ torch.randn(FEATURES, CLASSES, generator=data) + 0.3 * centred.pow(2) @ torch.randn(
        FEATURES, CLASSES, generator=data)
    y = scores.argmax(1)
    return x[:ROWS], y[:ROWS], x[ROWS:], y[ROWS:]


def _train_rank(rank: int, world_size: int, stages, seed: int) -> dict:
    """One rank's run: its rows, losses, gradients and, after training, its model and held-out numbers."""
    x, y, x_test, y_test = dataset(seed)
    model = seeded(_model, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    audit = StepAudit(optimizer, list(model.parameters()), LR)
    ddp = stages["wrap"](model)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    losses, grad_norms, rows_seen, unused = [], [], [], 0
    for epoch in range(EPOCHS):
        rows = torch.as_tensor(stages["rank_rows"](ROWS, rank, world_size, epoch, seed))
        rows_seen.append(rows.tolist())
        for batch in rows.split(PER_RANK_BATCH):
            optimizer.zero_grad()
            loss = stages["forward_backward"](ddp, x[batch], y[batch])
            unused += sum(p.grad is None for p in model.parameters())
            grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
            grad_norms.append(torch.cat(grads).norm().item() if grads else 0.0)
            optimizer.step()
            losses.append(loss.item())
    ddp.eval()
    with torch.no_grad():
        logits = ddp(x_test)  # through DDP, as a script evaluates: its forward syncs the buffers it syncs
    return {"losses": losses, "grad_norms": grad_norms, "rows": rows_seen, "unused": unused, "start": start,
            "state": {name: value.clone() for name, value in model.state_dict().items()},
            "held_out_loss": F.cross_entropy(logits, y_test).item(),
            "accuracy": (logits.argmax(1) == y_test).float().mean().item(),
            "integrity": audit.problems(STEPS), "world": dist.get_world_size()}


def train(stages, seed: int) -> Run:
    import_dynamo_before_forking()  # DDP's constructor imports it: once here, not once per rank (seconds each)
    ranks = run_ranks(_train_rank, WORLD_SIZE, args=(stages, seed), timeout=TIMEOUT_S)
    x, y, x_test, y_test = dataset(seed)
    model = seeded(_model, seed)
    model.load_state_dict(ranks[0]["state"])
    model.eval()
    trace = {"overlap": _overlap(ranks), "distinct": [len(set(sum((r["rows"][e] for r in ranks), [])))
                                                      for e in range(EPOCHS)],
             "counts": [[len(r["rows"][e]) for r in ranks] for e in range(EPOCHS)],
             "grad_gap": max(abs(a - b) for a, b in zip(ranks[0]["grad_norms"], ranks[1]["grad_norms"])),
             "weight_gap": _state_gap(ranks, buffers=False), "buffer_gap": _state_gap(ranks, buffers=True),
             "start_gap": (ranks[0]["start"] - ranks[1]["start"]).abs().max().item(),
             "unused": sum(r["unused"] for r in ranks), "one_step": one_step_effect(seeded(_model, seed), lambda m: F.cross_entropy(m(x), y), LR)}
    metrics = {"held_out_loss": ranks[0]["held_out_loss"], "accuracy": ranks[0]["accuracy"],
               "rank_loss_gap": abs(ranks[0]["held_out_loss"] - ranks[1]["held_out_loss"])}
    integrity = sorted({problem for r in ranks for problem in r["integrity"]})
    return Run(metrics, trace, {"model": model, "ranks": ranks, "losses": [r["losses"] for r in ranks],
                                "rows": [r["rows"] for r in ranks], "x": x, "y": y, "x_test": x_test,
                                "y_test": y_test}, integrity)


def _overlap(ranks: list[dict]) -> int:
    """How many of rank 1's rows of the first epoch rank 0 trained on too."""
    return len(set(ranks[0]["rows"][0]) & set(ranks[1]["rows"][0])) if ranks[0]["rows"] else 0


def _state_gap(ranks: list[dict], buffers: bool) -> float:
    """The largest difference between the ranks' final parameters (or BatchNorm running statistics)."""
    parameter_names = {name for name, _ in _model().named_parameters()}
    gaps = [(ranks[0]["state"][name].float() - ranks[1]["state"][name].float()).abs().max().item()
            for name in ranks[0]["state"] if (name not in parameter_names) == buffers
            and not name.endswith("num_batches_tracked")]
    return max(gaps, default=0.0)


def show(run: Run) -> None:
    ranks = run.objects["ranks"]
    print(f"training loss by step on each rank ({WORLD_SIZE} gloo ranks, {EPOCHS} epochs, {PER_RANK_BATCH} rows per rank "
          f"per step, SGD lr {LR}):")
    for rank, result in enumerate(ranks):
        print(f"  rank {rank}: {curve_text(result['losses'])}")
    print("held-out loss of each rank's model, evaluated through DDP: "
          + ", ".join(f"rank {rank} {result['held_out_loss']:.5f}" for rank, result in enumerate(ranks))
          + f"; accuracy on rank 0: {run.metrics['accuracy']:.1%}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.trace, twin.trace
    said = (f"held-out loss {number(repaired.metrics['held_out_loss'])}, the defect-free run's "
            f"{number(twin.metrics['held_out_loss'])}; the ranks' weights differ by {number(mine['weight_gap'])} and "
            f"their running statistics by {number(mine['buffer_gap'])} (the defect-free run's: "
            f"{number(theirs['weight_gap'])} and {number(theirs['buffer_gap'])}); per epoch the ranks trained on "
            f"{mine['distinct']} distinct rows of {ROWS}, {mine['counts']} each")
    recovered = (mine["distinct"] == theirs["distinct"] and mine["counts"] == theirs["counts"]
                 and mine["weight_gap"] <= AGREEMENT and mine["buffer_gap"] <= AGREEMENT
                 and relative_gap(repaired.metrics["held_out_loss"], twin.metrics["held_out_loss"]) <= LOSS_TOLERANCE)
    return recovered, said


CAUSES = (
    Cause("every rank trains on the same rows",
          lambda d, t: f"in the first epoch {d.trace['overlap']} of rank 1's rows were rank 0's too, and the ranks "
                       f"together trained on {d.trace['distinct'][0]} distinct rows of {ROWS}"),
    Cause("the gradients are not averaged across ranks",
          lambda d, t: "after every backward the ranks held gradients of the same norm: the largest difference over "
                       f"the run is {number(d.trace['grad_gap'])}, and their final weights differ by "
                       f"{number(d.trace['weight_gap'])}"),
    Cause("each rank evaluates with its own BatchNorm running statistics",
          lambda d, t: f"the ranks' weights themselves differ by {number(d.trace['weight_gap'])} after training, which "
                       "running statistics cannot do" if d.trace["weight_gap"] > AGREEMENT else
                       "after the evaluation forward through DDP the ranks' running statistics differ by "
                       f"{number(d.trace['buffer_gap'])}"),
    Cause("the ranks start from different weights",
          lambda d, t: "once wrapped, before the first step, the ranks' weights differ by "
                       f"{number(d.trace['start_gap'])} (DDP starts them all from rank 0's)"),
    Cause("find_unused_parameters is missing",
          lambda d, t: f"every parameter got a gradient at every step on every rank ({d.trace['unused']} missing): "
                       "the model has no unused parameter for the flag to find"),
    Cause("the learning rate is too high for the global batch",
          lambda d, t: f"one SGD step at the run's rate on all {ROWS} training rows lowers their loss from "
                       f"{number(d.trace['one_step'][0])} to {number(d.trace['one_step'][1])}"),
)

LAB = Lab(
    id="15",
    notebook="15_distributed",
    title="a BatchNorm classifier trained with DDP on two gloo ranks",
    section="Case O3 (workbook): what DDP does to gradients, buffers and BatchNorm",
    stages=STAGES,
    correct={"rank_rows": rank_rows, "wrap": wrap, "forward_backward": forward_backward},
    causes=CAUSES,
    variants=(
        Variant("15.a", CAUSES[0].name, "every rank reports the same loss", {"rank_rows": _rank_rows_same}),
        Variant("15.b", CAUSES[1].name, "the ranks' held-out losses differ", {"forward_backward": _forward_backward_no_sync}),
        Variant("15.c", CAUSES[2].name, "the ranks' held-out losses differ", {"wrap": _wrap_local_buffers}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "compare the ranks with each other: lab.rows (the rows each rank trained on, per epoch), lab.losses, and "
        "lab.ranks (each rank's gradient norms per step, final weights and BatchNorm buffers in 'state')",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages) and runs in every rank",
        "reread the notebook's case O3 (what DDP averages, and what it does with buffers) and exercise 15.2, then "
        "measure your run the same way",
    ),
)
