"""What the probes share: the devices they measure, the units they report in, and number checks."""

from __future__ import annotations

import math

import torch

from labkit.fingerprint import _NEEDS_CUDA

__all__ = ["MATMUL_PRECISIONS"]

MATMUL_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""The matmul precisions `matmul_throughput` measures; tf32 is fp32 storage on TF32 tensor cores."""

# The probes time with CUDA events or the wall clock and read CUDA counters: MPS has neither here.
# A CUDA device this machine lacks is still resolved, so a probe can answer "needs a CUDA device".
_MEASURED_KINDS = ("cpu", "cuda")


def _cuda_missing(dev: torch.device) -> str:
    """Why a CUDA device cannot be measured here, or "" when it can (or the device is the CPU)."""
    if dev.type != "cuda":
        return ""
    if not torch.cuda.is_available():
        return _NEEDS_CUDA
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"needs a CUDA device: {dev} does not exist, this machine has {torch.cuda.device_count()}"
    return ""


def _rate_unit(kind: str, dev: torch.device) -> str:
    if kind == "copy":
        return "TB/s" if dev.type == "cuda" else "GB/s"
    return "TFLOP/s" if dev.type == "cuda" else "GFLOP/s"


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A real, finite number (not a bool, not a string, not nan or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
