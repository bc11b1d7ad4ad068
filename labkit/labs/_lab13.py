"""Lab 13: a training loop whose memory misbehaves; three ways autograd keeps more than a step needs.

Taught in 13_memory (case K1 and "A leak that grows every step"). The model (a 32-256-256-1 SiLU
network) and its data appear nowhere in the notebook. Memory is what autograd keeps: every tensor it
saves for backward is counted through `torch.autograd.graph.saved_tensors_hooks` (by storage, so a
tensor saved by two operations counts once), as exercise 13.2 counts it, the parameters excluded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, relative_gap, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

FEATURES, WIDTH, BATCH, STEPS, LR = 32, 256, 256, 20, 0.1
MIB = 2**20
# A repaired run's peak memory may exceed the twin's by this fraction (none of its bytes may stay held
# after the last step beyond the twin's), and its final loss may differ by LOSS_TOLERANCE (relative).
MEMORY_TOLERANCE, LOSS_TOLERANCE = 0.05, 0.1

STAGES = {
    "forward": "forward(model, inputs) -> tensor: the model's output for inputs, computed with its own layers",
    "backward": "backward(loss) -> None: fills the parameters' .grad from loss; after it autograd needs nothing "
                "of this step's graph",
    "log_error": "log_error(history, model, inputs, targets) -> None: after the update, appends the batch's mean "
                 "absolute error to the list history, to plot later",
}


def forward(model, inputs):
    return model(inputs)


def backward(loss):
    loss.backward()


def log_error(history, model, inputs, targets):
    with torch.no_grad():
        history.append(F.l1_loss(model(inputs), targets).item())


def _forward_silu_by_hand(model, inputs):
    h = inputs
    for layer in model:
        h = h * torch.sigmoid(h) if isinstance(layer, nn.SiLU) else layer(h)
    return h


def _backward_retaining(loss):
    loss.backward(retain_graph=True)


def _log_error_tensor(history, model, inputs, targets):
    history.append(F.l1_loss(model(inputs), targets))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH), nn.SiLU(), nn.Linear(WIDTH, 1))


class SavedBytes:
    """Counts the bytes of the distinct tensors autograd keeps saved for backward, live, and their peak."""

    def __init__(self, excluded: list[torch.Tensor]) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in excluded}
        self.counts: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.excluded:
            return tensor
        if self.counts.get(key, 0) == 0:
            self.sizes[key] = tensor.untyped_storage().nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.counts[key] = self.counts.get(key, 0) + 1
        return _Saved(tensor, key, self)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int) -> None:
        self.counts[key] -= 1
        if self.counts[key] == 0:
            self.live -= self.sizes.pop(key)


class _Saved:
    """One saved tensor; when autograd drops it (the graph is freed), its bytes stop counting."""

    def __init__(self, tensor: torch.Tensor, key: int, owner: SavedBytes) -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


def train(stages, seed: int) -> Run:
    data = torch.Generator().manual_seed(seed)
    rule = torch.randn(FEATURES, 1, generator=data) / FEATURES**0.5
    losses = []
    model = seeded(_model, seed)
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    counter = SavedBytes(params)
    history: list = []
    held, logged_types = [], set()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        for _ in range(STEPS):
            x = torch.randn(BATCH, FEATURES, generator=data)
            y = x @ rule
            optimizer.zero_grad()
            loss = F.mse_loss(stages["forward"](model, x), y)
            stages["backward"](loss)
            losses.append(loss.item())
            optimizer.step()
            stages["log_error"](history, model, x, y)
            logged_types.add(type(history[-1]).__name__ if history else "nothing")
            held.append(counter.live)
    x = torch.randn(4 * BATCH, FEATURES, generator=data)
    with torch.no_grad():
        final = F.mse_loss(model(x), x @ rule).item()
    errors = [float(value.detach()) if isinstance(value, torch.Tensor) else float(value) for value in history]
    trace = {"held": held, "logged": sorted(logged_types), "saved_per_step": _saved_per_step(stages, seed)}
    return Run({"peak_mib": counter.peak / MIB, "held_mib": held[-1] / MIB, "final_loss": final}, trace,
               {"model": model, "optimizer": optimizer, "history": history, "losses": losses,
                "errors": errors}, audit.problems(STEPS))


def _saved_per_step(stages, seed: int) -> tuple[int, int]:
    """(tensors, bytes) saved for backward by one forward pass of the run's forward stage."""
    model = seeded(_model, seed)
    counter = SavedBytes(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = stages["forward"](model, torch.zeros(BATCH, FEATURES))
        tensors = sum(counter.counts.values())
        del out
    return tensors, counter.peak


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}): {curve_text(run.objects['losses'])}")
    print(f"mean absolute error logged after each step: {curve_text(run.objects['errors'], 4)}")
    print("MiB autograd holds after each step: " + curve_text([b / MIB for b in run.trace["held"]]))
    print(f"peak MiB autograd held during the run: {number(run.metrics['peak_mib'])}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics, twin.metrics
    said = (f"peak {number(mine['peak_mib'])} MiB and {number(mine['held_mib'])} MiB held after the last step, the "
            f"defect-free run's {number(theirs['peak_mib'])} and {number(theirs['held_mib'])}; final loss "
            f"{number(mine['final_loss'])}, the defect-free run's {number(theirs['final_loss'])}")
    recovered = (mine["peak_mib"] <= theirs["peak_mib"] * (1 + MEMORY_TOLERANCE)
                 and mine["held_mib"] <= theirs["held_mib"]
                 and relative_gap(mine["final_loss"], theirs["final_loss"]) <= LOSS_TOLERANCE)
    return recovered, said


CAUSES = (
    Cause("a tensor with its graph is kept across iterations",
          lambda d, t: f"the history holds {', '.join(d.trace['logged'])} values, and the MiB held after each step "
                       f"do not grow: {curve_text([b / MIB for b in d.trace['held']], 4)}"),
    Cause("an activation is saved twice for backward",
          lambda d, t: f"one forward pass of your run saves {d.trace['saved_per_step'][0]} tensors, "
                       f"{number(d.trace['saved_per_step'][1] / MIB)} MiB, for backward (saved_tensors_hooks), "
                       f"as many as the model's own layers save"),
    Cause("the graph is retained after backward",
          lambda d, t: f"after the last step autograd holds {number(d.metrics['held_mib'])} MiB: backward freed "
                       "what it saved"),
    Cause("the batch is too large for the memory",
          lambda d, t: f"one forward pass of this batch saves {number(d.trace['saved_per_step'][1] / MIB)} MiB, "
                       f"while the run's peak is {number(d.metrics['peak_mib'])} MiB: the batch is not what grows"),
    Cause("the optimizer's state grows every step",
          lambda d, t: "plain SGD keeps no state: optimizer.state holds "
                       f"{sum(len(s) for s in d.objects['optimizer'].state.values())} tensors"),
)

LAB = Lab(
    id="13",
    notebook="13_memory",
    title="a training loop that holds more memory than it should",
    section="A leak that grows every step",
    stages=STAGES,
    correct={"forward": forward, "backward": backward, "log_error": log_error},
    causes=CAUSES,
    variants=(
        Variant("13.a", CAUSES[0].name, "memory grows every step", {"log_error": _log_error_tensor}),
        Variant("13.b", CAUSES[1].name, "peak memory above the model's need", {"forward": _forward_silu_by_hand}),
        Variant("13.c", CAUSES[2].name, "peak memory above the model's need", {"backward": _backward_retaining}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "count what autograd keeps: saved_tensors_hooks during one forward, the bytes held after a step, and "
        "what the history list holds",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages)",
        "reread the notebook's section 'A leak that grows every step' and exercise 13.2, then measure your run "
        "the same way",
    ),
)
