"""Microbenchmarks: copy bandwidth, matmul throughput and peak memory, and their fraction of a ceiling."""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import psutil
import torch

from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.fingerprint import _usable_cores
from labkit.probes._common import (
    _MEASURED_KINDS,
    MATMUL_PRECISIONS,
    _cuda_missing,
    _is_number,
    _is_whole,
    _rate_unit,
)
from labkit.probes._datasheets import _cpu_last_level_cache
from labkit.probes._timing import _check_timing, measure_time
from labkit.readings import Reading

__all__ = ["OversubscribedWarning", "copy_bandwidth", "fraction_of_ceiling", "matmul_throughput", "peak_memory"]

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SCALE = {"GB/s": 1e9, "TB/s": 1e12, "GFLOP/s": 1e9, "TFLOP/s": 1e12}
_QUANTITY = {"GB/s": "bandwidth", "TB/s": "bandwidth", "GFLOP/s": "throughput", "TFLOP/s": "throughput"}
_MIB = 2**20


class OversubscribedWarning(RuntimeWarning):
    """torch runs more threads than this process has cores, so CPU timings run slow and jitter."""


def copy_bandwidth(device=None, *, size_mib: float | None = None, warmup: int = 2,
                   min_run_time: float = 0.5) -> Reading:
    """Memory bandwidth of a device-to-device copy, counting bytes read plus bytes written.

    The buffers default to several times the last-level cache (at least 2 GiB on a GPU, 64 MiB on
    a CPU) so the copy measures memory, not cache; ``size_mib`` sets one buffer's size, and both
    must fit in the memory available now. GB/s on a CPU, TB/s on a GPU. Used in
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
    Used in `02_gradients_accumulate`.
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

    Used in `16_speed_and_memory`.
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
