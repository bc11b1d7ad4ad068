"""The timer: the median and spread of repeated calls, by CUDA events or a synchronised wall clock."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import benchmark

from labkit.devices import resolve_device
from labkit.errors import LabkitError
from labkit.probes._common import _MEASURED_KINDS, _cuda_missing, _is_number, _is_whole

__all__ = ["Timing", "measure_time"]

_MIN_SAMPLES = 5  # fewer samples than this give no usable median or interquartile range
_MAX_SAMPLES = 2000  # caps the CUDA-event pairs recorded for very short kernels
# The timer's bounds, so that a probe returns within a stated time: min_run_time up to a minute of
# timing, and at most this many warmup calls.
_MAX_RUN_TIME_S = 60.0
_MAX_WARMUP = 1000


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
    ``warmup`` at most 1000 calls. Used in `12_batch_size`.
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
