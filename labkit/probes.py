"""Measure the machine a notebook runs on, and say plainly when a number cannot be had.

Every probe returns a `labkit.readings.Reading`: a measured number, a datasheet number, an estimate,
or "unavailable" with the reason (a GPU-only probe on a CPU says "needs a CUDA device"). On a CPU the
bandwidth and matmul probes measure the CPU (GB/s, GFLOP/s); on a CUDA device they measure the GPU
(TB/s, TFLOP/s) and can be set against the datasheet ceilings in `DATASHEETS`.

Taught in `00_start_here` (the machine's fingerprint, from `labkit.fingerprint`), `12_batch_size`
(timer, utilisation), `16_speed_and_memory` (copy bandwidth against its ceiling) and
`02_gradients_accumulate` (peak memory).
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch.utils import benchmark

from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.fingerprint import _NEEDS_CUDA, _usable_cores, fingerprint, format_fingerprint
from labkit.readings import Reading

__all__ = [
    "DATASHEETS",
    "MATMUL_PRECISIONS",
    "GpuDatasheet",
    "OversubscribedWarning",
    "Timing",
    "UtilisationSampler",
    "ceiling",
    "copy_bandwidth",
    "datasheet_ceiling",
    "datasheet_for",
    "device_facts",
    "fingerprint",
    "format_fingerprint",
    "fraction_of_ceiling",
    "matmul_throughput",
    "measure_time",
    "peak_memory",
]

MATMUL_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""The matmul precisions `matmul_throughput` measures; tf32 is fp32 storage on TF32 tensor cores."""

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SCALE = {"GB/s": 1e9, "TB/s": 1e12, "GFLOP/s": 1e9, "TFLOP/s": 1e12}
_QUANTITY = {"GB/s": "bandwidth", "TB/s": "bandwidth", "GFLOP/s": "throughput", "TFLOP/s": "throughput"}
_MIN_SAMPLES = 5  # fewer samples than this give no usable median or interquartile range
_MAX_SAMPLES = 2000  # caps the CUDA-event pairs recorded for very short kernels
_MIB = 2**20
# The timer's bounds, so that a probe returns within a stated time: min_run_time up to a minute of
# timing, and at most this many warmup calls.
_MAX_RUN_TIME_S = 60.0
_MAX_WARMUP = 1000
# The probes time with CUDA events or the wall clock and read CUDA counters: MPS has neither here.
# A CUDA device this machine lacks is still resolved, so a probe can answer "needs a CUDA device".
_MEASURED_KINDS = ("cpu", "cuda")


class OversubscribedWarning(RuntimeWarning):
    """torch runs more threads than this process has cores, so CPU timings run slow and jitter."""


# ---------------------------------------------------------------------------------------------
# Datasheet ceilings and device facts
# ---------------------------------------------------------------------------------------------


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
    ceiling needs. Taught in `16_speed_and_memory`.
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


# ---------------------------------------------------------------------------------------------
# Timer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Median and interquartile range of repeated timings of one call, in seconds."""

    median_s: float
    iqr_s: float
    samples: int
    method: str

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0.02 means 2 %)."""
        return self.iqr_s / self.median_s

    def __str__(self) -> str:
        return (f"{self.median_s * 1e3:.4g} ms median, spread {self.spread:.1%} "
                f"over {self.samples} samples ({self.method})")


def measure_time(fn: Callable[[], object], *, device=None, warmup: int = 2, min_run_time: float = 0.5) -> Timing:
    """Time ``fn()`` after ``warmup`` calls: CUDA events on a GPU, a synchronised wall clock on a CPU.

    On a GPU the calls are queued back to back between pairs of `torch.cuda.Event`, so the host
    never stalls the device; on a CPU, `torch.utils.benchmark.Timer.blocked_autorange` times blocks
    of calls with torch's own thread count. Either way at least 5 samples and about
    ``min_run_time`` seconds are collected. It returns after about ``warmup`` calls plus
    ``min_run_time`` or 5 calls, whichever is longer: ``min_run_time`` is at most 60 s and
    ``warmup`` at most 1000 calls. Taught in `12_batch_size`.
    """
    if not callable(fn):
        raise LabkitError(f"measure_time needs a function to call, not {type(fn).__name__}: pass lambda: work()")
    _check_timing(warmup, min_run_time)
    dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
    if reason := _cuda_missing(dev):
        raise LabkitError(f"cannot time on {dev}: {reason}; use device='cpu'")
    for _ in range(warmup):
        fn()
    if dev.type == "cuda":
        return _time_with_events(fn, dev, min_run_time)
    return _time_with_wall_clock(fn, min_run_time)


def _check_timing(warmup, min_run_time) -> None:
    """The timer's arguments, checked before a probe allocates anything for it."""
    if not _is_whole(warmup) or not 0 <= warmup <= _MAX_WARMUP:
        raise LabkitError(f"warmup must be a whole number of calls from 0 to {_MAX_WARMUP}, not {warmup!r}")
    if not _is_number(min_run_time) or not 0 < min_run_time <= _MAX_RUN_TIME_S:
        raise LabkitError(f"min_run_time must be a positive number of seconds, at most {_MAX_RUN_TIME_S:g} "
                          f"(so that the probe returns), not {min_run_time!r}")


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A real, finite number (not a bool, not a string, not nan or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _time_with_events(fn, dev: torch.device, min_run_time: float) -> Timing:
    with torch.cuda.device(dev):
        first = max(_event_times(fn, 1)[0], 1e-6)  # an empty call can read 0 ms
        repeats = min(max(math.ceil(min_run_time / first), _MIN_SAMPLES), _MAX_SAMPLES)
        times = _event_times(fn, repeats)
    return _summarise(times, "CUDA events")


def _event_times(fn, repeats: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]


def _time_with_wall_clock(fn, min_run_time: float) -> Timing:
    # Timer defaults to one thread; a probe must run with the threads the notebook really uses.
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    times = list(measurement.times)
    # A call slower than min_run_time leaves one or two blocks: top up so the spread means something.
    while len(times) < _MIN_SAMPLES:
        times.append(timer.timeit(measurement.number_per_run).median)
    return _summarise(times, "torch.utils.benchmark wall clock")


def _summarise(times: list[float], method: str) -> Timing:
    quartiles = statistics.quantiles(times, n=4, method="inclusive")
    return Timing(statistics.median(times), quartiles[2] - quartiles[0], len(times), method)


# ---------------------------------------------------------------------------------------------
# Microbenchmarks
# ---------------------------------------------------------------------------------------------


def copy_bandwidth(device=None, *, size_mib: float | None = None, warmup: int = 2,
                   min_run_time: float = 0.5) -> Reading:
    """Memory bandwidth of a device-to-device copy, counting bytes read plus bytes written.

    The buffers default to several times the last-level cache (at least 2 GiB on a GPU, 64 MiB on
    a CPU) so the copy measures memory, not cache; ``size_mib`` sets one buffer's size, and both
    must fit in the memory available now. GB/s on a CPU, TB/s on a GPU. Taught in
    `16_speed_and_memory`; compare with `ceiling("copy")`.
    """
    _check_timing(warmup, min_run_time)
    dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
    unit = _rate_unit("copy", dev)
    if reason := _cuda_missing(dev):
        return Reading.unavailable(unit, reason)
    nbytes = _copy_bytes(dev, size_mib)
    threads = _check_threads(dev)
    src = torch.rand(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    timing = measure_time(lambda: dst.copy_(src), device=dev, warmup=warmup, min_run_time=min_run_time)
    moved = 2 * src.nbytes  # each byte is read from src once and written to dst once
    return Reading(moved / timing.median_s / _SCALE[unit], unit, "measured",
                   source=f"Tensor.copy_ of {src.nbytes / _MIB:.0f} MiB, bytes read + written; {timing}{threads}")


def matmul_throughput(dtype="bf16", device=None, *, n: int | None = None, warmup: int = 2,
                      min_run_time: float = 0.5) -> Reading:
    """Dense matmul throughput of an n×n by n×n product on random data, 2·n³ FLOP per product.

    ``dtype`` is one of `MATMUL_PRECISIONS` ("fp32", "tf32", "bf16", "fp16") or torch.float32 /
    bfloat16 / float16. fp32 runs with TF32 off and tf32 with it on, whatever the notebook set.
    GFLOP/s on a CPU, TFLOP/s on a GPU. The three n×n matrices must fit in the memory available now.
    """
    _check_timing(warmup, min_run_time)
    precision = _precision(dtype)
    dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
    unit = _rate_unit(precision, dev)
    if reason := _cuda_missing(dev) or _unsupported(precision, dev):
        return Reading.unavailable(unit, reason)
    n = _default_n(precision, dev) if n is None else _check_n(n, _DTYPES[precision], dev)
    threads = _check_threads(dev)
    a, b = (torch.randn(n, n, device=dev, dtype=_DTYPES[precision]) for _ in range(2))
    out = torch.empty_like(a)
    with _fp32_matmul_precision(precision):
        timing = measure_time(lambda: torch.mm(a, b, out=out), device=dev, warmup=warmup,
                              min_run_time=min_run_time)
    return Reading(2 * n**3 / timing.median_s / _SCALE[unit], unit, "measured",
                   source=f"torch.mm {precision} {n}×{n}×{n} on random data; {timing}{threads}")


def peak_memory(device=None) -> Reading:
    """Peak bytes held by tensors on a CUDA device since start or `torch.cuda.reset_peak_memory_stats()`.

    On a CPU it is unavailable: `torch.cuda.max_memory_allocated` returns 0 there, and a process's
    resident peak mixes in Python and library memory, so it is not passed off as a tensor peak.
    Taught in `02_gradients_accumulate`.
    """
    dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
    if dev.type == "cpu":
        return Reading.unavailable(
            "B", "needs a CUDA device: torch counts tensor peaks only in the CUDA caching allocator"
        )
    if reason := _cuda_missing(dev):
        return Reading.unavailable("B", reason)
    return Reading(torch.cuda.max_memory_allocated(dev), "B", "measured",
                   source="torch.cuda.max_memory_allocated since start or reset_peak_memory_stats()")


def fraction_of_ceiling(achieved: Reading, ceiling_reading: Reading) -> Reading:
    """Achieved / ceiling in percent, converting GB/s↔TB/s and GFLOP/s↔TFLOP/s; unavailable if either is.

    Taught in `16_speed_and_memory`.
    """
    if not isinstance(achieved, Reading) or not isinstance(ceiling_reading, Reading):
        raise LabkitError(
            "fraction_of_ceiling needs two Readings: fraction_of_ceiling(copy_bandwidth(), ceiling('copy'))"
        )
    if not achieved.available:
        return Reading.unavailable("%", f"no achieved value: {achieved.reason}")
    if not ceiling_reading.available:
        return Reading.unavailable("%", f"no ceiling: {ceiling_reading.reason}")
    quantities = {_QUANTITY.get(achieved.unit), _QUANTITY.get(ceiling_reading.unit)}
    if None in quantities or len(quantities) > 1:
        raise LabkitError(f"cannot compare {achieved.unit} with {ceiling_reading.unit}: "
                          "compare bandwidth with bandwidth (GB/s, TB/s) or FLOP/s with FLOP/s")
    if not (_is_number(achieved.value) and achieved.value >= 0):
        raise LabkitError(f"the achieved {achieved.unit} reading is {achieved.value!r}: a rate is a finite number ≥ 0")
    if not (_is_number(ceiling_reading.value) and ceiling_reading.value > 0):
        raise LabkitError(f"the ceiling reads {ceiling_reading.value!r} {ceiling_reading.unit}, and no fraction of "
                          "that can be taken: a ceiling is a finite rate above 0; pass ceiling('copy') or a datasheet "
                          "value")
    ratio = float(achieved) * _SCALE[achieved.unit] / (float(ceiling_reading) * _SCALE[ceiling_reading.unit])
    return Reading(100 * ratio, "%", "estimated",
                   source=f"{achieved.provenance} {achieved.value:.4g} {achieved.unit} / "
                          f"{ceiling_reading.provenance} {ceiling_reading.value:.4g} {ceiling_reading.unit}")


def _cuda_missing(dev: torch.device) -> str:
    """Why a CUDA device cannot be measured here, or "" when it can (or the device is the CPU)."""
    if dev.type != "cuda":
        return ""
    if not torch.cuda.is_available():
        return _NEEDS_CUDA
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"needs a CUDA device: {dev} does not exist, this machine has {torch.cuda.device_count()}"
    return ""


def _check_kind(kind: str) -> str:
    if kind != "copy" and kind not in MATMUL_PRECISIONS:
        raise LabkitError(f"unknown ceiling kind {kind!r}: use 'copy' or one of {', '.join(MATMUL_PRECISIONS)}")
    return kind


def _precision(dtype) -> str:
    if isinstance(dtype, torch.dtype) and dtype in _PRECISION_OF_DTYPE:
        return _PRECISION_OF_DTYPE[dtype]
    if dtype in MATMUL_PRECISIONS:
        return dtype
    raise LabkitError(f"unknown matmul precision {dtype!r}: use one of {', '.join(MATMUL_PRECISIONS)} "
                      "or torch.float32 / torch.bfloat16 / torch.float16")


def _unsupported(precision: str, dev: torch.device) -> str:
    """Why this precision has no tensor-core path on the device, or ""."""
    if precision not in ("tf32", "bf16"):
        return ""
    if dev.type == "cpu":
        return "" if precision == "bf16" else "needs a CUDA device: TF32 is a mode of NVIDIA tensor cores"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return (f"needs compute capability 8.0 or newer for {precision} tensor cores; "
                f"{torch.cuda.get_device_name(dev)} is {major}.{minor}")
    return ""


@contextmanager
def _fp32_matmul_precision(precision: str):
    """fp32 runs in IEEE fp32 and tf32 on TF32 tensor cores, restoring the notebook's setting after."""
    if precision not in ("fp32", "tf32"):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _rate_unit(kind: str, dev: torch.device) -> str:
    if kind == "copy":
        return "TB/s" if dev.type == "cuda" else "GB/s"
    return "TFLOP/s" if dev.type == "cuda" else "GFLOP/s"


def _default_n(precision: str, dev: torch.device) -> int:
    if dev.type == "cuda":
        return 8192  # over a TFLOP per product: launch overhead vanishes, and 3 fp32 matrices take 768 MiB
    # CPUs without native fp16 arithmetic run fp16 matmul through a slow path (~1 GFLOP/s): keep it short.
    return 256 if precision == "fp16" else 1024


def _check_n(n, dtype: torch.dtype, dev: torch.device) -> int:
    if not _is_whole(n) or n < 1:
        raise LabkitError(f"n must be a positive whole matrix size, not {n!r}")
    needed, available = 3 * n * n * dtype.itemsize, _available_bytes(dev)
    if needed > available:
        largest = math.isqrt(available // (3 * dtype.itemsize))
        raise LabkitError(f"n={n} needs three {n}×{n} matrices, {needed / _MIB:,.0f} MiB, and {dev} has "
                          f"{available / _MIB:,.0f} MiB available now: pass n of at most {largest}")
    return n


def _available_bytes(dev: torch.device) -> int:
    """Memory a probe's buffers can take on the device now."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    return psutil.virtual_memory().available


def _copy_bytes(dev: torch.device, size_mib) -> int:
    if size_mib is not None:
        if not _is_number(size_mib) or not size_mib > 0:
            raise LabkitError(f"size_mib must be a positive, finite number of MiB, not {size_mib!r}")
        nbytes = max(4, int(size_mib * _MIB)) // 4 * 4
        available = _available_bytes(dev)
        if 2 * nbytes > available:
            raise LabkitError(f"size_mib={size_mib!r} needs two buffers of {nbytes / _MIB:,.0f} MiB, and {dev} has "
                              f"{available / _MIB:,.0f} MiB available now: pass size_mib of at most "
                              f"{available // 2 // _MIB:,}")
        return nbytes
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cache = torch.cuda.get_device_properties(dev).L2_cache_size
        return min(max(2 * 2**30, 16 * cache), free // 4) // 4 * 4
    cache = _cpu_last_level_cache()
    cache_bytes = cache.value if cache.available else 32 * _MIB
    return min(max(64 * _MIB, 4 * cache_bytes), psutil.virtual_memory().available // 8) // 4 * 4


def _check_threads(dev: torch.device) -> str:
    """Warn when torch runs more threads than cores; return a note for the reading's source."""
    if dev.type != "cpu":
        return ""
    threads, cores = torch.get_num_threads(), _usable_cores()
    if threads <= cores:
        return f"; {threads} threads on {cores} cores"
    warnings.warn(
        f"torch runs {threads} threads on {cores} usable cores: they compete, so CPU timings run slow "
        f"and jitter; call torch.set_num_threads({cores})",
        OversubscribedWarning,
        stacklevel=3,
    )
    return f"; {threads} threads on {cores} cores (oversubscribed)"


# ---------------------------------------------------------------------------------------------
# Utilisation sampler
# ---------------------------------------------------------------------------------------------


class UtilisationSampler:
    """Sample device utilisation in the background while a with-block runs.

    On a GPU it reads NVML through `torch.cuda.utilization`: the percentage of time in which at
    least one kernel was running, which is not how many SMs were busy. On a CPU it reads this
    process's CPU time with psutil, as a percentage of the usable cores. Taught in `12_batch_size`::

        with UtilisationSampler() as sampler:
            train_a_few_steps()
        print(sampler.mean())

    One sampler can be used for several with-blocks, one after another: each block starts afresh,
    and ``mean()`` covers the last one.
    """

    def __init__(self, device=None, *, interval_s: float = 0.1):
        if not interval_s > 0:
            raise LabkitError(f"interval_s must be a positive number of seconds, not {interval_s!r}")
        self._interval_s = interval_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inside = False
        self._finished = False
        dev = resolve_device(device, kinds=_MEASURED_KINDS, must_exist=False)
        self._reader, self._unreadable = _utilisation_reader(dev)
        self._reason = self._unreadable

    @property
    def samples(self) -> tuple[float, ...]:
        return tuple(self._samples)

    def __enter__(self) -> UtilisationSampler:
        if self._inside:
            raise LabkitError("this UtilisationSampler is already sampling a with-block: use one sampler per "
                              "block at a time (a second UtilisationSampler for a nested block)")
        # a fresh block: nothing kept from the last one (its stop signal included)
        self._inside, self._finished = True, False
        self._samples, self._stop, self._reason = [], threading.Event(), self._unreadable
        # The first reading is dropped: psutil's first cpu_percent only sets its baseline.
        if self._reader is not None and self._sample():
            self._samples.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._sample()  # covers the stretch since the last tick
        self._inside, self._finished = False, True

    def mean(self) -> Reading:
        """Mean utilisation over the with-block, in percent."""
        if not self._finished:
            raise LabkitError(
                "read the sampler after its with-block: `with UtilisationSampler() as s: ...` then s.mean()"
            )
        if not self._samples:
            return Reading.unavailable("%", self._reason or "the with-block ended before a sample was taken")
        return Reading(statistics.fmean(self._samples), "%", "measured",
                       source=f"{self._reader.source}, mean of {len(self._samples)} samples "
                              f"every {self._interval_s} s")

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> bool:
        try:
            self._samples.append(self._reader.read())
        except self._reader.errors as err:
            # NVML failing mid-run: keep what was sampled, stop, and say why.
            self._reason = f"utilisation sampling failed: {type(err).__name__}: {err}"
            self._stop.set()
            return False
        return True


@dataclass(frozen=True)
class _Reader:
    read: Callable[[], float]
    errors: tuple[type[BaseException], ...]
    source: str


def _utilisation_reader(dev: torch.device) -> tuple[_Reader | None, str]:
    """How to read utilisation on this device, or (None, the reason it cannot be read)."""
    if dev.type == "cpu":
        process, cores = psutil.Process(), _usable_cores()
        return _Reader(lambda: process.cpu_percent(interval=None) / cores, (psutil.Error,),
                       f"psutil process CPU time as % of {cores} usable cores"), ""
    if reason := _cuda_missing(dev):
        return None, reason
    try:
        import pynvml
    except ImportError:
        return None, "needs NVML: nvidia-ml-py (pynvml) is not installed"
    # torch.cuda.utilization raises RuntimeError when the driver or the device is not visible to NVML.
    return _Reader(lambda: float(torch.cuda.utilization(dev)), (RuntimeError, pynvml.NVMLError),
                   "NVML via torch.cuda.utilization (time with a kernel running)"), ""
