"""Lab 16: a checkpointed training loop with evaluation that keeps more memory than it should; three defects.

Taught in 16_speed_and_memory (case K4, activation checkpointing, and exercise 16.1). The model (a
stem, four checkpointed LayerNorm-GELU residual blocks 96 wide, a head) and its data (a random sine
rule over 24 features) appear nowhere in the notebook. Memory is what autograd keeps: every tensor
saved for backward is counted through `torch.autograd.graph.saved_tensors_hooks` (labkit.labs._lab13's
counter, parameters excluded); inside a non-reentrant checkpoint only what the checkpoint keeps counts,
as on a real device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.labs._common import audited_sgd, curve_text, number, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant
from labkit.labs._lab13 import SavedBytes

__all__: list[str] = []

FEATURES, WIDTH, BLOCKS, BATCH, STEPS, LR, EVAL_EVERY, EVAL_ROWS = 24, 96, 4, 128, 15, 0.05, 5, 512
MIB = 2**20
# A repaired run's peak memory may differ from the twin's by this fraction (a run that skips its blocks
# keeps less; none of its bytes may stay held after the last step beyond the twin's), and its final
# loss may differ by LOSS_TOLERANCE (relative: a repair trains the same numbers; a run whose gradients
# stop after its first step is 4% off).
MEMORY_TOLERANCE, LOSS_TOLERANCE = 0.05, 0.01

STAGES = {
    "block_forward": "block_forward(block, h) -> tensor: one residual block's output for h during training, "
                     "recomputed in backward instead of kept (torch.utils.checkpoint.checkpoint)",
    "evaluate": "evaluate(model, inputs, targets) -> float: the held-out mean squared error, every "
                f"{EVAL_EVERY} steps",
    "log_error": "log_error(history, model, inputs, targets) -> None: after the update, appends the batch's mean "
                 "absolute error to the list history, to plot later",
}


def block_forward(block, h):
    return checkpoint(block, h, use_reentrant=False)


def evaluate(model, inputs, targets):
    with torch.no_grad():
        return F.mse_loss(model(inputs), targets).item()


def log_error(history, model, inputs, targets):
    with torch.no_grad():
        history.append(F.l1_loss(model(inputs), targets).item())


def _block_forward_kept(block, h):
    return block(h)


def _evaluate_with_graph(model, inputs, targets):
    return F.mse_loss(model(inputs), targets).item()


def _log_error_tensor(history, model, inputs, targets):
    history.append(F.l1_loss(model(inputs), targets))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Network(nn.Module):
    """Stem, residual blocks, head; each block runs through the run's block_forward stage."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(FEATURES, WIDTH), nn.Linear(WIDTH, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.block_forward = _block_forward_kept

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = self.block_forward(block, h)
        return self.head(h)


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(seed)
    rule = torch.randn(FEATURES, 1, generator=data) / FEATURES**0.5
    x = torch.randn(STEPS * BATCH + EVAL_ROWS, FEATURES, generator=data)
    y = torch.sin(2 * x @ rule)
    return x[:STEPS * BATCH], y[:STEPS * BATCH], x[STEPS * BATCH:], y[STEPS * BATCH:]


def train(stages, seed: int) -> Run:
    x, y, x_eval, y_eval = dataset(seed)
    model = seeded(Network, seed)
    model.block_forward = stages["block_forward"]
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    counter = SavedBytes(params)
    history: list = []
    losses: list[float] = []
    held, evaluations, eval_saved, step_peaks, logged, peak = [], [], 0, [], set(), 0

    def phase_peak(phase, *args):
        """Runs ``phase(*args)``; returns its result and the most bytes it added to what autograd held before."""
        nonlocal peak
        before = counter.peak = counter.live
        result = phase(*args)
        peak = max(peak, counter.peak)
        return result, counter.peak - before

    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        for step, (inputs, targets) in enumerate(zip(x.split(BATCH), y.split(BATCH)), 1):
            loss, added = phase_peak(_training_step, model, optimizer, inputs, targets)
            step_peaks.append(added)
            losses.append(loss)
            phase_peak(stages["log_error"], history, model, inputs, targets)
            logged.add(type(history[-1]).__name__ if history else "nothing")
            if step % EVAL_EVERY == 0:
                error, added = phase_peak(stages["evaluate"], model, x_eval, y_eval)
                evaluations.append(error)
                eval_saved = max(eval_saved, added)
            held.append(counter.live)
    with torch.no_grad():
        final = F.mse_loss(model(x_eval), y_eval).item()
    errors = [float(value.detach()) if isinstance(value, torch.Tensor) else float(value) for value in history]
    trace = {"held": held, "logged": sorted(logged), "eval_saved": eval_saved, "step_saved": max(step_peaks),
             "forward_saved": _forward_saved(stages, seed), "batch_bytes": BATCH * WIDTH * 4}
    return Run({"peak_mib": peak / MIB, "held_mib": held[-1] / MIB, "final_loss": final}, trace,
               {"model": model, "optimizer": optimizer, "history": history, "losses": losses, "errors": errors,
                "evaluations": evaluations}, audit.problems(STEPS))


def _training_step(model, optimizer, inputs, targets) -> float:
    optimizer.zero_grad()
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def _forward_saved(stages, seed: int) -> int:
    """Bytes one training forward of the run's block_forward saves for backward (saved_tensors_hooks)."""
    model = seeded(Network, seed)
    model.block_forward = stages["block_forward"]
    counter = SavedBytes(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = model(torch.zeros(BATCH, FEATURES))
        saved = counter.peak
        del out
    return saved


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}): {curve_text(run.objects['losses'])}")
    print(f"mean absolute error logged after each step: {curve_text(run.objects['errors'], 4)}")
    print(f"held-out error every {EVAL_EVERY} steps: {curve_text(run.objects['evaluations'], 3)}")
    print("MiB autograd holds after each step: " + curve_text([b / MIB for b in run.trace["held"]]))
    print(f"peak MiB autograd held during the run: {number(run.metrics['peak_mib'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics, twin.metrics
    said = (f"peak {number(mine['peak_mib'])} MiB and {number(mine['held_mib'])} MiB held after the last step, the "
            f"defect-free run's {number(theirs['peak_mib'])} and {number(theirs['held_mib'])}; final held-out error "
            f"{number(mine['final_loss'])}, the defect-free run's {number(theirs['final_loss'])}")
    recovered = (relative_gap(mine["peak_mib"], theirs["peak_mib"]) <= MEMORY_TOLERANCE
                 and mine["held_mib"] <= theirs["held_mib"]
                 and relative_gap(mine["final_loss"], theirs["final_loss"]) <= LOSS_TOLERANCE)
    return recovered, said


CAUSES = (
    Cause("the blocks are not checkpointed",
          lambda d, t: f"one training forward of your run saves {number(d.trace['forward_saved'] / MIB)} MiB for "
                       f"backward (saved_tensors_hooks): {d.trace['forward_saved'] // d.trace['batch_bytes']} "
                       "batch-by-width tensors, the blocks' inputs and what stem and head keep"),
    Cause("evaluation builds an autograd graph",
          lambda d, t: f"while evaluate runs autograd saves {number(d.trace['eval_saved'] / MIB)} MiB: evaluation "
                       "keeps nothing for backward"),
    Cause("a loss is kept with its graph across steps",
          lambda d, t: f"the history holds {', '.join(d.trace['logged'])} values, and the MiB held after each step "
                       f"do not grow: {curve_text([b / MIB for b in d.trace['held']], 4)}"),
    Cause("the batch is too large for the memory",
          lambda d, t: f"one training step's own peak is {number(d.trace['step_saved'] / MIB)} MiB, while the run's "
                       f"peak is {number(d.metrics['peak_mib'])} MiB: the batch is not what grows"
                       if d.trace["step_saved"] < 0.9 * d.metrics["peak_mib"] * MIB else
                       f"the defect-free run trains the same batch with a peak of {number(t.metrics['peak_mib'])} MiB, "
                       f"yours peaks at {number(d.metrics['peak_mib'])} MiB"),
    Cause("the optimizer's state grows every step",
          lambda d, t: "plain SGD keeps no state: optimizer.state holds "
                       f"{sum(len(s) for s in d.objects['optimizer'].state.values())} tensors"),
)

LAB = Lab(
    id="16",
    notebook="16_speed_and_memory",
    title="a checkpointed training loop that keeps more memory than it should",
    section="Case K4: activation checkpointing inserted with torch.fx",
    stages=STAGES,
    correct={"block_forward": block_forward, "evaluate": evaluate, "log_error": log_error},
    causes=CAUSES,
    variants=(
        Variant("16.a", CAUSES[0].name, "peak memory above the model's need", {"block_forward": _block_forward_kept}),
        Variant("16.b", CAUSES[1].name, "peak memory above the model's need", {"evaluate": _evaluate_with_graph}),
        Variant("16.c", CAUSES[2].name, "memory grows every step", {"log_error": _log_error_tensor}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "count what autograd keeps, and when: saved_tensors_hooks during one training forward, during an "
        "evaluation, and the bytes held after each step; and what the history list holds",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages)",
        "reread the notebook's case K4 (what checkpoint(block, x, use_reentrant=False) keeps) and exercise 16.1, "
        "then measure your run the same way",
    ),
)
