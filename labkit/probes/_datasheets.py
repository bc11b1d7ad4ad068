"""Datasheet ceilings and device facts: what a device could do, from its datasheet or what it reports."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.probes._common import _MEASURED_KINDS, MATMUL_PRECISIONS, _cuda_missing, _rate_unit
from labkit.readings import Reading

__all__ = ["DATASHEETS", "GpuDatasheet", "ceiling", "datasheet_ceiling", "datasheet_for", "device_facts"]


@dataclass(frozen=True)
class GpuDatasheet:
    """Vendor ceilings for one GPU model: memory bandwidth (TB/s) and dense matmul rates (TFLOP/s).

    ``pattern`` is searched in `torch.cuda.get_device_name()`. A rate of None means the datasheet
    lists none (no TF32 or bf16 tensor cores before compute capability 8.0).
    """

    model: str
    pattern: str
    bandwidth_tb_s: float
    tflops: dict[str, float | None]
    source: str


def _rates(fp32, tf32, bf16, fp16) -> dict[str, float | None]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}


_DENSE = "tensor-core rates are the datasheet's with-sparsity figures halved (dense)"
# Ordered so that a specific name (H200 NVL, H100 PCIe) is tried before its family (H200, H100).
DATASHEETS: tuple[GpuDatasheet, ...] = (
    GpuDatasheet("NVIDIA H200 NVL", r"\bH200 NVL\b", 4.8, _rates(60.0, 417.5, 835.5, 835.5),
                 f"NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column; {_DENSE}"),
    GpuDatasheet("NVIDIA H200 SXM", r"\bH200\b", 4.8, _rates(67.0, 494.5, 989.5, 989.5),
                 f"NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column; {_DENSE}"),
    GpuDatasheet("NVIDIA H100 NVL", r"\bH100 NVL\b", 3.9, _rates(60.0, 417.5, 835.5, 835.5),
                 f"NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column; {_DENSE}"),
    GpuDatasheet("NVIDIA H100 PCIe", r"\bH100 PCIe\b", 2.0, _rates(51.0, 378.0, 756.5, 756.5),
                 f"NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column; {_DENSE}"),
    GpuDatasheet("NVIDIA H100 SXM", r"\bH100\b", 3.35, _rates(67.0, 494.5, 989.5, 989.5),
                 f"NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column; {_DENSE}"),
    GpuDatasheet("NVIDIA A100 SXM 80GB", r"\bA100-SXM\d?-80GB\b", 2.039, _rates(19.5, 156.0, 312.0, 312.0),
                 f"NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column; {_DENSE}"),
    GpuDatasheet("NVIDIA A100 PCIe 80GB", r"\bA100 80GB PCIe\b", 1.935, _rates(19.5, 156.0, 312.0, 312.0),
                 f"NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe column; {_DENSE}"),
    GpuDatasheet("NVIDIA A100 40GB", r"\bA100\b", 1.555, _rates(19.5, 156.0, 312.0, 312.0),
                 f"NVIDIA A100 Tensor Core GPU datasheet, A100 40GB columns; {_DENSE}"),
    GpuDatasheet("NVIDIA L40S", r"\bL40S\b", 0.864, _rates(91.6, 183.0, 362.05, 362.05),
                 f"NVIDIA L40S GPU datasheet; {_DENSE}"),
    GpuDatasheet("NVIDIA A10", r"\bA10\b", 0.6, _rates(31.2, 62.5, 125.0, 125.0),
                 f"NVIDIA A10 Tensor Core GPU datasheet; {_DENSE}"),
    GpuDatasheet("NVIDIA L4", r"\bL4\b", 0.3, _rates(30.3, 60.0, 121.0, 121.0),
                 f"NVIDIA L4 Tensor Core GPU datasheet; {_DENSE}"),
    GpuDatasheet("NVIDIA T4", r"\bT4\b", 0.32, _rates(8.1, None, None, 65.0),
                 "NVIDIA T4 Tensor Core GPU datasheet (FP16 is its mixed-precision FP16/FP32 rate)"),
    GpuDatasheet("NVIDIA V100 SXM2", r"\bV100-SXM2\b", 0.9, _rates(15.7, None, None, 125.0),
                 "NVIDIA Tesla V100 GPU datasheet, SXM2 column (FP16 is its Tensor Performance)"),
    GpuDatasheet("NVIDIA V100 PCIe", r"\bV100\b", 0.9, _rates(14.0, None, None, 112.0),
                 "NVIDIA Tesla V100 GPU datasheet, PCIe column (FP16 is its Tensor Performance)"),
)


def datasheet_for(device_name: str) -> GpuDatasheet | None:
    """The `DATASHEETS` entry whose pattern matches a CUDA device name, or None."""
    return next((sheet for sheet in DATASHEETS if re.search(sheet.pattern, device_name)), None)


def datasheet_ceiling(kind: str, device_name: str) -> Reading:
    """The datasheet ceiling of ``kind`` ("copy" or a precision in `MATMUL_PRECISIONS`) for a named GPU.

    Copy ceilings are in TB/s, matmul ceilings in dense TFLOP/s.
    """
    kind = _check_kind(kind)
    unit = "TB/s" if kind == "copy" else "TFLOP/s"
    sheet = datasheet_for(device_name)
    if sheet is None:
        return Reading.unavailable(
            unit, f"no datasheet entry for {device_name!r}: add it to labkit.probes.DATASHEETS with its source"
        )
    value = sheet.bandwidth_tb_s if kind == "copy" else sheet.tflops[kind]
    if value is None:
        return Reading.unavailable(unit, f"the {sheet.model} datasheet lists no dense {kind} matmul rate")
    return Reading(value, unit, "datasheet", source=sheet.source)


def ceiling(kind: str, device=None) -> Reading:
    """This device's ceiling for ``kind`` ("copy" or a precision): datasheet, else estimate, else why not.

    A GPU missing from `DATASHEETS` still gets a copy ceiling estimated from its memory clock and
    bus width. CPUs get none: the OS does not report the memory channels and vector units a CPU
    ceiling needs. Used in `16_speed_and_memory`.
    """
    kind = _check_kind(kind)
    dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
    unit = _rate_unit(kind, dev)
    if dev.type == "cpu":
        return Reading.unavailable(
            unit, "no ceiling for a CPU: the OS does not report its memory channels, clocks and vector units"
        )
    if reason := _cuda_missing(dev):
        return Reading.unavailable(unit, reason)
    from_sheet = datasheet_ceiling(kind, torch.cuda.get_device_name(dev))
    if from_sheet.available or kind != "copy":
        return from_sheet
    return _theoretical_bandwidth(torch.cuda.get_device_properties(dev))


def device_facts(device=None) -> dict[str, Reading]:
    """Memory, multiprocessors, last-level cache and memory-bandwidth ceilings of a device.

    Keys: memory (B), multiprocessors (SMs), last_level_cache (B: a GPU's L2, a CPU's
    highest cache level), bandwidth_theoretical, bandwidth_datasheet.
    """
    dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
    if dev.type == "cpu":
        return _cpu_facts()
    if reason := _cuda_missing(dev):
        units = {"memory": "B", "multiprocessors": "SMs", "last_level_cache": "B",
                 "bandwidth_theoretical": "TB/s", "bandwidth_datasheet": "TB/s"}
        return {key: Reading.unavailable(unit, reason) for key, unit in units.items()}
    return _cuda_facts(dev)


def _cuda_facts(dev: torch.device) -> dict[str, Reading]:
    props = torch.cuda.get_device_properties(dev)
    source = "torch.cuda.get_device_properties"
    return {
        "memory": _reported(props.total_memory, "B", f"{source}().total_memory"),
        "multiprocessors": _reported(props.multi_processor_count, "SMs", f"{source}().multi_processor_count"),
        "last_level_cache": _reported(props.L2_cache_size, "B", f"L2, {source}().L2_cache_size"),
        "bandwidth_theoretical": _theoretical_bandwidth(props),
        "bandwidth_datasheet": datasheet_ceiling("copy", props.name),
    }


def _cpu_facts() -> dict[str, Reading]:
    return {
        "memory": _reported(psutil.virtual_memory().total, "B", "psutil.virtual_memory().total"),
        "multiprocessors": Reading.unavailable("SMs", "needs a CUDA device: multiprocessors are a GPU's"),
        "last_level_cache": _cpu_last_level_cache(),
        "bandwidth_theoretical": Reading.unavailable(
            "GB/s", "the OS does not report the memory channels and transfer rate a CPU's ceiling needs"
        ),
        "bandwidth_datasheet": Reading.unavailable("GB/s", "labkit's datasheet table covers NVIDIA GPUs only"),
    }


def _reported(value: int, unit: str, source: str) -> Reading:
    # A zero from the driver or OS means "not reported", never a real size: say so instead of passing it on.
    if not value:
        return Reading.unavailable(unit, f"{source} reported 0 on this machine")
    return Reading(value, unit, "measured", source=source)


def _cpu_last_level_cache() -> Reading:
    caches = Path("/sys/devices/system/cpu/cpu0/cache")
    levels = []
    for index in sorted(caches.glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = _parse_cache_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue  # an unreadable cache entry: judge by the entries that can be read
        levels.append((level, size))
    if not levels:
        return Reading.unavailable("B", f"this OS exposes no readable cache sizes under {caches}")
    level, size = max(levels)
    return Reading(size, "B", "measured", source=f"L{level} per {caches}/index*/size")


def _parse_cache_size(text: str) -> int:
    multipliers = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * multipliers[text[-1]] if text[-1] in multipliers else int(text)


def _theoretical_bandwidth(props) -> Reading:
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return Reading.unavailable("TB/s", "the driver reports no memory clock or bus width for this device")
    # GDDR and HBM move data on both clock edges, hence the factor 2.
    value = clock_khz * 1e3 * 2 * bus_bits / 8 / 1e12
    return Reading(value, "TB/s", "estimated",
                   source=f"memory clock {clock_khz / 1e3:.0f} MHz × 2 (double data rate) × {bus_bits}-bit bus")


def _check_kind(kind: str) -> str:
    if kind != "copy" and kind not in MATMUL_PRECISIONS:
        raise LabkitError(f"unknown ceiling kind {kind!r}: use 'copy' or one of {', '.join(MATMUL_PRECISIONS)}")
    return kind
