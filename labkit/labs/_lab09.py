"""Lab 09: a deep pre-activation residual network whose blocks are not what they should be; three defects.

Taught in 09_residual_design (case M1 and "A pre-activation block that is not one"). The model (a
12-block pre-activation residual MLP with LayerNorm, 24 wide) and the data (four classes of a random
teacher network over 16 features) appear nowhere in the notebook. Recovery is what the notebook's
"identity path, isolated" measures: at initialisation, with every branch started at zero, the block
stack must return its input exactly; and the trained network's loss must match the twin's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from labkit.labs._common import audited_sgd, curve_text, number, seeded
from labkit.labs._lab import Cause, Lab, Run, Variant

__all__: list[str] = []

EXAMPLES, FEATURES, WIDTH, CLASSES, DEPTH = 512, 16, 24, 4, 12
STEPS, BATCH, LR = 40, 64, 0.1
# At initialisation a repaired run's block stack may change its input by IDENTITY_GAP (relative L2; the
# twin's changes it by exactly 0, a branch started at a small instead of zero scale by well under 1%,
# every defect by 30% or more). Its final loss may exceed the twin's by TOLERANCE (relative) + SLACK, and
# after training its branches must change the stack's input at least BRANCH_SHARE as much as the twin's
# (a run whose branches never learn, or whose output drops them, has a stack that stays the identity).
IDENTITY_GAP, TOLERANCE, SLACK, BRANCH_SHARE = 0.05, 0.25, 0.02, 0.5

STAGES = {
    "init_branches": "init_branches(model) -> None: once, before training: sets the initial weight and bias of "
                     "every block's last branch layer (block.lin2 for block in model.blocks), nothing else",
    "skip": "skip(block, x) -> tensor: what of the block's input x its skip path carries to the addition",
    "merge": "merge(skipped, branched) -> tensor: the block's output from its skip path's and its branch's "
             "outputs (pre-activation: nothing after the addition)",
}


def init_branches(model):
    with torch.no_grad():
        for block in model.blocks:
            block.lin2.weight.zero_()
            block.lin2.bias.zero_()


def skip(block, x):
    return x


def merge(skipped, branched):
    return skipped + branched


def _init_branches_default(model):
    pass


def _skip_normalised(block, x):
    return block.norm(x)


def _merge_relu_after_add(skipped, branched):
    return F.relu(skipped + branched)


class Block(nn.Module):
    """A pre-activation block's layers; the network's forward combines them through the run's stages."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin1, self.lin2 = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def branch(self, x):
        return self.lin2(F.relu(self.lin1(F.relu(self.norm(x)))))


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.final = nn.Sequential(nn.LayerNorm(WIDTH), nn.ReLU())
        self.head = nn.Linear(WIDTH, CLASSES)
        self.stages: dict = {}

    def forward(self, x, keep=None):
        """``keep``, a list, collects the stem's output and every block's output (the block inputs)."""
        h = self.stem(x)
        for block in self.blocks:
            if keep is not None:
                keep.append(h)
            h = self.stages["merge"](self.stages["skip"](block, h), block.branch(h))
        if keep is not None:
            keep.append(h)
        return self.head(self.final(h))


def dataset(seed: int) -> tuple[torch.Tensor, ...]:
    """Standard normal inputs labelled by a random 16-32-4 tanh teacher; training and test halves."""
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * EXAMPLES, FEATURES, generator=data)
    hidden = torch.tanh(x @ torch.randn(FEATURES, 32, generator=data) / FEATURES**0.5)
    y = (hidden @ torch.randn(32, CLASSES, generator=data)).argmax(1)
    return x[:EXAMPLES], y[:EXAMPLES], x[EXAMPLES:], y[EXAMPLES:]


def _gradient_ratio(model, x, y) -> float:
    """||dL/dx|| at the first block's input over ||dL/dx|| at the last block's output (notebook 09's norm ratio)."""
    kept: list[torch.Tensor] = []
    grads = torch.autograd.grad(F.cross_entropy(model(x, keep=kept), y), kept)
    return (grads[0].norm() / grads[-1].norm().clamp_min(1e-30)).item()


def _identity_probe(model, x) -> float:
    """With the first block's branch output zeroed, the share of its input's positive entries it returns unchanged."""
    probe = copy.deepcopy(model.blocks[0])
    with torch.no_grad():
        probe.lin2.weight.zero_()
        probe.lin2.bias.zero_()
        h = model.stem(x)
        out = model.stages["merge"](model.stages["skip"](probe, h), probe.branch(h))
        positive = h > 0
        return (out[positive] == h[positive]).float().mean().item()


def _identity_gap(model, x) -> float:
    """How much the block stack changes its input, relative (L2): 0 when every block is its skip alone."""
    kept: list[torch.Tensor] = []
    with torch.no_grad():
        model(x, keep=kept)
        return ((kept[-1] - kept[0]).norm() / kept[0].norm()).item()


def _written_outside_branches(model, fresh) -> list[str]:
    """What init_branches changed besides the blocks' last branch layers (a lab may not start from other weights)."""
    written = [name for name, value in model.state_dict().items()
               if ".lin2." not in name and not torch.equal(value, fresh[name])]
    return [f"init_branches changed {', '.join(written[:3])}{' ...' if len(written) > 3 else ''}, not only the "
            "blocks' last branch layers (block.lin2)"] if written else []


def _negative_share(model, x) -> float:
    """The share of negative entries in the blocks' outputs on ``x``."""
    kept: list[torch.Tensor] = []
    with torch.no_grad():
        model(x, keep=kept)
    return torch.stack([(h < 0).float().mean() for h in kept[1:]]).mean().item()


def train(stages, seed: int) -> Run:
    x, y, x_test, y_test = dataset(seed)
    model = seeded(ResidualNet, seed)
    model.stages = dict(stages)
    fresh = {name: value.clone() for name, value in model.state_dict().items()}
    stages["init_branches"](model)
    written = _written_outside_branches(model, fresh)
    trace = {"init_ratio": _gradient_ratio(model, x, y), "init_gap": _identity_gap(model, x),
             "branch_norm": max(block.lin2.weight.norm().item() for block in model.blocks),
             "identity": _identity_probe(model, x), "head_start": model.head.weight.detach().clone()}
    params = list(model.parameters())
    optimizer, audit = audited_sgd(params, LR)
    order = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(STEPS):
        rows = torch.randperm(EXAMPLES, generator=order)[:BATCH]
        loss = F.cross_entropy(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = F.cross_entropy(model(x), y).item()
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    trace |= {"negative": _negative_share(model, x), "trained_gap": _identity_gap(model, x), "final_ratio": _gradient_ratio(model, x, y),
              "input_mean": x.mean(0).abs().max().item(), "input_std": (x.std(0) - 1).abs().max().item(),
              "head_moved": (model.head.weight.detach() - trace.pop("head_start")).norm().item()}
    return Run({"final_loss": final, "accuracy": accuracy, "init_gap": trace["init_gap"],
                "trained_gap": trace["trained_gap"]}, trace,
               {"model": model, "optimizer": optimizer, "x": x, "y": y, "x_test": x_test, "y_test": y_test,
                "losses": losses}, written + audit.problems(STEPS))


def show(run: Run) -> None:
    print(f"training loss by step ({STEPS} SGD steps of {BATCH}, lr {LR}, {DEPTH} blocks): "
          f"{curve_text(run.objects['losses'])}")
    print(f"gradient norm at the first block's input / at the top: {number(run.trace['init_ratio'])} at "
          f"initialisation, {number(run.trace['final_ratio'])} after training")
    print(f"at initialisation the block stack changes its input by {number(run.trace['init_gap'])} "
          "(||output - input|| / ||input|| on the training inputs)")
    print(f"final training loss {number(run.metrics['final_loss'])}; test accuracy {run.metrics['accuracy']:.1%}")


def recovery(repaired: Run, twin: Run) -> tuple[bool, str]:
    mine, theirs = repaired.metrics, twin.metrics
    said = (f"at initialisation the block stack changes its input by {number(mine['init_gap'])} (relative), the "
            f"defect-free run's by {number(theirs['init_gap'])}; final loss {number(mine['final_loss'])}, the "
            f"defect-free run's {number(theirs['final_loss'])}; after training the stack changes its input by "
            f"{number(mine['trained_gap'])}, the defect-free run's by {number(theirs['trained_gap'])}")
    recovered = (mine["init_gap"] <= theirs["init_gap"] + IDENTITY_GAP
                 and mine["trained_gap"] >= BRANCH_SHARE * theirs["trained_gap"]
                 and mine["final_loss"] <= theirs["final_loss"] * (1 + TOLERANCE) + SLACK)
    return recovered, said


CAUSES = (
    Cause("the skip path carries the normalised input, not the input",
          lambda d, t: "with its branch's last layer zeroed, the first block returns its input unchanged on "
                       f"{d.trace['identity']:.0%} of the input's positive entries: the skip carries the input"),
    Cause("a ReLU is applied after the addition",
          lambda d, t: f"{d.trace['negative']:.0%} of the entries of the blocks' outputs are negative: nothing "
                       "clips them at zero after the addition"),
    Cause("the residual branches are not initialised small",
          lambda d, t: "after init_branches every branch's last layer has weight norm "
                       f"{number(d.trace['branch_norm'])} at most: each block starts as its skip path"),
    Cause("the inputs are not normalised",
          lambda d, t: f"every input feature has |mean| ≤ {number(d.trace['input_mean'])} and a standard deviation "
                       f"within {number(d.trace['input_std'])} of 1"),
    Cause("the head does not train",
          lambda d, t: f"the head's weight moved {number(d.trace['head_moved'])} (norm) from its initial value "
                       "during training"),
)

LAB = Lab(
    id="09",
    notebook="09_residual_design",
    title="a deep pre-activation residual network",
    section="A pre-activation block that is not one",
    stages=STAGES,
    correct={"init_branches": init_branches, "skip": skip, "merge": merge},
    causes=CAUSES,
    variants=(
        Variant("09.a", CAUSES[0].name, "first block's gradient above the top's", {"skip": _skip_normalised}),
        Variant("09.b", CAUSES[1].name, "block stack not the identity at initialisation",
                {"merge": _merge_relu_after_add}),
        Variant("09.c", CAUSES[2].name, "first block's gradient above the top's",
                {"init_branches": _init_branches_default}),
    ),
    train=train,
    recovery=recovery,
    show=show,
    hints=(
        "measure the blocks as the notebook does: the gradient at the first block's input against the top's "
        "(model(x, keep=kept)), a block with its branch's last layer zeroed, the branches' initial weights",
        "the cause whose measurement is off names the stage to repair; a repaired stage keeps its contract "
        "(lab.stages)",
        "reread the notebook's case M1 ('The identity path, isolated') and the section 'A pre-activation block "
        "that is not one', then measure your run the same way",
    ),
)
