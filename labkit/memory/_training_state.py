"""The training state: weights, gradients, master weights and optimizer state, from parameter counts."""

from __future__ import annotations

from torch import nn

from labkit.memory._common import _check_model, _check_optimizer_name, _check_precision
from labkit.memory.report import MemoryReport
from labkit.readings import Reading

__all__ = ["training_state"]

# bytes per parameter for (weights, gradients, master copy, each optimizer slot)
_STATE_BYTES = {
    "fp32": (4, 4, 0, 4), "amp_bf16": (4, 4, 0, 4), "amp_fp16": (4, 4, 0, 4),
    "bf16": (2, 2, 0, 2), "fp16": (2, 2, 0, 2), "mixed_bf16": (2, 2, 4, 4), "mixed_fp16": (2, 2, 4, 4),
}
_OPTIMIZER_SLOTS = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
_SLOT_NAMES = {0: "no state", 1: "momentum buffer", 2: "exp_avg + exp_avg_sq"}


def training_state(model: nn.Module, optimizer: str = "adamw", precision: str = "fp32") -> MemoryReport:
    """Bytes of weights, gradients, master weights and optimizer state, from parameter counts.

    ``precision``: ``fp32``; ``amp_bf16``/``amp_fp16`` (autocast: fp32 weights, 16-bit activations);
    ``bf16``/``fp16`` (everything 16-bit, no master copy); ``mixed_bf16``/``mixed_fp16`` (16-bit
    weights and gradients, fp32 master weights and optimizer state: 16 B per parameter with Adam).
    Frozen parameters cost their weights only. Used in ``13_memory`` and ``02_gradients_accumulate``.
    """
    _check_model(model)
    _check_precision(precision)
    _check_optimizer_name(optimizer)
    weight_b, grad_b, master_b, slot_b = _STATE_BYTES[precision]
    slots = _OPTIMIZER_SLOTS[optimizer]
    every = sum(p.numel() for p in model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trained)

    def row(label: str, count: int, each: int, what: str) -> tuple[str, Reading]:
        return label, Reading(count * each, "B", "estimated", source=f"{count:,} × {each} B {what}")

    rows = [row("parameters", every, weight_b, "weights"), row("gradients", n, grad_b, "gradients")]
    if master_b:
        rows.append(row("master weights", n, master_b, "fp32 master copy"))
    rows.append(row("optimizer state", n, slots * slot_b, _SLOT_NAMES[slots]))
    if optimizer in ("adam", "adamw"):
        rows.append(row("step counters", len(trained), 4, "(0-d fp32 per parameter tensor; on the CPU "
                                                            "unless capturable or fused)"))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    rows.append(("buffers", Reading(buffers, "B", "estimated", source="as stored")))
    return MemoryReport(f"Training state: {optimizer} at {precision}", tuple(rows))
