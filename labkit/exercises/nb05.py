"""Checks for the exercises of 05_batchnorm_finetuning.

05.1 asks for a training mode for a pretrained backbone under a new head, in which the backbone's
BatchNorm layers stay in eval mode with their affine parameters frozen while the head's new
BatchNorm trains (the planted bug calls `model.train()` alone, so the backbone's running statistics
follow the fine-tuning batches: claims D2 and D4; freezing every BatchNorm, as the notebook's remedy
does for a model that is all pretrained, leaves the head's never-estimated statistics at 0 and 1). 05.2 asks for a precise re-estimate of BatchNorm running
statistics on new data (the planted bug runs a few batches in train mode, so the exponential average
keeps most of the old statistics: claim D4); its model has a Dropout between its BatchNorm layers, so
`update_bn`, the notebook's tool, which puts the whole model in train mode, collects statistics of
dropped-out inputs. Fixtures are float64 on the CPU and their new data is
shifted far from the statistics the layers hold, because that is when the bugs bite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import Hint, NotYet, Recorder, exercise

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "05_batchnorm_finetuning"
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# The fixture's new data sits SHIFT standard deviations away from what the layers saw before.
SHIFT = 3.0
# 05.2: 96 rows in batches of 32, so an average over batches is the average over rows.
ROWS, BATCH = 96, 32
# A recalibrated mean within 0.1 std and a variance within 25 % of the data's own; the planted bug
# keeps 0.9 ** 3 = 73 % of the stale statistics and misses by about two standard deviations.
MEAN_TOLERANCE = 0.1
VARIANCE_RATIO = (0.75, 1.33)


def _batchnorm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, BATCHNORMS)]


PRETRAINED = "backbone"
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _mode_fixture() -> nn.Sequential:
    """A pretrained convolutional backbone with its BatchNorm2d, and a new head with its own BatchNorm1d."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module(PRETRAINED, nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                               nn.Flatten()))
    model.add_module("head", nn.Sequential(nn.Linear(4 * 4 * 4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5),
                                           nn.Linear(8, 3)))
    model.double()
    with torch.no_grad():  # the backbone's statistics, as pretraining left them
        model.get_submodule(f"{PRETRAINED}.1").running_mean.fill_(0.5)
    # As a script would leave it after evaluating: everything in eval mode.
    return model.eval()


@exercise(
    "05.1",
    notebook=NOTEBOOK,
    title="fine-tune a pretrained backbone under a new head, with the backbone's BatchNorm frozen",
    hint=(
        "after your function, look at each BatchNorm layer's .training and requires_grad: which of them were "
        "pretrained, and which are new?",
        "model.train() switches every submodule; only the BatchNorm layers inside the pretrained part have "
        "statistics worth keeping, so only they go back to eval mode and are frozen",
        (
            "call model.train(), then walk model.get_submodule(pretrained).modules() (or model.named_modules(), "
            "keeping the names that start with pretrained + '.'): each BatchNorm layer there goes back to .eval() "
            "and gets requires_grad_(False); the head's BatchNorm is left training"
        ),
    ),
    planted="is in training mode, so every forward pass moves its running statistics",
    answer_apart=True,
)
def check_set_finetune_mode(set_finetune_mode: Callable) -> str:
    """The model trains, the backbone's BatchNorm keeps its statistics, the head's BatchNorm learns its own."""
    model = _mode_fixture()
    set_finetune_mode(model, PRETRAINED)
    _require_training_except_batchnorm(model)
    for name, layer in _batchnorm_layers(model):
        if name.startswith(PRETRAINED + "."):
            _require_frozen_batchnorm(name, layer)
        else:
            _require_training_batchnorm(name, layer)
    _require_statistics_after_a_training_step(model)
    return (
        "dropout and the head's new BatchNorm train, while the backbone's BatchNorm keeps its running statistics "
        "through a training step on shifted data with its weight and bias frozen"
    )


def _require_training_except_batchnorm(model: nn.Module) -> None:
    if not model.training:
        raise NotYet("the model is not in training mode, so its dropout layer is switched off")
    for name, module in model.named_modules():
        if not isinstance(module, BATCHNORMS) and not module.training:
            raise NotYet(f"module '{name or '(model)'}' ({type(module).__name__}) is in eval mode; only BatchNorm should be")
    for name, parameter in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        if not isinstance(owner, BATCHNORMS) and not parameter.requires_grad:
            raise NotYet(f"'{name}' was frozen too; only the backbone's BatchNorm weight and bias should be")


def _require_frozen_batchnorm(name: str, layer: nn.Module) -> None:
    if layer.training:
        raise NotYet(
            f"BatchNorm layer '{name}' is in training mode, so every forward pass moves its running "
            "statistics towards the fine-tuning batches"
        )
    if layer.weight.requires_grad or layer.bias.requires_grad:
        raise NotYet(f"BatchNorm layer '{name}' still trains its weight or bias")


def _require_training_batchnorm(name: str, layer: nn.Module) -> None:
    if not layer.training or not (layer.weight.requires_grad and layer.bias.requires_grad):
        raise NotYet(
            f"BatchNorm layer '{name}' belongs to the new head, not to '{PRETRAINED}', yet you froze it: its "
            "running statistics were never estimated (still 0 and 1), so they must learn from the fine-tuning data"
        )


def _require_statistics_after_a_training_step(model: nn.Module) -> None:
    layers = _batchnorm_layers(model)
    before = [(layer.running_mean.clone(), layer.running_var.clone()) for _, layer in layers]
    generator = torch.Generator().manual_seed(1)
    x = SHIFT + torch.randn(6, 1, 4, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=generator)
    F.cross_entropy(model(x), y).backward()
    for (name, layer), (mean, var) in zip(layers, before):
        unchanged = torch.equal(layer.running_mean, mean) and torch.equal(layer.running_var, var)
        if name.startswith(PRETRAINED + ".") and not unchanged:
            raise NotYet(f"a training step on shifted data changed the running statistics of '{name}'")
    if model.get_submodule(f"{PRETRAINED}.0").weight.grad is None:
        raise NotYet("after a training step the backbone's convolution got no gradient; it must still train")


def _recalibration_fixture() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 6), nn.BatchNorm1d(6),
    ).double()
    generator = torch.Generator().manual_seed(2)
    old_data = torch.randn(200, 5, generator=generator, dtype=torch.float64)
    _exact_statistics(model, old_data)
    for _, layer in _batchnorm_layers(model):
        layer.momentum = 0.1
    new_data = SHIFT + 1.5 * torch.randn(ROWS, 5, generator=generator, dtype=torch.float64)
    return model.eval(), new_data


def _exact_statistics(model: nn.Module, x: torch.Tensor) -> None:
    """The old statistics: a cumulative average over one batch of all of `x`."""
    for _, layer in _batchnorm_layers(model):
        layer.reset_running_stats()
        layer.momentum = None
    model.train()
    with torch.no_grad():
        model(x)


def _eval_inputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    captured = []
    handles = [layer.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
               for _, layer in _batchnorm_layers(model)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return captured


@exercise(
    "05.2",
    notebook=NOTEBOOK,
    title="re-estimate BatchNorm statistics on new data",
    hint=(
        "after your function, compare the running statistics with the plain mean and variance of the new data",
        "a momentum of 0.1 keeps part of the old statistics; momentum=None makes a plain average over the batches",
        (
            "for each BatchNorm layer: reset_running_stats() and momentum=None (a plain average over batches); "
            "run every batch under torch.no_grad() with only the BatchNorm layers in train mode; then restore "
            "each momentum and call model.eval()"
        ),
    ),
    planted="an exponential average over a few batches still remembers the old statistics",
    answer_apart=True,
)
def check_recalibrate_batchnorm(recalibrate_batchnorm: Callable) -> str:
    """Running statistics must match the new data's; parameters, gradients and momenta stay as they were."""
    model, new_data = _recalibration_fixture()
    parameters = [p.detach().clone() for p in model.parameters()]
    momenta = [layer.momentum for _, layer in _batchnorm_layers(model)]
    with _watching_training_forwards(model) as forwards:
        recalibrate_batchnorm(model, new_data, BATCH)
    if any(module.training for module in model.modules()):
        raise NotYet("the model is not back in eval mode afterwards", hint="finish with model.eval()")
    if not all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), parameters)):
        raise NotYet("a parameter changed; recalibration may only change the running statistics")
    if any(p.grad is not None for p in model.parameters()):
        raise NotYet("a parameter has a gradient now; statistics need forward passes only",
                     hint="run the batches under torch.no_grad()")
    after = [layer.momentum for _, layer in _batchnorm_layers(model)]
    if after != momenta:
        raise NotYet(f"the layers' momentum is {after} afterwards, but was {momenta}",
                     hint="remember each momentum before setting it to None, and put it back at the end")
    for (name, layer), inputs in zip(_batchnorm_layers(model), _eval_inputs(model, new_data)):
        _require_statistics_of(name, layer, inputs, forwards.get(name, []))
    return (
        f"both BatchNorm layers hold the statistics of the new data (within {MEAN_TOLERANCE:g} std), "
        "with parameters, gradients and momenta untouched and the model in eval mode"
    )


@contextmanager
def _watching_training_forwards(model: nn.Module) -> Iterator[dict[str, list[tuple[float | None, int]]]]:
    """Per BatchNorm layer, (momentum, num_batches_tracked, whether a Dropout before it was in train mode) at
    each forward pass it ran in training mode; filled in when the block ends."""
    forwards: dict[str, list[tuple[float | None, int, bool]]] = {}
    modules = list(model.modules())
    recorders = {}
    for name, layer in _batchnorm_layers(model):
        layer_at = modules.index(layer)
        dropouts = [module for module in modules[:layer_at] if isinstance(module, DROPOUTS)]
        recorders[name] = Recorder(_TrainingForward(dropouts))  # picklable: it fires in the answer's process too
    handles = [layer.register_forward_pre_hook(recorders[name]) for name, layer in _batchnorm_layers(model)]
    try:
        yield forwards
    finally:
        for handle in handles:
            handle.remove()
        for name, recorder in recorders.items():
            if any(note is not None for note in recorder.notes):
                forwards[name] = [note for note in recorder.notes if note is not None]


class _TrainingForward:
    """What a BatchNorm layer's forward in training mode looks like: its momentum, its batch count, and whether
    a Dropout before it drops; None for a forward in eval mode."""

    def __init__(self, dropouts: list[nn.Module]) -> None:
        self.dropouts = dropouts

    def __call__(self, layer: nn.Module, args: tuple) -> tuple[float | None, int, bool] | None:
        if not layer.training:
            return None
        return (layer.momentum, int(layer.num_batches_tracked), any(dropout.training for dropout in self.dropouts))


def _require_statistics_of(
    name: str, layer: nn.Module, inputs: torch.Tensor, forwards: list[tuple[float | None, int, bool]]
) -> None:
    true_mean, true_var = inputs.mean(0), inputs.var(0)
    mean_error = ((layer.running_mean - true_mean).abs() / true_var.sqrt()).max().item()
    if not mean_error <= MEAN_TOLERANCE:
        reason, hint = _why_statistics_are_stale(forwards)
        raise NotYet(f"the running mean of '{name}' is {mean_error:.2f} std away from the mean of the new data: {reason}",
                     hint=hint)
    ratio = layer.running_var / true_var
    low, high = ratio.min().item(), ratio.max().item()
    if not (VARIANCE_RATIO[0] <= low and high <= VARIANCE_RATIO[1]):
        reason, hint = _why_statistics_are_stale(forwards) if _dropout_was_on(forwards) else ("", None)
        raise NotYet(
            f"the running variance of '{name}' is {low:.2f}x to {high:.2f}x the variance of the new data"
            + (f": {reason}" if reason else ""), hint=hint)


def _dropout_was_on(forwards: list[tuple[float | None, int, bool]]) -> bool:
    return any(dropping for _, _, dropping in forwards)


def _why_statistics_are_stale(forwards: list[tuple[float | None, int, bool]]) -> tuple[str, Hint | None]:
    """Name the mistake, and its hint, from what the layer was set to during the learner's forward passes."""
    if not forwards:
        return "the layer never ran a forward pass in training mode, so its statistics were never updated", None
    if _dropout_was_on(forwards):
        return (
            "the model's Dropout was in train mode during your forward passes, so the layer averaged the statistics "
            "of dropped-out inputs, which it never sees in eval mode (model.train(), and update_bn, switch Dropout "
            "on too)",
            (
                "which other layers behave differently in train mode, and what did they do to this layer's input?",
                "put the model in eval mode and only the BatchNorm layers in train mode while you collect statistics",
            ),
        )
    momentum, counted, _ = forwards[0]
    if momentum is None and counted > 0:
        return (
            "the statistics it held before were never reset: with momentum=None BatchNorm averages over every "
            f"batch it has counted, and num_batches_tracked was already {counted} at your first batch, so the old "
            "statistics are averaged in with the new ones",
            (
                "what did the layer hold before your first batch, and does your average still count it?",
                "with momentum=None the average runs over num_batches_tracked batches; reset_running_stats() "
                "empties the statistics and that count",
            ),
        )
    return "an exponential average over a few batches still remembers the old statistics", None
