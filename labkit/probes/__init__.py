"""Measure the machine a notebook runs on, and say plainly when a number cannot be had.

Every probe returns a `labkit.readings.Reading`: a measured number, a datasheet number, an estimate,
or "unavailable" with the reason (a GPU-only probe on a CPU says "needs a CUDA device"). On a CPU the
bandwidth and matmul probes measure the CPU (GB/s, GFLOP/s); on a CUDA device they measure the GPU
(TB/s, TFLOP/s) and can be set against the datasheet ceilings in `DATASHEETS`.

Used in `00_start_here` (the machine's fingerprint, from `labkit.fingerprint`), `12_batch_size`
(timer, utilisation), `16_speed_and_memory` (copy bandwidth against its ceiling) and
`02_gradients_accumulate` (peak memory).
"""

from labkit.fingerprint import fingerprint, format_fingerprint
from labkit.probes._common import MATMUL_PRECISIONS
from labkit.probes._datasheets import (
    DATASHEETS,
    GpuDatasheet,
    ceiling,
    datasheet_ceiling,
    datasheet_for,
    device_facts,
)
from labkit.probes._throughput import (
    OversubscribedWarning,
    copy_bandwidth,
    fraction_of_ceiling,
    matmul_throughput,
    peak_memory,
)
from labkit.probes._timing import Timing, measure_time
from labkit.probes._utilisation import UtilisationSampler

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
