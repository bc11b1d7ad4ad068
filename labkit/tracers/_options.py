"""What `GradTracer` accepts: its options, thresholds and optimizer, checked once at
construction so that a wrong setting is a clear error instead of a silent false alarm later."""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import nn

from labkit.errors import LabkitError

__all__: list[str] = []


def _check_tracer_options(
    model: object,
    optimizer: object,
    full_every: int,
    histogram_bins: int,
    update_ratio: bool,
    max_steps: int | None,
    baseline_steps: int,
) -> None:
    if not isinstance(model, nn.Module):
        raise LabkitError(f"GradTracer traces an nn.Module, got {type(model).__name__}: pass the model")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise LabkitError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if update_ratio and optimizer is None:
        raise LabkitError(
            "update_ratio needs the optimizer's step hooks: "
            "GradTracer(model, optimizer, update_ratio=True)"
        )
    for label, value, least in (
        ("full_every", full_every, 0),
        ("histogram_bins", histogram_bins, 1),
        ("baseline_steps", baseline_steps, 1),
        ("max_steps", 1 if max_steps is None else max_steps, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise LabkitError(f"{label} must be an integer >= {least}, got {value!r}")


def _check_thresholds(
    activations: object,
    update_ratio: object,
    vanish_ratio: object,
    explode_factor: object,
    dead_above: object,
    unit_dim: object,
) -> None:
    for label, flag in (("activations", activations), ("update_ratio", update_ratio)):
        if not isinstance(flag, bool):
            raise LabkitError(f"{label} must be True or False, got {flag!r}")
    for label, value, allowed, accepts in (
        ("explode_factor", explode_factor, "a number > 1 (a norm this many times its median alerts)",
         lambda v: v > 1),
        ("vanish_ratio", vanish_ratio, "a number in [0, 1) (a share of the step's largest rms)",
         lambda v: 0 <= v < 1),
        ("dead_above", dead_above, "a share in (0, 1] of a ReLU's units", lambda v: 0 < v <= 1),
    ):  # fmt: skip
        if not _is_number(value) or not math.isfinite(value) or not accepts(value):
            raise LabkitError(f"{label} must be {allowed}, got {value!r}")
    if not isinstance(unit_dim, int) or isinstance(unit_dim, bool):
        raise LabkitError(f"unit_dim must be an integer (a dimension of the outputs), got {unit_dim!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_optimizer_owns_some(
    optimizer: torch.optim.Optimizer, model: nn.Module, params: list, replaced: bool = False
) -> None:
    """The optimizer must update at least one of the traced parameters, or its steps say nothing
    about this model. Owning only some is accepted: optimizers built from the trainable parameters
    only, or one optimizer per parameter group (SparseAdam for embeddings, Adam for the rest), are
    common; the tracer closes a step whenever this optimizer steps."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if owned.isdisjoint(id(p) for p in params):
        if replaced:
            raise LabkitError(
                f"the parameters of {type(model).__name__} were replaced while the tracer was "
                "attached (load_state_dict(..., assign=True), .to(), or a conversion that swaps "
                f"tensors), and {type(optimizer).__name__} still updates the old ones: build the "
                "optimizer (and the tracer) again from model.parameters() after replacing them"
            )
        raise LabkitError(
            f"{type(optimizer).__name__} updates none of the parameters of {type(model).__name__}: "
            "pass the optimizer built from this model's parameters, "
            f"GradTracer(model, torch.optim.{type(optimizer).__name__}(model.parameters(), ...))"
        )


def _check_histogram_sample(sample: object, seed: object) -> None:
    if sample is not None and (not isinstance(sample, int) or isinstance(sample, bool) or sample < 1):
        raise LabkitError(
            f"histogram_sample must be an integer >= 1 (values a histogram samples) or None "
            f"(count every value), got {sample!r}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise LabkitError(f"histogram_seed must be an integer, got {seed!r}")
